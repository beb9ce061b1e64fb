"""``SimpleElasticAgent``: rendezvous, start, monitor, restart — torchelastic's agent loop.

The loop (torchelastic's ``SimpleElasticAgent.run``)::

    rendezvous -> start workers -> every monitor_interval:
        SUCCEEDED           -> return the workers' results
        FAILED / UNHEALTHY  -> restart (rendezvous again) while max_restarts lasts,
                               then stop the workers and raise WorkerGroupFailureException
        HEALTHY             -> if handler.num_nodes_waiting() > 0 (and the workers are still
                               healthy after it answered): restart, which
                               does NOT spend a restart (membership change)

Additions to torchelastic's: group rank 0 publishes MASTER_ADDR/MASTER_PORT through the
round's store (:mod:`rdzv_agent.master_address`), unless the handler shares its own store
with the workers (``use_agent_store``, e.g. torch's static rendezvous): then the
workers get that store's address (``bootstrap_store_info``) and
``TORCHELASTIC_USE_AGENT_STORE=True``, as with torch's agent. Setup trouble makes the agent
re-rendezvous without spending a restart, at most :data:`MAX_SETUP_RETRIES` times
per run: a worker that failed because the master port was taken (or rank 0 finds
it taken just before starting), or a master endpoint that never appeared in the
store (group rank 0 died right after the round formed). Any exception leaving
:meth:`run` stops the workers first (forwarding a :class:`SignalException`'s signal).

The agent knows only torch's ``RendezvousHandler`` interface.
"""

from __future__ import annotations

import abc
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from torch.distributed import DistError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from rdzv_core.errors import ConfigError
from rdzv_core.outage import OutageLog

from . import coordination, master_address
from .api import (
    DEFAULT_ROLE,
    ElasticAgent,
    MonitorResult,
    WorkerFailure,
    WorkerGroup,
    WorkerGroupFailureException,
    WorkerSpec,
    WorkerState,
)
from .restart_budget import RestartBudget
from .supervision.hang_watch import WorkerHang
from .supervision.health import Heartbeat
from .reporting.torch_events import AgentTelemetry, prof, profiled

__all__ = ["SimpleElasticAgent", "AgentEvent", "MAX_SETUP_RETRIES", "DEFAULT_EXIT_BARRIER_TIMEOUT"]

log = logging.getLogger(__name__)

#: Re-rendezvous rounds per run for setup trouble (port taken, master endpoint missing).
MAX_SETUP_RETRIES = 3
#: torch's default ``exit_barrier_timeout`` (seconds).
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0
#: Seconds the agent waits for the round's other agents in its store (master endpoint, ranks) before
#: it re-rendezvouses (a setup retry), for a store without a ``timeout`` (c10d's default); the round's
#: loss is noticed sooner, between wait slices.
SETUP_WAIT = 300.0


class _NoMasterEndpoint(Exception):
    """The round's store never showed group rank 0's master endpoint (or failed while waiting)."""


@dataclass(frozen=True)
class AgentEvent:
    """Something the agent did, for a listener (e.g. the launcher's progress output).

    Attributes:
        kind: ``"rendezvous"`` (about to wait for a round), ``"rendezvous_done"``,
            ``"started"``, ``"restarting"``, ``"exit_barrier"``, ``"succeeded"`` or ``"failed"``.
        role: the spec's role.
        data: details by kind — ``rendezvous``: ``attempt``; ``rendezvous_done``:
            ``group_rank``, ``group_world_size``, ``world_size``, ``global_ranks``,
            ``master_addr``, ``master_port``; ``started``: ``pids``;
            ``restarting``: ``reason`` (``"failed"``, ``"hang"`` (a failure: no progress), ``"membership"``,
            ``"port_in_use"``, ``"no_master"``), ``remaining_restarts``, ``failures`` or
            ``nodes_waiting``; ``exit_barrier``: ``timeout`` (about to wait);
            ``succeeded``: ``results``, ``exit_barrier`` (its outcome); ``failed``: ``failures``,
            ``restart`` (``False``: the failure was not restartable, e.g. a stuck worker).
    """

    kind: str
    role: str
    data: dict[str, Any] = field(default_factory=dict)


