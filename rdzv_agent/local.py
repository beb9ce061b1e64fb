"""``LocalElasticAgent``: run the workers as subprocesses of this node.

Each worker is ``[spec.fn, *spec.args]`` (a Python interpreter with a script or
``-m module``, or any executable), started in its own session with torchrun's
environment variables:

=============================  =====================================================
``LOCAL_RANK``                 rank among this node's workers
``RANK``                       global rank: group rank order, then local rank (torch's rule)
``ROLE_RANK``                  rank among the workers of this role
``GROUP_RANK``                 this node's rank in the round
``WORLD_SIZE``                 workers in the round (the sum over nodes of their local world size)
``ROLE_WORLD_SIZE``            workers of this role in the round
``LOCAL_WORLD_SIZE``           workers on this node
``GROUP_WORLD_SIZE``           nodes in the round
``ROLE_NAME``                  the spec's role
``MASTER_ADDR``/``MASTER_PORT``  published by group rank 0 (:mod:`rdzv_agent.master`)
``TORCHELASTIC_RESTART_COUNT`` restarts spent on failures so far
``TORCHELASTIC_MAX_RESTARTS``  the spec's ``max_restarts``
``TORCHELASTIC_RUN_ID``        ``handler.get_run_id()``
``TORCHELASTIC_ERROR_FILE``    per worker; torch's ``@record`` writes the error there
``TORCHELASTIC_USE_AGENT_STORE``  ``True`` if the handler shares its store with the
                               workers (``use_agent_store``, e.g. static), else ``False``
``OMP_NUM_THREADS``            ``1`` if unset and more than one local worker
``PYTHONUNBUFFERED``           ``1``
=============================  =====================================================

Logs: ``LOG_DIR/RUN_ID_xxxx/attempt_N/LOCAL_RANK/{stderr,stdout}.log``, ``N``
counting every start of the group (failures and membership changes alike).
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
import threading
from typing import Any, Callable, Mapping

from rdzv_core.errors import ConfigError

from . import master
from .api import MonitorResult, WorkerFailure, WorkerGroup, WorkerSpec, WorkerState
from .process import WorkerProcess, stop_processes
from .simple import DEFAULT_EXIT_BARRIER_TIMEOUT, AgentEvent, SimpleElasticAgent
from .streams import Std, std_for_rank
from .telemetry import prof

__all__ = ["LocalElasticAgent", "DEFAULT_STOP_GRACE"]

#: Seconds between SIGTERM and SIGKILL when stopping workers (torchrun's ``--shutdown-timeout`` default).
DEFAULT_STOP_GRACE = 30.0


def _safe_dir_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=+" else "_" for c in text).lstrip(".") or "run"


class LocalElasticAgent(SimpleElasticAgent):
    """Runs ``spec.local_world_size`` worker subprocesses on this node.

    Args:
        spec: ``spec.fn`` is the program (str), ``spec.args`` its arguments.
        log_dir: parent directory of this agent's logs; a new temporary directory
            (kept after exit) when ``None``.
        redirects: streams written to the log files only (:class:`Std` or per local rank).
        tee: streams written to the log files and the console.
        env: base environment of the workers (default ``os.environ``); the
            launcher passes one without secrets.
        stop_grace: seconds between SIGTERM and SIGKILL when stopping (>= 0; torchrun's
            ``--shutdown-timeout``, default 30): workers hung in a collective may ignore SIGTERM.
        listener, exit_barrier_timeout: see :class:`SimpleElasticAgent`.

    Raises:
        ConfigError: ``spec.fn`` is not a program name, or ``stop_grace`` is invalid.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        env: Mapping[str, str] | None = None,
        stop_grace: float = DEFAULT_STOP_GRACE,
        listener: Callable[[AgentEvent], None] | None = None,
        exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT,
    ) -> None:
        if not isinstance(spec.fn, str):
            raise ConfigError("fn", spec.fn, "LocalElasticAgent runs programs: give the executable (str)")
        if isinstance(stop_grace, bool) or not isinstance(stop_grace, (int, float)) or not 0 <= stop_grace < math.inf:
            raise ConfigError("stop_grace", stop_grace, "must be a finite number of seconds >= 0")
        super().__init__(spec, listener, exit_barrier_timeout)
        self._redirects = redirects
        self._tee = tee
        self._base_env = dict(os.environ if env is None else env)
        self._stop_grace = float(stop_grace)
        root = log_dir if log_dir is not None else tempfile.mkdtemp(prefix="rdzv-run-")
        os.makedirs(root, exist_ok=True)
        run_id = _safe_dir_name(spec.rdzv_handler.get_run_id())
        self._log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=root)
        self._procs: dict[int, WorkerProcess] = {}
        self._global_ranks: dict[int, int] = {}
        self._starts = 0
        self._exited = threading.Event()

    @property
    def log_dir(self) -> str:
        """This agent's log directory (``LOG_DIR/RUN_ID_xxxx``)."""
        return self._log_dir

    def attempt_log_dir(self) -> str | None:
        """Log directory of the latest start of the group, or ``None`` before the first."""
        return os.path.join(self._log_dir, f"attempt_{self._starts - 1}") if self._starts else None

    def worker_exit_codes(self) -> dict[int, tuple[int, int | None, bool]]:
        """Latest workers: global rank -> (local rank, exit status or None, stopped by the agent).

        "Stopped by the agent" means the worker died of the signal the agent sent
        it (restart, re-rendezvous, shutdown); a worker that exited with its own
        code or signal is not, even if the agent was stopping it at the time
        (see :attr:`WorkerProcess.stopped_by_agent`).
        """
        return {
            self._global_ranks[lr]: (lr, proc.poll(), proc.stopped_by_agent)
            for lr, proc in sorted(self._procs.items())
        }

    def _worker_env(self, group: WorkerGroup, local_rank: int) -> dict[str, str]:
        spec = group.spec
        worker = group.workers[local_rank]
        env = dict(self._base_env)
        env.update(
            LOCAL_RANK=str(local_rank),
            RANK=str(worker.global_rank),
            GROUP_RANK=str(group.group_rank),
            ROLE_RANK=str(worker.role_rank),
            ROLE_NAME=spec.role,
            LOCAL_WORLD_SIZE=str(spec.local_world_size),
            WORLD_SIZE=str(worker.world_size),
            GROUP_WORLD_SIZE=str(group.group_world_size),
            ROLE_WORLD_SIZE=str(worker.role_world_size),
            MASTER_ADDR=str(group.master_addr),
            MASTER_PORT=str(group.master_port),
            TORCHELASTIC_RESTART_COUNT=str(self.restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
            TORCHELASTIC_RUN_ID=spec.rdzv_handler.get_run_id(),
            TORCHELASTIC_USE_AGENT_STORE=str(bool(group.use_agent_store)),
            PYTHONUNBUFFERED="1",
        )
        if spec.local_world_size > 1 and "OMP_NUM_THREADS" not in self._base_env:
            env["OMP_NUM_THREADS"] = "1"
        return env

    @prof
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start one subprocess per local rank; return local rank -> pid.

        Raises:
            OSError: a worker could not be started (the others are stopped).
        """
        spec = worker_group.spec
        attempt_dir = os.path.join(self._log_dir, f"attempt_{self._starts}")
        self._starts += 1
        self._exited.clear()
        self._procs = {}
        self._global_ranks = {w.local_rank: int(w.global_rank or 0) for w in worker_group.workers}
        argv = [str(spec.fn), *map(str, spec.args)]
        try:
            for worker in worker_group.workers:
                lr = worker.local_rank
                self._procs[lr] = WorkerProcess(
                    argv,
                    self._worker_env(worker_group, lr),
                    os.path.join(attempt_dir, str(lr)),
                    redirect=std_for_rank(self._redirects, lr),
                    tee=std_for_rank(self._tee, lr),
                    prefix=f"[{spec.role}{lr}]:",
                    on_exit=self._exited,
                )
        except OSError:
            self._stop_workers(worker_group)
            raise
        return {lr: proc.pid for lr, proc in self._procs.items()}

    @prof
    def _stop_workers(self, worker_group: WorkerGroup, sig: int = signal.SIGTERM) -> None:
        """Stop every worker and its process tree (``sig``, then SIGKILL after the grace period)."""
        stop_processes(list(self._procs.values()), sig, self._stop_grace)

    def _shutdown(self, death_sig: int = signal.SIGTERM) -> None:
        self._stop_workers(self._worker_group, death_sig)

    def _wait(self, seconds: float) -> None:
        self._exited.wait(seconds)
        self._exited.clear()

    @prof
    def _monitor_workers(self, worker_group: WorkerGroup) -> MonitorResult:
        """FAILED if any worker exited non-zero, SUCCEEDED if all exited 0, else HEALTHY."""
        codes = {lr: proc.poll() for lr, proc in self._procs.items()}
        failed = {lr: code for lr, code in codes.items() if code not in (None, 0)}
        if failed:
            failures: dict[int, Exception] = {}
            for lr in sorted(failed, key=lambda r: self._procs[r].exited_at):
                proc = self._procs[lr]
                error = proc.error()
                failures[self._global_ranks[lr]] = WorkerFailure(
                    global_rank=self._global_ranks[lr],
                    local_rank=lr,
                    exit_code=failed[lr],
                    error=error,
                    log_path=proc.stderr_path,
                    pid=proc.pid,
                    master_port_in_use=self._global_ranks[lr] == 0 and master.is_port_in_use_error(error),
                    error_file=proc.error_file,
                    timestamp=proc.exited_wall_time,
                )
            return MonitorResult(WorkerState.FAILED, exceptions=failures)
        if codes and all(code == 0 for code in codes.values()):
            return MonitorResult(WorkerState.SUCCEEDED, ret_vals={self._global_ranks[lr]: 0 for lr in codes})
        return MonitorResult(WorkerState.HEALTHY)
