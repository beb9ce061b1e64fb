"""The elastic agent's vocabulary: specs, workers, states and failures.

Names and semantics follow torchelastic's agent API (``torchelastic.agent.server.api``,
torchelastic's ``torch_elastic_api.py``): a :class:`WorkerSpec` is the blueprint of one
role's workers, a :class:`WorkerGroup` the live set of them on one node, and an
:class:`ElasticAgent` runs the group until it succeeds or gives up. The agent
talks to the rendezvous only through torch's ``RendezvousHandler`` interface.

Differences from torchelastic's: validation raises :class:`~rdzv_core.errors.ConfigError`
(naming the field and the value) instead of asserting; ``max_restarts=0`` is
valid; a failed worker is described by a :class:`WorkerFailure`.
"""

from __future__ import annotations

import abc
import math
import signal
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rdzv_core.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = [
    "DEFAULT_ROLE",
    "WorkerSpec",
    "Worker",
    "WorkerState",
    "WorkerGroup",
    "MonitorResult",
    "WorkerFailure",
    "WorkerGroupFailureException",
    "SignalException",
    "ElasticAgent",
    "describe_exit",
]

DEFAULT_ROLE = "default"


def _check_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, value, "must be an integer")
    if value < minimum:
        raise ConfigError(field, value, f"must be >= {minimum}")
    return value