def _bootstrap_endpoint(info: Any) -> tuple[str, int]:
    """``(master_addr, master_port)`` of a round's ``bootstrap_store_info``.

    Raises:
        torch ``RendezvousStateError``: the handler gave no usable address.
    """
    boot = getattr(info, "bootstrap_store_info", None)
    addr, port = getattr(boot, "master_addr", None), getattr(boot, "master_port", None)
    if not isinstance(addr, str) or not addr or isinstance(port, bool) or not isinstance(port, int) \
            or not 0 < port < 65536:
        raise RendezvousStateError(
            f"the handler shares its store (use_agent_store) but gave no usable address: {addr!r}:{port!r}"
        )
    return addr, port


class SimpleElasticAgent(ElasticAgent):
    """An :class:`ElasticAgent` for the workers of a single :class:`WorkerSpec`.

    Subclasses implement :meth:`_start_workers`, :meth:`_stop_workers` and
    :meth:`_monitor_workers`, and may override :meth:`_wait` (wake early when a
    worker exits) and :meth:`_shutdown` (stop on an exception).

    Args:
        spec: the workers to run.
        listener: called with an :class:`AgentEvent` at each step (optional);
            exceptions it raises propagate.
        exit_barrier_timeout: seconds an agent whose workers succeeded waits for the
            round's other agents before it returns (torch's ``exit_barrier_timeout``,
            default 300; 0 skips the barrier). See :attr:`exit_barrier`.
        heartbeat: beaten at each step and monitor pass (the health check's progress,
            :mod:`rdzv_agent.supervision.health`); a new one when ``None``.

    Raises:
        ConfigError: ``exit_barrier_timeout`` is negative or not a number.
    """

    def __init__(self, spec: WorkerSpec, listener: Callable[[AgentEvent], None] | None = None,
                 exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT,
                 heartbeat: Heartbeat | None = None) -> None:
        if isinstance(exit_barrier_timeout, bool) or not isinstance(exit_barrier_timeout, (int, float)) \
                or not 0 <= exit_barrier_timeout < float("inf"):
            raise ConfigError("exit_barrier_timeout", exit_barrier_timeout, "must be a finite number of seconds >= 0")
        self._exit_barrier_timeout = float(exit_barrier_timeout)
        self._exit_barrier_outcome: str | None = None
        self._worker_group = WorkerGroup(spec)
        self._budget = RestartBudget(spec.max_restarts, spec.restart_window,
                                     on_verdict=lambda verdict: self._emit("attributed", **verdict))
        self._setup_retries_left = MAX_SETUP_RETRIES
        self._membership_restarts = 0
        self._rendezvous_count = 0
        self._listener = listener
        self._waiting_check_outage = OutageLog(log.log)  # failed num_nodes_waiting checks: one WARNING each outage
        self.heartbeat = heartbeat if heartbeat is not None else Heartbeat()
        self._telemetry = AgentTelemetry(self._worker_group, lambda: self.restart_count)

    # -- read-only views -------------------------------------------------------------

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The live worker group (this agent runs one role; ``role`` is not checked)."""
        return self._worker_group

    @property
    def telemetry(self) -> AgentTelemetry:
        """This agent's torch events and metrics (:mod:`rdzv_agent.reporting.torch_events`)."""
        return self._telemetry

    @property
    def restart_count(self) -> int:
        """Restarts made on failures so far (``TORCHELASTIC_RESTART_COUNT``), charged to this node or not."""
        return self._budget.spent

    @property
    def _remaining_restarts(self) -> int:
        """Failure restarts still allowed (:class:`~rdzv_agent.restart_budget.RestartBudget`)."""
        return self._budget.remaining

    @property
    def membership_restarts(self) -> int:
        """Restarts caused by nodes joining (not counted against ``max_restarts``)."""
        return self._membership_restarts

    @property
    def exit_barrier(self) -> str | None:
        """How the exit barrier ended: ``"complete"`` (every agent of the round finished),
        ``"left"`` (the round ended meanwhile: a member failed and the others re-form),
        ``"closed"`` (another node ended the job meanwhile: it closed the run),
        ``"timeout"``, ``"unreachable"`` (the timeout passed while the store failed), ``"skipped"`` (timeout 0),
        or ``None`` (the workers did not succeed)."""
        return self._exit_barrier_outcome

    @property
    def rendezvous_count(self) -> int:
        """Rounds this agent has completed (1 after the first start)."""
        return self._rendezvous_count

    # -- what subclasses implement ------------------------------------------------------

    @abc.abstractmethod
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start ``spec.local_world_size`` workers; return local rank -> worker id."""

    @abc.abstractmethod
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop every worker of the group, whatever its state (idempotent)."""

    @abc.abstractmethod
    def _monitor_workers(self, worker_group: WorkerGroup) -> MonitorResult:
        """Check the workers and return the group's new state."""

    #: Called between the checks of the workers; it may raise to stop :meth:`run` (the launcher's
    #: :class:`SignalException` for a signal whose first exception was lost).
    check_interrupted: Callable[[], None] | None = None

    def _wait(self, seconds: float) -> None:
        """Wait between checks; subclasses may return early when a worker exits."""
        time.sleep(seconds)

    def _shutdown(self, death_sig: int = signal.SIGTERM) -> None:
        """Stop the workers because :meth:`run` is leaving with an exception."""
        self._stop_workers(self._worker_group)

    # -- the algorithm ------------------------------------------------------------------------

    def _beat(self, step: str) -> None:
        """Progress for the health check (the exit barrier is bounded by its timeout: held, as torch)."""
        group = self._worker_group
        mark = self.heartbeat.hold if step == "exit_barrier" else self.heartbeat.beat
        mark(step=step, state=group.state.name, restart_count=self.restart_count,
             rendezvous_count=self._rendezvous_count, group_rank=group.group_rank)

    def _emit(self, kind: str, **data: Any) -> None:
        self._beat(kind)
        if self._listener is not None:
            self._listener(AgentEvent(kind, self._worker_group.spec.role, data))

    @prof
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Join the next round; assign global ranks and the master endpoint.

        Raises:
            torch ``RendezvousError`` subclasses from the handler;
            ``RendezvousStateError`` if the handler returns impossible ranks;
            ``_NoMasterEndpoint`` if the round's store times out (c10d ``DistError``).
        """
        spec = worker_group.spec
        self._emit("rendezvous", attempt=self._rendezvous_count + 1)
        try:
            with self._telemetry.duration("RENDEZVOUS"):
                info = spec.rdzv_handler.next_rendezvous()
        except DistError as exc:  # e.g. torch's RendezvousStoreInfo.build waiting for a vanished rank 0
            raise _NoMasterEndpoint(f"the round's store failed during the rendezvous: {exc}") from exc
        store, group_rank, group_world_size = info.store, info.rank, info.world_size
        if not (isinstance(group_world_size, int) and group_world_size >= 1 and 0 <= group_rank < group_world_size):
            raise RendezvousStateError(
                f"handler returned rank {group_rank!r} of world size {group_world_size!r}"
            )
        self._rendezvous_count += 1
        worker_group.store = store
        worker_group.group_rank = group_rank
        worker_group.group_world_size = group_world_size
        worker_group.master_addr = worker_group.master_port = None
        worker_group.use_agent_store = bool(getattr(spec.rdzv_handler, "use_agent_store", False))
        if worker_group.use_agent_store:  # the workers reuse the handler's store (torch's agent does the same)
            worker_group.master_addr, worker_group.master_port = _bootstrap_endpoint(info)
        store_timeout = getattr(store, "timeout", None)  # c10d stores have one (a timedelta)
        deadline = time.monotonic() + (store_timeout.total_seconds() if store_timeout else SETUP_WAIT)
        wait = (deadline, spec.monitor_interval, self._round_gone)
        try:
            if not worker_group.use_agent_store:
                if group_rank == 0:
                    port = spec.master_port if spec.master_port is not None else master_address.choose_port()
                    address = master_address.local_address(spec.local_addr, spec.rdzv_handler)
                    master_address.publish(store, address, port)
                raw = coordination.wait_values(store, [master_address.MASTER_KEY], *wait)[0]
                worker_group.master_addr, worker_group.master_port = master_address.decode(raw)
            with self._telemetry.duration("ASSIGN_WORKER_RANKS"):
                self._assign_worker_ranks(worker_group, wait)
        except coordination.SetupTimeout as exc:
            raise _NoMasterEndpoint(f"the round's other agents did not show up in its store: {exc}") from exc
        ranks = [w.global_rank for w in worker_group.workers]
        log.info(
            "[%s] round complete: restart_count=%d group_rank=%d group_world_size=%d "
            "global_ranks=%s master=%s:%d",
            spec.role, self.restart_count, group_rank, group_world_size, ranks,
            worker_group.master_addr, worker_group.master_port,
        )
        self._emit(
            "rendezvous_done",
            group_rank=group_rank,
            group_world_size=group_world_size,
            world_size=worker_group.workers[0].world_size,
            global_ranks=ranks,
            master_addr=worker_group.master_addr,
            master_port=worker_group.master_port,
        )

    @prof
    def _assign_worker_ranks(self, worker_group: WorkerGroup, wait: tuple[float, float, Callable[[], bool]]) -> None:
        """Set the workers' global and role ranks and world sizes (:func:`coordination.assign_ranks`).

        Raises:
            coordination.SetupTimeout, coordination.RoundGone: see :func:`coordination.assign_ranks`.
        """
        spec = worker_group.spec
        base, world_size, role_base, role_world_size = coordination.assign_ranks(
            worker_group.store, spec.role, int(worker_group.group_rank or 0), int(worker_group.group_world_size or 1),
            spec.local_world_size, *wait)
        for worker in worker_group.workers:
            worker.global_rank = base + worker.local_rank
            worker.role_rank = role_base + worker.local_rank
            worker.world_size = world_size
            worker.role_world_size = role_world_size

    def _master_port_taken(self, worker_group: WorkerGroup) -> bool:
        """On group rank 0 with a chosen port: has something taken it since?"""
        return (
            worker_group.group_rank == 0
            and not worker_group.use_agent_store  # then the handler's own store holds the port
            and worker_group.spec.master_port is None
            and worker_group.master_port is not None
            and not master_address.port_is_free(worker_group.master_port)
        )

    @prof
    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """Rendezvous, then start a fresh set of workers; the group becomes HEALTHY.

        The caller stops running workers first.
        """
        role = worker_group.spec.role
        while True:
            try:
                self._rendezvous(worker_group)
            except _NoMasterEndpoint as exc:  # group rank 0 vanished right after the round formed
                if self._setup_retries_left <= 0:
                    raise RendezvousTimeoutError(f"[{role}] {exc}") from exc
                self._setup_retry("no_master", str(exc))
                continue
            except coordination.RoundGone as exc:  # a member was lost (or a node came) before the start
                self._membership_restarts += 1
                log.info("[%s] %s; re-rendezvous", role, exc)
                self._emit("restarting", reason="membership", remaining_restarts=self._remaining_restarts,
                           nodes_waiting=1)
                continue
            if self._setup_retries_left > 0 and self._master_port_taken(worker_group):
                self._setup_retry("port_in_use", f"master port {worker_group.master_port} was taken before start")
                continue
            break
        worker_ids = self._start_workers(worker_group)
        for local_rank, worker_id in worker_ids.items():
            worker_group.workers[local_rank].id = worker_id
        self._telemetry.workers_started()
        worker_group.state = WorkerState.HEALTHY
        self._emit("started", pids=dict(worker_ids))

    def _setup_retry(self, reason: str, detail: str, failures: dict[int, Exception] | None = None) -> None:
        """Spend one setup retry (not a restart) and say so; the caller re-rendezvouses."""
        self._setup_retries_left -= 1
        log.warning("[%s] %s; re-rendezvous (%d setup retries left)", self._worker_group.spec.role, detail,
                    self._setup_retries_left)
        self._emit("restarting", reason=reason, remaining_restarts=self._remaining_restarts,
                   failures=dict(failures or {}))

    @prof
    def _restart_workers(self, worker_group: WorkerGroup, membership: bool = False) -> None:
        """Stop all local workers, rendezvous again and start new ones. ``membership``: for a membership change;
        a worker that had failed on its own meanwhile is still reported to the node ledger (not charged)."""
        start = time.monotonic()
        self._stop_workers(worker_group)
        if membership:
            self._budget.attribute(worker_group.spec, self._monitor_workers(worker_group).exceptions)
        worker_group.state = WorkerState.STOPPED
        self._initialize_workers(worker_group)
        log.info("[%s] restart took %.1f s", worker_group.spec.role, time.monotonic() - start)

    def _round_gone(self) -> bool:
        """Whether the handler reports nodes waiting, or this node's round gone (``num_nodes_waiting() > 0``)."""
        gone = self._num_nodes_waiting() > 0
        self.heartbeat.beat()
        return gone

    def _num_nodes_waiting(self) -> int:
        """``handler.num_nodes_waiting()``; 0 (and a warning) if the backend is unreachable.

        The workers keep running while the backend is away; membership changes are
        seen again once it is back.
        """
        role = self._worker_group.spec.role
        try:
            waiting = int(self._worker_group.spec.rdzv_handler.num_nodes_waiting())
        except RendezvousConnectionError as exc:  # the monitor asks several times a second
            self._waiting_check_outage.failed("[%s] cannot check for waiting nodes (the workers keep running): %s",
                                              role, exc)
            return 0
        self._waiting_check_outage.recovered("[%s] the rendezvous backend answers the waiting-node check again", role)
        return waiting

    def run(self, role: str = DEFAULT_ROLE) -> dict[int, Any]:
        """Run the workers until they succeed or the agent gives up.

        Returns:
            Each local worker's result by global rank.

        Raises:
            ConfigError: ``role`` is not this agent's role (when given explicitly).
            WorkerGroupFailureException: a FAILED/UNHEALTHY group with no restarts left.
            torch ``RendezvousError`` subclasses: timeout, closed run, backend unreachable.
            Whatever interrupted the agent (e.g. :class:`SignalException`); the
            workers are stopped first in every case.
        """
        spec = self._worker_group.spec
        if role not in (DEFAULT_ROLE, spec.role):
            raise ConfigError("role", role, f"this agent runs role {spec.role!r} only")
        start = time.monotonic()
        try:
            # torch's run() returns where this raises WorkerGroupFailureException: its metrics say success
            with profiled("SimpleElasticAgent.run", returns=(WorkerGroupFailureException, RendezvousGracefulExitError)):
                try:
                    results = self._invoke_run()
                except WorkerGroupFailureException as exc:
                    self._telemetry.run_ended(start, exc.get_worker_exceptions())
                    raise
                self._telemetry.run_ended(start, {})
                return results
        except BaseException as exc:
            self._shutdown(getattr(exc, "signum", signal.SIGTERM))  # idempotent
            raise
        finally:
            self._telemetry.total_run_time = int(time.monotonic() - start)

    def _invoke_run(self) -> dict[int, Any]:
        group = self._worker_group
        spec = group.spec
        role = spec.role
        self._initialize_workers(group)
        while True:
            if group.state == WorkerState.INIT:
                raise RuntimeError(f"[{role}] worker group was never started")
            self._wait(spec.monitor_interval)
            if self.check_interrupted is not None:
                self.check_interrupted()
            result = self._monitor_workers(group)
            state = result.state
            group.state = state
            self._telemetry.monitored(state, self._remaining_restarts)

            if state == WorkerState.SUCCEEDED:
                log.info("[%s] all workers finished successfully", role)
                self._exit_barrier()
                self._emit("succeeded", results=dict(result.ret_vals), exit_barrier=self._exit_barrier_outcome)
                return result.ret_vals
            if state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                self._handle_failure(group, result)
            elif state == WorkerState.HEALTHY:
                waiting = self._num_nodes_waiting()
                self._beat("monitor")
                if waiting > 0:
                    if self._monitor_workers(group).state != WorkerState.HEALTHY:
                        continue  # the workers failed or finished meanwhile: that, not a membership change
                    self._membership_restarts += 1
                    log.info("[%s] num_nodes_waiting=%d (nodes waiting to join, or this node's round is gone; "
                             "group_rank=%s); restarting the group", role, waiting, group.group_rank)
                    self._emit("restarting", reason="membership", remaining_restarts=self._remaining_restarts,
                               nodes_waiting=waiting)
                    self._restart_workers(group, membership=True)
            else:
                raise RuntimeError(f"[{role}] worker group in {state.name} state")

    def _exit_barrier(self) -> None:
        """Wait for the round's other agents to finish too (torch's exit barrier; see :mod:`.coordination`)."""
        group = self._worker_group
        if self._exit_barrier_timeout <= 0:
            self._exit_barrier_outcome = "skipped"
            return
        log.info("[%s] waiting up to %.0f s for the other nodes of the round to finish", group.spec.role,
                 self._exit_barrier_timeout)
        started = time.monotonic()
        closed: list[bool] = []

        def should_leave() -> bool:  # the round is gone, or the job ended (a node closed the run)
            if self._round_gone():
                return True
            try:
                closed[:] = [bool(group.spec.rdzv_handler.is_closed())]
            except RendezvousConnectionError:
                return False
            return closed[0]

        # a store the handler shares (torch's static rendezvous: node rank 0's agent hosts it) goes away with its
        # host once the barrier completed: one wait, as torch's agent does, instead of slices
        poll = None if group.use_agent_store else group.spec.monitor_interval
        self._emit("exit_barrier", timeout=self._exit_barrier_timeout)
        outcome = coordination.exit_barrier(group.store, int(group.group_rank or 0), int(group.group_world_size or 1),
                                            self._exit_barrier_timeout, poll, should_leave)
        self._exit_barrier_outcome = "closed" if outcome == coordination.LEFT and closed and closed[0] else outcome
        log.info("[%s] exit barrier: %s after %.1f s", group.spec.role, self._exit_barrier_outcome,
                 time.monotonic() - started)

    def _handle_failure(self, group: WorkerGroup, result: MonitorResult) -> None:
        spec = group.spec
        failures = dict(result.exceptions)
        port_conflict = spec.master_port is None and not group.use_agent_store and any(
            isinstance(exc, WorkerFailure) and exc.master_port_in_use for exc in failures.values()
        )
        if port_conflict and self._setup_retries_left > 0:
            self._setup_retry("port_in_use", f"a worker could not bind MASTER_PORT={group.master_port}", failures)
            self._restart_workers(group)
        elif self._budget.allows(spec, failures, result.restart):
            log.info("[%s] worker group %s; %d/%d restarts left; restarting", spec.role, result.state.name,
                     self._remaining_restarts, spec.max_restarts)
            self._budget.spend(self._budget.culprit)
            hung = any(isinstance(exc, WorkerHang) for exc in failures.values())
            self._emit("restarting", reason="hang" if hung else "failed", remaining_restarts=self._remaining_restarts,
                       failures=failures)
            self._restart_workers(group)
        else:
            self._stop_workers(group)
            group.state = WorkerState.FAILED
            self._emit("failed", failures=failures, restart=result.restart)
            within = f" within --restart-window {spec.restart_window:g} s" if spec.restart_window else ""
            why = f"max_restarts={spec.max_restarts} spent{within}" if result.restart else \
                f"{result.state.name}: no restart"
            raise WorkerGroupFailureException(f"[{spec.role}] worker group failed; {why}", failures)
