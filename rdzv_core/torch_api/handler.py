"""A torch ``RendezvousHandler`` over :class:`~rdzv_core.rendezvous.Rendezvous` and any backend.

``next_rendezvous()`` returns ``RendezvousInfo(store, rank, world_size,
bootstrap_store_info)`` where ``store`` is a :class:`~rdzv_core.torch_api.store.KVStore`
scoped to the run and the round, and ``bootstrap_store_info`` carries the
MASTER_ADDR/MASTER_PORT that rank 0 published in it. Errors are mapped onto
torch's: ``RendezvousClosedError``, ``RendezvousTimeoutError``,
``RendezvousConnectionError`` (backend unreachable) and ``RendezvousStateError``.

RendezvousEvents: at the points torch's ``DynamicRendezvousHandler`` records one
(``_record``: joining, joined, a failed call, the run closed at shutdown), this
handler records a torch ``RdzvEvent`` through torch's
``events.construct_and_record_rdzv_event``, which goes to the ``dynamic_rendezvous``
handler of ``torch.distributed.elastic.events.handlers`` (a ``NullHandler``, so nothing,
unless a program registers one there, as with torch's own rendezvous).

``shutdown()`` closes the run, as torch's own handlers do (torchrun calls it at
the end of every job not stopped by a signal); ``release()`` leaves the round
and keeps the run open for the other nodes.

Importing this module imports torch.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time
from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.events import construct_and_record_rdzv_event
from torch.distributed.elastic.events.api import NodeState
from torch.distributed.elastic.rendezvous import api as torch_api

from .. import errors, observe
from ..rendezvous import progress_keys
from .address import Endpoint, choose_address, published_address
from ..backoff import Backoff
from ..kv import KVBackend
from ..labels import environment_labels, environment_node_name, environment_order, incarnation_of
from ..metered import MeteredKV
from ..node_checks import CheckSettings, run_node_checks
from ..outage import OutageLog
from ..plugins import parse_backend_url
from ..rendezvous import Progress, Rendezvous, RendezvousParams
from .netcheck import NetcheckSettings, checked_round
from .elastic_api import ElasticHandler
from .store import KVStore
from ..url import RendezvousURL

__all__ = ["RdzvHandler", "ElasticHandler", "HANDLER_OVERRIDES"]

log = logging.getLogger(__name__)

#: Keyword overrides ``create_handler`` accepts besides the URL's query keys.
HANDLER_OVERRIDES = ("min_nodes", "max_nodes", "timeout", "last_call_timeout", "keep_alive_ttl", "prefix",
                     "local_addr", "on_progress", "store_timeout", "backend_name", "rank_policy", "node_rank",
                     "node_labels", "closed_run_ttl", "reform", "incarnation", "node_name", "quarantine_after",
                     "quarantine_window", "quarantine_cooldown", "ledger_scope")

T = TypeVar("T")

#: Seconds ``shutdown()`` keeps trying to close the run while the backend is unreachable (a restart);
#: at most the rendezvous ``timeout``.
SHUTDOWN_RETRY = 30.0
#: Key prefix of torch's agent exit barrier in the round's store (torch's ``_TERMINAL_STATE_SYNC_ID``).
EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"


def _mapped(fn: Callable[..., T]) -> Callable[..., T]:
    """Translate rdzv errors into torch's rendezvous errors (the original is the ``__cause__``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except errors.RendezvousGracefulExitError as exc:
            raise torch_api.RendezvousGracefulExitError(str(exc)) from exc
        except errors.RendezvousClosedError as exc:
            raise torch_api.RendezvousClosedError(str(exc)) from exc
        except errors.RendezvousTimeoutError as exc:
            raise torch_api.RendezvousTimeoutError(str(exc)) from exc
        except errors.BackendUnavailableError as exc:
            raise torch_api.RendezvousConnectionError(f"rendezvous backend unavailable: {exc}") from exc
        except (errors.RendezvousStateError, errors.KVError) as exc:
            raise torch_api.RendezvousStateError(str(exc)) from exc

    return wrapper