def _check_seconds(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(field, value, "must be a number of seconds")
    if not (0 < value < math.inf):
        raise ConfigError(field, value, "must be a finite number of seconds > 0")
    return float(value)


class WorkerSpec:
    """Blueprint of the workers of one role; the same on every node.

    Args:
        role: user-defined name of the workers (``ROLE_NAME``); non-empty str.
        local_world_size: workers to run on this node (int >= 1).
        fn: the worker entry point. :class:`~rdzv_agent.local.LocalElasticAgent`
            needs the program to execute (str), run as ``[fn, *args]``.
        args: arguments of the entry point (tuple of str for a program).
        rdzv_handler: torch ``RendezvousHandler`` of the run.
        max_restarts: how many times a FAILED/UNHEALTHY group is restarted before
            the agent gives up (int >= 0). Membership changes do not count.
        monitor_interval: seconds between checks of the workers (> 0).
        master_port: fixed port for rank 0's ``MASTER_PORT``; ``None`` (default)
            picks a free one each round and picks again if it is taken.
        local_addr: address this node publishes as ``MASTER_ADDR`` when it is
            group rank 0; ``None`` uses the host's fully qualified name.
            Neither is used when the handler shares its store with the workers
            (``use_agent_store``): then the store's address is the master endpoint.
        event_log_handler: destination of the agent's torch events (torch's
            ``WorkerSpec.event_log_handler``): a name registered in
            ``torch.distributed.elastic.events.handlers`` (``"null"``, ``"console"``, ...).
        restart_window: seconds a failure restart counts against ``max_restarts`` (``None``: for the
            job's life, torchrun's rule; :mod:`rdzv_agent.restart_budget`).

    Raises:
        ConfigError: a field is invalid (the message names it and the value).
    """

    __slots__ = [
        "role",
        "local_world_size",
        "fn",
        "args",
        "rdzv_handler",
        "max_restarts",
        "monitor_interval",
        "master_port",
        "local_addr",
        "event_log_handler",
        "restart_window",
    ]

    def __init__(
        self,
        role: str,
        local_world_size: int,
        fn: Callable[..., Any] | str,
        args: Sequence[Any],
        rdzv_handler: "RendezvousHandler",
        max_restarts: int = 100,
        monitor_interval: float = 5.0,
        master_port: int | None = None,
        local_addr: str | None = None,
        event_log_handler: str = "null",
        restart_window: float | None = None,
    ) -> None:
        if not isinstance(role, str) or not role or any(c.isspace() for c in role):
            raise ConfigError("role", role, "must be a non-empty string without whitespace")
        if rdzv_handler is None:
            raise ConfigError("rdzv_handler", rdzv_handler, "a RendezvousHandler is required")
        if not (callable(fn) or (isinstance(fn, str) and fn)):
            raise ConfigError("fn", fn, "must be a callable or a non-empty program name")
        if master_port is not None:
            _check_int("master_port", master_port, 1)
            if master_port > 65535:
                raise ConfigError("master_port", master_port, "must be <= 65535")
        if local_addr is not None and (not isinstance(local_addr, str) or not local_addr):
            raise ConfigError("local_addr", local_addr, "must be a non-empty host name or address")
        if not isinstance(event_log_handler, str) or not event_log_handler:
            raise ConfigError("event_log_handler", event_log_handler, "must be the name of a torch events handler")
        self.role = role
        self.local_world_size = _check_int("local_world_size", local_world_size, 1)
        self.fn = fn
        self.args = tuple(args)
        self.rdzv_handler = rdzv_handler
        self.max_restarts = _check_int("max_restarts", max_restarts, 0)
        self.monitor_interval = _check_seconds("monitor_interval", monitor_interval)
        self.master_port = master_port
        self.local_addr = local_addr
        self.event_log_handler = event_log_handler
        self.restart_window = None if restart_window is None else _check_seconds("restart_window", restart_window)

    def __repr__(self) -> str:
        return (
            f"WorkerSpec(role={self.role!r}, local_world_size={self.local_world_size}, "
            f"fn={self.fn!r}, max_restarts={self.max_restarts}, "
            f"monitor_interval={self.monitor_interval})"
        )


class Worker:
    """One worker of a :class:`WorkerGroup` (an instance of a :class:`WorkerSpec`).

    Attributes:
        id: what identifies the worker to its agent (the pid for the local agent),
            ``None`` until started.
        local_rank: rank among this node's workers (stable).
        global_rank: rank among all workers of the job (``RANK``); changes between rounds.
        role_rank: rank among the workers of its role (``ROLE_RANK``).
        world_size: number of workers in the current round (``WORLD_SIZE``: the sum of
            every node's local world size).
        role_world_size: number of workers of its role in the round (``ROLE_WORLD_SIZE``).
    """

    __slots__ = ["id", "local_rank", "global_rank", "role_rank", "world_size", "role_world_size"]

    def __init__(self, local_rank: int) -> None:
        self.id: Any = None
        self.local_rank: int = local_rank
        self.global_rank: int | None = None
        self.role_rank: int | None = None
        self.world_size: int | None = None
        self.role_world_size: int | None = None

    def __repr__(self) -> str:
        return (
            f"Worker(id={self.id!r}, local_rank={self.local_rank}, "
            f"global_rank={self.global_rank}, world_size={self.world_size})"
        )


class WorkerState(Enum):
    """State of a :class:`WorkerGroup`; its workers change state as a unit.

    ::

      UNKNOWN   - the agent lost track of the group (unrecoverable)
      INIT      - created, not started
      HEALTHY   - running and healthy
      UNHEALTHY - running and unhealthy
      STOPPED   - stopped by the agent (to be restarted)
      SUCCEEDED - all workers exited 0
      FAILED    - at least one worker failed

    If a single worker fails, the whole group is FAILED.
    """

    UNKNOWN = 0
    INIT = 1
    HEALTHY = 2
    UNHEALTHY = 4
    STOPPED = 8
    SUCCEEDED = 16
    FAILED = 32

    @staticmethod
    def is_running(state: "WorkerState") -> bool:
        """True if ``state`` means the worker processes exist (healthy or not)."""
        return state in {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


class WorkerGroup:
    """The workers of one :class:`WorkerSpec` on this node.

    ``store``, ``group_rank`` and ``group_world_size`` are set by each rendezvous
    (``None`` before the first); ``master_addr``/``master_port`` are those the
    round's group rank 0 published, or, when ``use_agent_store`` is True (the
    handler shares its store with the workers, e.g. torch's static rendezvous),
    the address of that store (the round's ``bootstrap_store_info``).
    """

    __slots__ = [
        "spec",
        "workers",
        "store",
        "group_rank",
        "group_world_size",
        "master_addr",
        "master_port",
        "use_agent_store",
        "state",
    ]

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Any = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.use_agent_store = False
        self.state = WorkerState.INIT


class WorkerFailure(Exception):
    """Why one worker failed.

    Attributes:
        global_rank, local_rank: the worker's ranks in the failed round.
        exit_code: the process exit status; negative ``-N`` if killed by signal N.
        error: the first lines of the worker's error (str, may be empty).
        log_path: file holding the worker's stderr, or ``None``.
        pid: process id, or ``None``.
        master_port_in_use: the worker could not bind ``MASTER_PORT`` because
            something else took it (EADDRINUSE); the agent re-chooses the port.
        error_file: the worker's ``TORCHELASTIC_ERROR_FILE`` (it may not exist), or ``None``.
        timestamp: wall-clock time the worker exited (seconds since the epoch), or ``None``.
    """

    def __init__(
        self,
        global_rank: int,
        local_rank: int,
        exit_code: int | None,
        error: str = "",
        log_path: str | None = None,
        pid: int | None = None,
        master_port_in_use: bool = False,
        error_file: str | None = None,
        timestamp: float | None = None,
    ) -> None:
        self.global_rank = global_rank
        self.local_rank = local_rank
        self.exit_code = exit_code
        self.error = error
        self.log_path = log_path
        self.pid = pid
        self.master_port_in_use = master_port_in_use
        self.error_file = error_file
        self.timestamp = timestamp
        super().__init__(self.describe())

    def describe(self) -> str:
        """One line: rank, exit status and the first line of the error."""
        first = self.error.strip().splitlines()[0] if self.error.strip() else "no error output"
        return f"rank {self.global_rank} (local rank {self.local_rank}) {describe_exit(self.exit_code)}: {first}"


def describe_exit(exit_code: int | None) -> str:
    """``"exited with code 3"``, ``"killed by SIGKILL"`` or ``"did not exit"``."""
    if exit_code is None:
        return "did not exit"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


class MonitorResult:
    """What one check of the workers found.

    Attributes:
        state: the group's new :class:`WorkerState`.
        ret_vals: for SUCCEEDED, each worker's result by global rank.
        exceptions: for FAILED, a :class:`WorkerFailure` (or other exception) by
            global rank, for the workers that failed.
        restart: ``False``: a FAILED/UNHEALTHY group must not be restarted, whatever
            restarts remain (the stuck-process check, :mod:`rdzv_agent.supervision.stuck`).
    """

    __slots__ = ["state", "ret_vals", "exceptions", "restart"]

    def __init__(
        self,
        state: WorkerState,
        ret_vals: dict[int, Any] | None = None,
        exceptions: dict[int, Exception] | None = None,
        restart: bool = True,
    ) -> None:
        self.state = state
        self.ret_vals = ret_vals or {}
        self.exceptions = exceptions or {}
        self.restart = restart


class WorkerGroupFailureException(Exception):
    """The agent could not, or gave up trying to, run the workers (e.g. ``max_restarts`` spent).

    Args:
        msg: what happened.
        worker_excs: global rank -> the worker's exception (a :class:`WorkerFailure`
            for the local agent) for the workers that failed last.
    """

    def __init__(self, msg: str, worker_excs: dict[int, Exception]) -> None:
        super().__init__(msg)
        self._worker_excs = dict(worker_excs)

    def get_worker_exceptions(self) -> dict[int, Exception]:
        """Global rank -> exception of each failed worker."""
        return dict(self._worker_excs)


class SignalException(Exception):
    """The agent's process received a termination signal (raised by the launcher's handler).

    The agent forwards ``signum`` to its workers when it stops them.

    Attributes:
        signum: the signal number (int).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        super().__init__(f"received {name}")


class ElasticAgent(abc.ABC):
    """Runs one node's workers of an elastic job and re-forms them with the other nodes.

    Usage::

        try:
            results = agent.run()
        except WorkerGroupFailureException as e:
            for rank, exc in e.get_worker_exceptions().items():
                print(rank, exc)
    """

    @abc.abstractmethod
    def run(self, role: str = DEFAULT_ROLE) -> dict[int, Any]:
        """Run the workers, restarting them on failure up to ``max_restarts``.

        Returns:
            Each worker's result by global rank.

        Raises:
            WorkerGroupFailureException: the workers did not finish successfully.
            torch ``RendezvousError`` subclasses: the rendezvous failed
            (timeout, closed run, backend unreachable).
        """

    @abc.abstractmethod
    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The (mutable, live) :class:`WorkerGroup` of ``role``."""
