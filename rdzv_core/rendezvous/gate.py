"""The gate before a round: a node joins only when its pre-flight checks pass and it is not quarantined.

At the start of every ``next_round`` (the first round and every re-join), :meth:`Gate.admit`:

1. runs the node's checks (a callable the handler builds from the URL: ``rdzv_core.node_checks``). A node
   whose check fails leaves its round (not as re-joining: the others re-form without waiting for it), is
   recorded in the ledger (its check's reason: ``rdzv nodes``/``rdzv status`` show it), and either gives up
   (``node_check_action=exit``: :class:`~rdzv_core.errors.NodeExcludedError`) or re-checks every
   ``node_check_interval`` seconds until a check passes;
2. reads the node's ledger entry (:mod:`rdzv_core.rendezvous.ledger`). A quarantined node leaves its round
   likewise and waits until its quarantine ends or is forgiven -- unless the run cannot go on without it:
   when fewer than ``min_nodes`` other nodes are present (members of the live round, joined, queued or
   waiting) for ``keep_alive_ttl`` seconds in a row, it is admitted anyway (*fail-open*, logged and recorded).

A node kept out when the run closes raises :class:`~rdzv_core.errors.NodeExcludedError` naming why. Time
spent at the gate does not count against ``next_round``'s timeout. A backend that does not answer at the gate
lets the node through (the round's own retries handle the outage): the gate guides admission, it does not
stop a job.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from ..errors import BackendUnavailableError, NodeExcludedError, RendezvousStateError
from ..kv import Entry, KVBackend, wait_for_change
from .ledger import NodeEntry, NodeLedger
from .params import Progress, RendezvousParams
from .record import RoundRecord, RunKeys, Status, member_record

__all__ = ["Gate", "CheckResult", "CheckFn", "GATE_LOG_EVERY"]

#: Seconds between two INFO lines of a node waiting at the gate.
GATE_LOG_EVERY = 60.0
#: Marks of a keep-alive record whose member is not present any more.
_GONE = frozenset({"finished", "corrupt", "rejoining"})


class CheckResult(Protocol):
    """What a node check returns (``rdzv_core.node_checks.CheckOutcome`` has these)."""

    @property
    def healthy(self) -> bool: ...
    @property
    def check(self) -> str: ...
    @property
    def reason(self) -> str: ...


#: Runs the node's pre-flight checks.
CheckFn = Callable[[], CheckResult]


class Gated(Protocol):
    """What the gate uses of a node's state machine (:class:`~rdzv_core.rendezvous.machine.RoundMachine`)."""

    kv: KVBackend
    keys: RunKeys
    params: RendezvousParams
    node_id: str
    _alive_key: str | None

    def withdraw(self) -> None: ...
    def _read_state(self) -> tuple[Entry | None, RoundRecord | None]: ...
    def _read_state_at(self) -> tuple[Entry | None, RoundRecord | None, int]: ...
    def _tickets(self, key: str) -> int: ...
    def _log(self, level: int, msg: str, *args: Any, version: int | None = None) -> None: ...