def _recorded(fn: Callable[..., T]) -> Callable[..., T]:
    """Record a FAILED ``RdzvEvent`` when the handler method ``fn`` raises (torch's handler does)."""

    @functools.wraps(fn)
    def wrapper(self: "RdzvHandler", *args: Any, **kwargs: Any) -> T:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            self._record(fn.__name__, f"{type(exc).__name__}: {exc}", NodeState.FAILED)
            raise

    return wrapper


class RdzvHandler(torch_api.RendezvousHandler):
    """torch ``RendezvousHandler`` for any ``rdzv`` backend.

    Args:
        kv: the backend; closed by :meth:`shutdown` and :meth:`release`.
        run_id: the run id.
        params: :class:`~rdzv_core.rendezvous.RendezvousParams`.
        backend_name: what :meth:`get_backend` returns (the URL scheme).
        local_addr: address rank 0 publishes as MASTER_ADDR (default: :mod:`rdzv_core.torch_api.address`'s rule).
        on_progress: callback receiving :class:`~rdzv_core.rendezvous.Progress` while waiting.
        store_timeout: default timeout of the returned store (seconds, default 300).
        endpoints: the backend's ``(host, port)`` pairs, for that rule (``()``: no network endpoint).
        node_checks: the pre-flight checks run before each round (:mod:`rdzv_core.node_checks`), or ``None``.
        network_check: the network check of each formed round (:mod:`rdzv_core.torch_api.netcheck`), or ``None``.
    """

    def __init__(
        self,
        kv: KVBackend,
        run_id: str,
        params: RendezvousParams,
        backend_name: str,
        local_addr: str | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        store_timeout: float = 300.0,
        endpoints: Sequence[Endpoint] = (),
        node_checks: CheckSettings | None = None,
        network_check: NetcheckSettings | None = None,
    ) -> None:
        self._kv = kv
        self._endpoints = tuple(endpoints)
        self._rdzv = Rendezvous(kv, run_id, params, on_progress=on_progress)
        self._backend_name = backend_name
        self._local_addr = local_addr
        self._store_timeout = datetime.timedelta(seconds=store_timeout)
        self._ended: str | None = None  # None, "shut" (shutdown) or "released" (release)
        self._closed_ok = False
        self._refused = False  # next_rendezvous raised RunConfigMismatchError: shutdown() leaves the run open
        self._waiting_outage = OutageLog(log.log)
        self._progress_outage = OutageLog(log.log)
        self._rdzv.on_keepalive = self._keep_alive
        self._netcheck = network_check or NetcheckSettings()
        if local_addr:
            self._rdzv.host = local_addr  # the name the rank policies order this node by
        if node_checks is not None and node_checks.enabled:
            gate, settings = self._rdzv.gate, node_checks
            gate.check, gate.action, gate.interval = (lambda: run_node_checks(settings)), settings.on_fail, \
                settings.interval

    @classmethod
    def from_url(cls, url: str | RendezvousURL, **overrides: Any) -> "RdzvHandler":
        """Build a handler from a rendezvous URL (text, or a parsed one: not parsed again);
        ``overrides`` win over the query.

        Raises:
            UnknownBackendError, InvalidURLError, ConfigError: bad URL or values.
            torch's RendezvousConnectionError: the backend cannot be reached.
        """
        unknown = sorted(set(overrides) - set(HANDLER_OVERRIDES))
        if unknown:
            valid = ", ".join(HANDLER_OVERRIDES)
            raise errors.ConfigError(unknown[0], overrides[unknown[0]], f"unknown option; valid: {valid}")
        info, parsed = parse_backend_url(url)
        settings: dict[str, Any] = {**parsed.params, **{k: v for k, v in overrides.items() if v is not None}}
        if "node_labels" not in settings:  # RDZV_NODE_LABELS or the scheduler's: also under plain torchrun
            settings["node_labels"] = environment_labels()
        if "node_order" not in settings:  # the allocation's node order (SLURM_NODEID), also under plain torchrun
            settings["node_order"] = environment_order()
        if "node_name" not in settings:  # the ledger's identity: RDZV_NODE_NAME, the scheduler's, else the host's
            settings["node_name"] = environment_node_name()[0]
        # the query's incarnation, else the scheduler's restart counter (a requeued Slurm job): docs/schedulers.md
        settings["incarnation"], source = incarnation_of(settings)
        if source != "default":
            log.info("run %s: incarnation %d (from %s)", parsed.run_id, settings["incarnation"],
                     "the URL" if source == "query" else source)
        params = RendezvousParams.from_query(settings)
        try:
            kv = info.spec.open(parsed)
            if observe.active():  # metrics are on (rdzv-run --metrics-port): time every request
                kv = MeteredKV(kv)
        except errors.BackendUnavailableError as exc:
            construct_and_record_rdzv_event(run_id=parsed.run_id, message=f"{type(exc).__name__}: {exc}",
                                            node_state=NodeState.FAILED)  # torch's create_handler does
            raise torch_api.RendezvousConnectionError(f"rendezvous backend unavailable: {exc}") from exc
        return cls(
            kv,
            parsed.run_id,
            params,
            backend_name=settings.get("backend_name") or parsed.scheme,
            local_addr=settings.get("local_addr"),
            on_progress=settings.get("on_progress"),
            store_timeout=float(settings.get("store_timeout", 300.0)),
            endpoints=parsed.hosts if info.spec.capabilities.multi_host else (),
            node_checks=CheckSettings.from_query(parsed.params),
            network_check=NetcheckSettings.from_query(parsed.params),
        )

    def _record(self, method: str, message: str, state: NodeState = NodeState.RUNNING, rank: int | None = None,
                master_endpoint: str = "") -> None:
        """An ``RdzvEvent`` named ``handler.py:RdzvHandler.METHOD`` (torch's ``DynamicRendezvousHandler._record``)."""
        construct_and_record_rdzv_event(
            run_id=self._rdzv.run_id, message=message, node_state=state, name=f"{type(self).__name__}.{method}",
            hostname=self._local_addr or "", pid=os.getpid(), master_endpoint=master_endpoint, rank=rank,
        )

    def _keep_alive(self, error: BaseException | None) -> None:
        """An ``RdzvEvent`` per keep-alive refresh, as torch's ``DynamicRendezvousHandler._keep_alive`` records."""
        node, run_id = self._rdzv.node_id, self._rdzv.run_id
        if error is None:
            self._record("_keep_alive", f"The node '{node}' has sent a keep-alive heartbeat to the rendezvous "
                                        f"'{run_id}'.")
        else:
            self._record("_keep_alive", f"The node '{node}' has failed to send a keep-alive heartbeat to the "
                                        f"rendezvous '{run_id}' due to an error of type {type(error).__name__}.",
                         NodeState.FAILED)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The backend's ``(host, port)`` endpoints (``()`` for backends without a network endpoint)."""
        return self._endpoints

    @property
    def rendezvous(self) -> Rendezvous:
        """The underlying state machine (for status and extra data)."""
        return self._rdzv

    @property
    def params(self) -> RendezvousParams:
        return self._rdzv.params

    def round_version(self) -> int | None:
        """The version of the round this node is in (its last completed rendezvous), ``None`` outside one."""
        current = self._rdzv.current
        return None if current is None else current.version

    def get_backend(self) -> str:
        return self._backend_name

    def get_run_id(self) -> str:
        return self._rdzv.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    @_recorded
    @_mapped
    def next_rendezvous(self) -> torch_api.RendezvousInfo:
        """Join the next round; block until it is final (see ``Rendezvous.next_round``)."""
        node, run_id = self._rdzv.node_id, self._rdzv.run_id
        self._record("next_rendezvous", f"The node '{node}' attempts to join the next round of the rendezvous "
                                        f"'{run_id}'.")
        try:
            result = checked_round(self._rdzv, self._netcheck,  # next_round, with the network check when asked
                                   lambda: choose_address(self._local_addr, self._endpoints)[0])
        except (errors.RunConfigMismatchError, errors.NodeExcludedError):
            self._refused = True  # this node never joined (or was kept out): its end must not end the run
            raise
        prefix = self._rdzv.store_prefix(result.version, result.round_id)
        store = _RoundStore(self._kv, prefix, self._store_timeout, on_exit_barrier=self._rdzv.mark_finished)
        # Rank 0 publishes MASTER_ADDR/MASTER_PORT; the others wait for it at most
        # min(store timeout, rendezvous timeout), then report a timeout (rank 0 died).
        wait = datetime.timedelta(seconds=min(self._store_timeout.total_seconds(), self.params.timeout))
        try:
            bootstrap_store = KVStore(self._kv, prefix, wait)
            local_addr = published_address(self._local_addr, self._endpoints) if result.rank == 0 else None
            bootstrap = torch_api.RendezvousStoreInfo.build(result.rank, bootstrap_store, local_addr)
        except dist.DistNetworkError as exc:
            raise torch_api.RendezvousConnectionError(f"rendezvous backend unavailable: {exc}") from exc
        except dist.DistStoreError as exc:
            if isinstance(exc.__cause__, errors.BackendUnavailableError):  # the backend, not rank 0, was silent
                raise torch_api.RendezvousConnectionError(f"rendezvous backend unavailable: {exc}") from exc
            raise torch_api.RendezvousTimeoutError(
                f"round {result.version}: rank 0 did not publish MASTER_ADDR/MASTER_PORT within {wait}: {exc}"
            ) from exc
        self._record("next_rendezvous", f"The node '{node}' has joined round {result.version} of the rendezvous "
                     f"'{run_id}' as rank {result.rank} in a world of size {result.world_size}.", rank=result.rank,
                     master_endpoint=f"{bootstrap.master_addr}:{bootstrap.master_port}")
        return torch_api.RendezvousInfo(store, result.rank, result.world_size, bootstrap)

    @_recorded
    @_mapped
    def is_closed(self) -> bool:
        return self._rdzv.is_closed()

    @_recorded
    @_mapped
    def set_closed(self) -> None:
        self._rdzv.set_closed()

    @_recorded
    @_mapped
    def num_nodes_waiting(self) -> int:
        """See ``Rendezvous.num_nodes_waiting``; 0 while the backend is unreachable.

        torch's agent loop calls this every ``--monitor-interval`` and ends the job on
        any error it raises, so a Redis restart of a second would end a torchrun job on
        every node. The workers do not need the backend while they train: this answers
        0 (one WARNING per outage, INFO when it answers again) and membership changes
        are seen once the backend is back.
        """
        try:
            waiting = self._rdzv.num_nodes_waiting()
        except errors.BackendUnavailableError as exc:
            self._waiting_outage.failed("run %s: cannot check for waiting nodes (the workers keep running): %s",
                                        self._rdzv.run_id, exc)
            return 0
        self._waiting_outage.recovered("run %s: the backend answers the waiting-node check again", self._rdzv.run_id)
        return waiting

    def publish_progress(self, workers: dict[int, tuple[int, float]], ttl: float,
                         hang_timeout: float | None = None) -> bool:
        """Write this node's workers' progress (global rank -> ``(step, Unix seconds)``) in its round's
        progress key with ``ttl`` seconds (:mod:`rdzv_core.rendezvous.progress_keys`, read by ``rdzv status``).

        Returns:
            whether it was written: ``False`` between rounds, and while the backend is unreachable
            (one WARNING per outage, never raised: the workers keep running).
        """
        current = self._rdzv.current
        if current is None or self._ended is not None:
            return False
        try:
            progress_keys.publish(self._kv, self._rdzv.keys, current, self._rdzv.node_id, workers, ttl, hang_timeout)
        except (errors.BackendUnavailableError, errors.BackendClosedError) as exc:
            self._progress_outage.failed("run %s: cannot publish the workers' progress: %s", self._rdzv.run_id, exc)
            return False
        self._progress_outage.recovered("run %s: the workers' progress is published again", self._rdzv.run_id)
        return True

    def shutdown(self) -> bool:
        """End this node's part in the run *and close the run*, as torch's handlers do.

        torch's ``launch_agent`` (``torch.distributed.launcher.api``, what ``torchrun``
        runs) calls ``shutdown()`` when the agent ends for any reason but a signal;
        torch's own handlers then close the run (``DynamicRendezvousHandler.shutdown``
        -> ``_close()``; the etcd handler -> ``set_closed()``), so no node starts
        another round under this run id. This does the same: mark the run closed
        (:meth:`set_closed`), leave the round (delete this node's keep-alive key),
        release the backend. A new job needs a new run id.

        Better than torch: the run is left open when it goes on without this node (its
        live round is one this node is not a member of: the others re-formed without
        it, e.g. while it waited at the exit barrier or stalled; see
        ``Rendezvous.others_carry_on``), and when this node finished (its agent counted
        itself into the exit barrier) while other members of its round still work
        (the barrier timed out: they close the run when they finish). A backend that
        is unreachable is retried for up to :data:`SHUTDOWN_RETRY` seconds (at most the
        rendezvous ``timeout``).

        A node refused because its settings differ from the run's (``next_rendezvous`` raised
        ``RunConfigMismatchError``) never joined: it leaves the run open and returns ``False``.

        Idempotent: later calls return the first call's result. After
        :meth:`release` the backend is gone, so it cannot close the run: it logs a
        WARNING and returns ``False``.

        Returns:
            ``True`` if the run was marked closed; ``False`` (with a WARNING, like
            torch) if that failed (backend unreachable, corrupt state): the round is
            left and the backend released anyway.
        """
        if self._ended is not None:
            if self._ended == "released":
                log.warning("run %s: shutdown() after release(): the backend is released, the run was not closed",
                            self._rdzv.run_id)
                return False
            return self._closed_ok
        self._ended = "shut"
        if self._refused:
            log.info("run %s: this node was refused (its settings differ from the run's); leaving the run open",
                     self._rdzv.run_id)
            self._leave_and_release()
            return False
        retry = min(SHUTDOWN_RETRY, self.params.timeout)
        deadline = time.monotonic() + retry
        backoff = Backoff(base=0.5, cap=0.5)  # a constant window: up to 0.5 s between attempts
        while True:
            try:
                self._closed_ok = self._close_unless_others_carry_on()
                break
            except errors.BackendUnavailableError as exc:  # a backend restart at the end of the job: wait for it
                if time.monotonic() >= deadline:
                    log.warning("run %s: failed to close the rendezvous at shutdown (backend unavailable for %.0f s):"
                                " %s", self._rdzv.run_id, retry, exc)
                    self._closed_ok = False
                    break
                backoff.sleep(deadline)
            except errors.RdzvError as exc:
                log.warning("run %s: failed to close the rendezvous at shutdown: %s: %s",
                            self._rdzv.run_id, type(exc).__name__, exc)
                self._closed_ok = False
                break
        if not self._closed_ok:  # torch: "has failed to shutdown the rendezvous"
            self._record("shutdown", f"The node '{self._rdzv.node_id}' has failed to shutdown the rendezvous "
                         f"'{self._rdzv.run_id}'.", NodeState.FAILED)
        self._leave_and_release()
        return self._closed_ok

    def report_failure(self, at: float, detail: str, settle: float, peer: bool = False) -> dict[str, Any] | None:
        """See :class:`ElasticHandler`: ``Rendezvous.report_failure`` as plain data."""
        rdzv = self._rdzv
        try:
            verdict = rdzv.report_failure(at, detail, settle, peer)
        except (errors.BackendUnavailableError, errors.BackendClosedError, errors.RendezvousStateError) as exc:
            log.warning("run %s: could not record the failure in the node ledger: %s", rdzv.run_id, exc)
            return None
        if verdict is None:
            return None
        entry = verdict.entry
        if verdict.first and entry.quarantined():
            log.warning("run %s: node %s is quarantined until %s: %s", rdzv.run_id, rdzv.node_name,
                        time.strftime("%H:%M:%S", time.localtime(entry.until or 0)), entry.why)
        return {"culprit": verdict.culprit, "first": verdict.first, "node": rdzv.node_name,
                "quarantined": entry.quarantined(), "until": entry.until, "why": entry.why}

    def node_excluded(self, name: str) -> bool:
        """See :class:`ElasticHandler`."""
        try:
            entry = self._rdzv.ledger.read(name)
        except (errors.BackendUnavailableError, errors.BackendClosedError) as exc:
            log.warning("run %s: could not read node %s's ledger entry: %s", self._rdzv.run_id, name, exc)
            return False
        return entry.left_out()

    def _close_unless_others_carry_on(self) -> bool:
        """``set_closed()`` unless the run goes on without this node (see :meth:`shutdown`); True."""
        rdzv = self._rdzv
        if rdzv.gate.kept_out():
            # quarantined, and the others go on without it (docs/node-health.md): its end is not the job's
            log.info("run %s: node %s is quarantined; leaving the run open for the others", rdzv.run_id,
                     rdzv.node_name)
        elif rdzv.others_carry_on():
            # torch closes the run here; but the others re-formed without this node and still train:
            # closing would stop them at their next re-formation. Leave it open.
            log.info("run %s: the other nodes carry on without this node; leaving the run open", rdzv.run_id)
        elif rdzv.finished and rdzv.others_still_working():
            # this node's workers succeeded (it counted itself into the exit barrier) and it is leaving before
            # the others finished (the barrier timed out): they close the run when they finish
            log.info("run %s: this node finished before the others; leaving the run open for them", rdzv.run_id)
        else:
            rdzv.set_closed()
            self._record("shutdown", f"The node '{rdzv.node_id}' has closed the rendezvous '{rdzv.run_id}'.",
                         NodeState.SUCCEEDED)
        return True

    def release(self, finished: bool = False) -> None:
        """Leave the round and release the backend; the run stays *open* for the others.

        For callers that must not close the run: an agent stopped by a signal (the
        other nodes re-form without it, as with ``torchrun``), or one not admitted to
        the rendezvous. With ``finished`` (this node's workers succeeded, the others
        still train in the round) its keep-alive key is kept and marked finished, so
        the others carry on without re-forming (see ``Rendezvous.leave``). Idempotent;
        a no-op after :meth:`shutdown`. Errors while leaving are logged (the
        keep-alive key then lapses after ``keep_alive_ttl`` seconds), never raised.
        """
        if self._ended is not None:
            return
        self._ended = "released"
        self._leave_and_release(finished)

    def _leave_and_release(self, finished: bool = False) -> None:
        try:
            self._rdzv.leave(finished=finished)
        except errors.RdzvError as exc:
            log.warning("run %s: could not leave the round cleanly: %s", self._rdzv.run_id, exc)
        self._kv.close()


class _RoundStore(KVStore):
    """The round's c10d Store, which also tells the rendezvous when this node's agent enters its exit barrier.

    torch's agent (and rdzv-run's) counts itself into the exit barrier only after its
    workers succeeded, with a write under :data:`EXIT_BARRIER_PREFIX`; the first such
    write marks this member finished (``Rendezvous.mark_finished``), so if the node
    ends or dies while it waits there the others are not made to re-form.
    """

    def __init__(self, kv: KVBackend, prefix: str, timeout: datetime.timedelta,
                 on_exit_barrier: Callable[[], object]) -> None:
        super().__init__(kv, prefix, timeout)
        self._on_exit_barrier: Callable[[], object] | None = on_exit_barrier

    def _entering(self, key: str | bytes) -> None:
        name = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        if self._on_exit_barrier is not None and name.startswith(EXIT_BARRIER_PREFIX):
            hook, self._on_exit_barrier = self._on_exit_barrier, None
            hook()

    def set(self, key: str, value: str | bytes) -> None:
        self._entering(key)
        super().set(key, value)

    def add(self, key: str, amount: int) -> int:
        self._entering(key)
        return super().add(key, amount)