class Gate:
    """The gate of one node (see the module).

    Args:
        machine: the node's state machine (its reads, its ``leave``, its log).
        ledger: the run's :class:`NodeLedger`; name: this node's name in it.
        check: the pre-flight checks, or ``None``; action: ``"wait"`` or ``"exit"`` when they fail;
        interval: seconds between re-checks while they fail.
    """

    def __init__(self, machine: Gated, ledger: NodeLedger, name: str, check: CheckFn | None = None,
                 action: str = "wait", interval: float = 30.0) -> None:
        self.machine, self.ledger, self.name = machine, ledger, name
        self.check, self.action, self.interval = check, action, interval
        self._left = False

    def admit(self) -> bool:
        """Block until this node may take a ticket (see the module). Called once the node left its round to
        re-join; a node kept out withdraws from it (:meth:`Membership.withdraw`). Returns whether it was kept
        out for a while.

        Raises:
            NodeExcludedError: the check failed with action ``exit``, or the run closed while this node was kept out.
            BackendClosedError: the backend was closed meanwhile.
        """
        self._left = False
        self._checked()
        self._released()
        return self._left

    def _leave(self) -> None:
        if not self._left:
            self.machine.withdraw()  # not re-joining: the others re-form without waiting for this node
            self._left = True

    def _guarded(self, default: object, read: Callable[..., object], *args: object) -> object:
        """``read(*args)``, or ``default`` while the backend does not answer (the round's retries take over)."""
        try:
            return read(*args)
        except (BackendUnavailableError, RendezvousStateError) as exc:
            self.machine._log(logging.DEBUG, "node gate: the backend did not answer (%s); letting this node "
                              "through (the round's retries report the outage)", exc)
            return default

    def _closed(self) -> bool:
        record = self._guarded(None, lambda: self.machine._read_state()[1])
        return getattr(record, "status", None) is Status.CLOSED

    # -- 1. the pre-flight checks -----------------------------------------------------------------
    def _checked(self) -> None:
        if self.check is None:
            return
        logged = float("-inf")
        alone = 0.0  # seconds this node's check failed while too few other nodes were present to form a round
        while True:
            outcome = self.check()
            if outcome.healthy:
                entry = self._guarded(None, self.ledger.read, self.name)
                if isinstance(entry, NodeEntry) and entry.check:
                    self._guarded(None, self.ledger.note_check, self.name, "")
                    self.machine._log(logging.INFO, "node %s: pre-flight checks pass again", self.name)
                return
            reason = f"pre-flight check {outcome.check or 'check'} failed: {outcome.reason}"
            self._guarded(None, self.ledger.note_check, self.name, reason)
            self._leave()
            if self.action == "exit":
                raise NodeExcludedError(self.name, reason)
            timeout = self.machine.params.timeout
            if alone >= timeout:  # nobody goes on without it (every node failing its check): give up, as a timeout
                raise NodeExcludedError(self.name, f"{reason}; no round formed without this node for {timeout:g} s "
                                        "(the rendezvous timeout)")
            self._progress("unhealthy", reason, timeout - alone)
            if time.monotonic() - logged >= GATE_LOG_EVERY:
                self.machine._log(logging.WARNING, "node %s: %s; not joining, re-checking every %g s", self.name,
                                  reason, self.interval)
                logged = time.monotonic()
            since = time.monotonic()
            short = self._others() < self.machine.params.min_nodes
            if self._wait(since + min(self.interval, max(timeout - alone, 0.0))):
                raise NodeExcludedError(self.name, f"the run closed while this node's {reason}")
            alone = alone + (time.monotonic() - since) if short else 0.0

    def _progress(self, phase: str, why: str, remaining: float) -> None:
        """Tell the launcher (``on_progress``) that this node waits at the gate, and why."""
        report = getattr(self.machine, "on_progress", None)
        if report is not None:
            params = self.machine.params
            report(Progress(f"{phase}: {why}", 0, 0, params.min_nodes, params.limit, max(remaining, 0.0)))

    # -- 2. the quarantine ------------------------------------------------------------------------
    def _released(self) -> None:
        entry = self._guarded(None, self.ledger.read, self.name)
        if not isinstance(entry, NodeEntry) or not self.ledger.policy.enabled or not entry.quarantined():
            return
        params = self.machine.params
        if params.limit <= 1:
            return  # a job of one node has nobody to replace it: its restart budget decides
        logged = float("-inf")
        short_since: float | None = None  # since when too few other nodes are present
        while True:
            until = entry.until or 0.0
            if self._others() >= params.min_nodes:
                short_since = None
            elif short_since is None:
                short_since = time.monotonic()
            elif time.monotonic() - short_since >= params.keep_alive_ttl:
                self._guarded(None, self.ledger.mark_fail_open, self.name)
                self.machine._log(logging.WARNING, "node %s is quarantined (%s) but the run cannot reach min_nodes=%d "
                                  "without it: admitted anyway (fail-open)", self.name, entry.why, params.min_nodes)
                return
            self._leave()
            self._progress("quarantined", f"until {time.strftime('%H:%M:%S', time.localtime(until))}: {entry.why}",
                           until - time.time())
            if time.monotonic() - logged >= GATE_LOG_EVERY:
                self.machine._log(logging.WARNING, "node %s is quarantined for %.0f s more (%s); waiting",
                                  self.name, until - time.time(), entry.why)
                logged = time.monotonic()
            step = params.keep_alive_ttl if short_since is not None else max(params.keep_alive_ttl, 5.0)
            deadline = time.monotonic() + min(step, max(until - time.time(), 0.0))
            if self._wait(deadline):
                raise NodeExcludedError(self.name, f"the run closed while this node was quarantined "
                                        f"until {time.strftime('%H:%M:%S', time.localtime(until))}: {entry.why}")
            fresh = self._guarded(None, self.ledger.read, self.name)
            if not isinstance(fresh, NodeEntry) or not fresh.quarantined():
                self.machine._log(logging.INFO, "node %s: quarantine over; joining", self.name)
                return
            entry = fresh

    def _others(self) -> int:
        """How many other nodes are present in the run: the live round's members (not finished, not this node)
        and late nodes, or its joined nodes, plus the nodes queued for a place."""
        machine = self.machine
        keys = machine.keys

        def count() -> int:
            record = machine._read_state()[1]
            present = 0
            if record is not None and record.version > 0 and record.status is not Status.CLOSED:
                if record.status is Status.JOINABLE:
                    present = machine._tickets(keys.joined(record.version, record.id))
                else:
                    alive = machine.kv.list(keys.alive_dir(record.version, record.id))[0]
                    present = sum(1 for e in alive if e.key != machine._alive_key and
                                  not _GONE & member_record(e).keys())
                    present += machine._tickets(keys.waiting(record.version, record.id))
            mine = keys.queued(machine.node_id)
            return present + sum(1 for e in machine.kv.list(keys.queue_dir)[0] if e.key != mine)

        found = self._guarded(None, count)
        return found if isinstance(found, int) else machine.params.min_nodes  # unknown: do not fail open on it

    def kept_out(self) -> bool:
        """Whether this node is quarantined and the run goes on without it: it was not admitted fail-open, the
        run has room for another node, and ``min_nodes`` other nodes are present. ``False`` when unknown.

        Raises:
            BackendClosedError: the backend was closed.
        """
        entry = self._guarded(None, self.ledger.read, self.name)
        if not isinstance(entry, NodeEntry) or not entry.left_out():
            return False
        return self.machine.params.limit > 1 and self._others() >= self.machine.params.min_nodes

    def _wait(self, deadline: float) -> bool:
        """Wait until the run's state changes or ``deadline`` (monotonic); whether the run is closed."""
        machine = self.machine

        def closed_or_watched() -> bool:  # one read of the state: closed now, else wait for a change of it
            _, record, revision = machine._read_state_at()
            if record is not None and record.status is Status.CLOSED:
                return True
            wait_for_change(machine.kv, machine.keys.state_dir, revision, deadline, read_revision=revision)
            return False

        closed = self._guarded(None, closed_or_watched)
        if closed:
            return True
        if closed is None:
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
        return self._closed()
