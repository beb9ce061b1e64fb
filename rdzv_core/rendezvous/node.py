"""``Rendezvous``: one node's view of the rendezvous of one run, the public API over :class:`RoundMachine`."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import (
    BackendClosedError,
    BackendUnavailableError,
    CorruptEntryError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from ..kv import wait_for_change
from ..outage import OutageLog
from .machine import RoundMachine
from .ledger import FailureVerdict
from .params import RoundResult
from .record import Status, encode_json, member_record, rank_of
from .runconfig import check_run_config, shown
from .steps import Retry, attempt_backoff

__all__ = ["Rendezvous"]


class Rendezvous(RoundMachine):
    """One node's view of the rendezvous of one run over a :class:`KVBackend`.

    Args:
        kv: the backend (not closed by this object).
        run_id: the run id: 1-128 characters from ``A-Za-z0-9_.-=+:@~``, not ``.``/``..``
            (one key segment, so it cannot reach another run's keys).
        params: :class:`RendezvousParams`.
        on_progress: optional callback receiving :class:`Progress` while waiting.

    Attributes:
        keys: the run's :class:`RunKeys`; ``root`` its key root; ``current`` the
            :class:`RoundResult` of the round this node is a member of, or ``None``.

    Thread-safety: one ``next_round`` at a time per object.

    Raises:
        InvalidURLError: ``run_id`` is not a valid run id (names the field and value).
    """

    def next_round(self) -> RoundResult:
        """Block until this node is a member of a final round; return its result.

        After torchelastic's ``EtcdRendezvous.rendezvous_barrier``. Leaves the previous round
        first (its keep-alive key is marked re-joining at once, so the others re-form promptly and
        keep its place in the next round: ``docs/design.md``, "Admission order").

        Raises:
            RendezvousClosedError: the run is closed (:class:`RendezvousGracefulExitError` if it
                closed while this node waited as a spare).
            RendezvousTimeoutError: no round within ``params.timeout`` seconds (time spent
                waiting as a spare, for a full round to lose a member, does not count).
            RendezvousStateError: the stored round record or run configuration is corrupt.
            NodeExcludedError: this node's pre-flight check failed (``node_check_action=exit``), or the run
                closed while the gate kept it out (``rdzv_core.rendezvous.gate``).
            RunConfigMismatchError: a setting every node of the run must share differs from the
                run's (``runconfig``): raised before this node takes a ticket or counts as
                waiting; the run is not touched.
            BackendUnavailableError: the backend was unreachable at the deadline (the last
                attempt failed on it; if it answered since, the timeout is raised instead).
        """
        with self._lock:
            self.leave(rejoin=True)
            self.gate.admit()  # pre-flight checks and quarantine: time kept out does not count against the timeout
            self._spare_since = None
            try:
                return self._rounds_until(time.monotonic() + self.params.timeout)
            finally:
                self._held = None  # a ticket is held only while next_round runs
                self._admission.end()

    def _rounds_until(self, deadline: float) -> RoundResult:
        """``next_round``'s retry loop: attempts until one completes or ``deadline`` passes."""
        backoff = attempt_backoff()
        last_error: BackendUnavailableError | None = None
        outage = OutageLog(self._log)  # one WARNING per outage, not one per retry
        checked = False  # the run's configuration, once per next_round, before anything is joined
        arrived = False  # this node's place in the admission order, once per next_round
        while time.monotonic() < deadline:
            try:
                if not checked:
                    config, recorded = check_run_config(self.kv, self.keys, self.params)
                    checked = True
                    if recorded and config is not None:
                        self._log(logging.INFO, "recorded the run's configuration: %s",
                                  ", ".join(f"{k}={shown(v)}" for k, v in config.as_dict().items()))
                    if config is None and self.kv.get(self.keys.closed) is not None:
                        raise self.closed_error()  # before this node writes anything into the closed run
                if not arrived:
                    self._wrote = True  # from here on this node may leave keys in the run (set_closed)
                    self._admission.arrive(self.last_round)
                    arrived = True
                result = self._attempt(deadline)
                outage.recovered("backend reachable again")
                self.current = result
                self.last_round = (result.version, result.round_id, result.rank)
                self._watch_round(result)
                self._log(logging.INFO, "round complete: world size %d", result.world_size)
                return result
            except Retry as retry:
                outage.recovered("backend reachable again")
                last_error = None  # reachable again: running out of time now is a timeout
                self._log(logging.DEBUG, "retrying rendezvous: %s", retry)
                self._held = None  # that round is given up: a new attempt takes a new ticket
                self._stop_keepalive(delete=True)
                deadline += retry.credit
                if retry.delay:
                    backoff.sleep(deadline)
            except CorruptEntryError as exc:
                remedy = "; reset the run's state (rdzv reset URL)" if exc.key is not None else ""
                raise RendezvousStateError(f"run {self.run_id}: {exc}{remedy}", exc.key) from exc
            except BackendUnavailableError as exc:
                last_error = exc
                outage.failed("backend unavailable, retrying until the deadline: %s", exc)
                self._stop_keepalive(delete=False)  # the round's ticket stays held: the retry resumes it
                backoff.sleep(deadline)
        if last_error is not None:
            raise last_error
        raise RendezvousTimeoutError(
            f"run {self.run_id}: no round completed within {self.params.timeout} s "
            f"(min_nodes={self.params.min_nodes}, max_nodes={self.params.max_nodes})"
        )

    def report_failure(self, at: float, detail: str, settle: float, peer: bool = False) -> FailureVerdict | None:
        """This node's workers failed in its current round at Unix time ``at`` (the first worker's exit;
        ``detail``: one line; ``peer``: because a peer was lost): report it and find who failed first
        (:meth:`NodeLedger.attribute`, waiting up to ``settle`` s after ``at`` for earlier reports). ``None``
        outside a round, and in a job of one node (``max_nodes`` 1: nobody could take its place).

        Raises:
            BackendUnavailableError, BackendClosedError, RendezvousStateError: from the backend.
        """
        current = self.current
        if current is None or self.params.limit <= 1:  # a job of one node: nobody could take its place
            return None
        return self.ledger.attribute(self.node_name, current.version, current.round_id or None, at, detail, settle,
                                     peer)

    def leave(self, finished: bool = False, rejoin: bool = False) -> None:
        """Leave the current round (the run stays open).

        Args:
            finished: this node's work is done and the other members carry on: as
                :meth:`mark_finished`, its key stays (marked, without TTL) instead of being
                deleted, so nobody takes it for a lost member. Implied once
                :meth:`mark_finished` was called.
            rejoin: this node re-joins the run (``next_round``): its key is marked re-joining and
                left to lapse instead of deleted, so the next round keeps it a place.
        """
        self._unwatch_round()
        if finished or self._finished:
            self.mark_finished()
            self._stop_keepalive(delete=False)  # marked: the key stays; not marked (backend away): it lapses
        elif rejoin:
            self._leave_to_rejoin()
        else:
            self._stop_keepalive(delete=True)
        self._finished = False
        self.current = None

    def mark_finished(self) -> bool:
        """Mark this member of the current round finished: its keep-alive key is rewritten without
        TTL with a ``finished`` time and no longer refreshed, so the others carry on if this node
        ends or dies. Idempotent.

        Returns:
            whether the key was marked (``False``: no round, already marked, or the backend was
            unreachable: then the key stays refreshed).
        """
        if self._finished or self._alive_key is None:
            return False
        key = self._alive_key
        self._stop_keepalive(delete=False, forget=False)  # first: no refresh may give the key a TTL again
        try:
            self.kv.put(key, encode_json({**self._alive_info, "finished": round(time.time(), 3)}))
        except (BackendUnavailableError, BackendClosedError) as exc:
            self._log(logging.WARNING, "could not mark this member finished: %s", exc)
            self._keepalive = self._start_keepalive(key, self._alive_info, f"rdzv-keepalive-{self.run_id}")
            return False
        self._finished = True
        self._log(logging.INFO, "marked this member finished")
        return True

    @property
    def finished(self) -> bool:
        """Whether this member was marked finished (:meth:`mark_finished`) and has not left since."""
        return self._finished

    def others_still_working(self) -> bool:
        """Whether this node's round is the live one and has a member that is alive and not finished, besides us."""
        record = self._read_state()[1]
        current = self.current
        if record is None or current is None or record.status is not Status.FINAL or \
                not record.is_round(current.version, current.round_id or None):
            return False
        mine = f"rank_{current.key_slot}"
        for e in self.kv.list(self.keys.alive_dir(current.version, current.round_id or None))[0]:
            member = member_record(e)
            if rank_of(e.key) != mine and "corrupt" not in member and "finished" not in member:
                return True
        return False

    def others_carry_on(self) -> bool:
        """Whether the run goes on without this node: the live round is a final round other than this
        node's current one, or any round newer than it. False for a closed or absent run, and while
        this node is a member of the live round (``RdzvHandler.shutdown`` then closes the run).
        """
        record = self._read_state()[1]
        if record is None or record.status in (Status.CLOSED, Status.SETUP):
            return False
        current = self.current
        if current is not None and record.is_round(current.version, current.round_id or None):
            return False
        if record.status is Status.FINAL:
            return True
        return current is not None and record.version > current.version

    def is_closed(self) -> bool:
        """Whether the run is closed (eventually consistent, like torch's handlers)."""
        record = self._read_state()[1]
        return record is not None and record.status is Status.CLOSED

    def set_closed(self) -> None:
        """Mark the run closed so no node starts another round, and let the closed run expire.

        The mark ``state/closed`` holds ``{"closed": UNIX_TIME}`` (JSON) and lives ``params.closed_run_ttl``
        seconds; every other key of the run (``RunKeys.tree``: round records, tickets, keep-alive and extra
        data, the rounds' Stores) gets the same TTL (``KVBackend.expire_tree``), so a shared server stays
        bounded. Once the mark has expired the run is absent: a new job with the run id starts afresh.
        ``closed_run_ttl`` ``None``: the mark and the keys are kept until deleted (``rdzv reset``). A run
        closed before this node wrote anything into it is left as it is (its expiry does not move).

        Raises:
            BackendUnavailableError: from the backend (the run may be marked closed or not).
        """
        if not self._wrote and self.kv.get(self.keys.closed) is not None:
            # closed before this node wrote anything into it (a job started again under a closed run's id):
            # closing it again would move the closed run's expiry on, at every such attempt
            self._log(logging.INFO, "run closed already; its keys keep their expiry")
            return
        ttl = self.params.closed_run_ttl
        self.kv.put(self.keys.closed, encode_json({"closed": round(time.time(), 3)}), ttl=ttl)
        if ttl is not None:
            try:
                count = self.kv.expire_tree(self.keys.tree, ttl)
            except CorruptEntryError as exc:  # foreign data under the run: rdzv reset deletes it
                self._log(logging.WARNING, "run closed; its keys were not all given a TTL: %s", exc)
                return
            self._log(logging.INFO, "run closed: its %d keys expire in %g s", count, ttl)
        else:
            self._log(logging.INFO, "run closed (kept until deleted: closed_run_ttl none)")

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for a round with this node in it (after ``EtcdRendezvous.num_nodes_waiting``).

        The late nodes counted while the current round is final and has fewer than
        ``max_nodes`` members (beyond that they are spares: 0); when this node's round
        (``current``) is no longer the live one, the nodes that joined the round now forming
        and at least 1; 0 once the run is closed. A round whose record the backend lost
        (restarted empty, failed over) is re-established first, and counts as live
        (``docs/design.md``, "The backend away").
        """
        record = self._read_state()[1]
        current = self.current
        if record is not None and record.status is Status.CLOSED:
            return 0
        if current is not None and self._watched is not None and (
                record is None or (record.status is Status.FROZEN and record.is_round(current.version,
                                                                                      current.round_id or None))):
            if self._restore_round(quiet=False):  # the backend lost the record or its final state
                return 0
        if current is not None and (record is None or not record.is_round(current.version, current.round_id or None)):
            joined = 0
            if record is not None and record.status is Status.JOINABLE:
                joined = self._tickets(self.keys.joined(record.version, record.id))
            return max(1, joined)
        if record is None or record.status is not Status.FINAL:
            return 0
        if (record.participants or 0) >= self.params.limit:
            return 0  # the round is full: the nodes waiting are spares, admitted only when a member is lost
        return self._tickets(self.keys.waiting(record.version, record.id))

    def store_extra_data(self, version: int, key: str, value: bytes, round_id: str | None = None) -> None:
        """Store ``value`` under ``key`` for round ``version`` (after ``EtcdRendezvous.store_extra_data``).

        ``round_id``: the round's id (:attr:`RoundResult.round_id`); default: this node's
        current round's if its version is ``version`` (else a round without id).
        """
        self.kv.put(self.keys.extra(version, self._rid_of(version, round_id), key), value)

    def load_extra_data(self, version: int, key: str, timeout: float, round_id: str | None = None) -> bytes:
        """Wait up to ``timeout`` seconds for extra data ``key`` of round ``version`` (``round_id``:
        as for :meth:`store_extra_data`).

        Raises:
            RendezvousTimeoutError: not published in time.
        """
        rid = self._rid_of(version, round_id)
        extra, full = self.keys.extra_dir(version, rid), self.keys.extra(version, rid, key)
        deadline = time.monotonic() + timeout
        while True:
            entries, revision = self.kv.list(extra)
            for entry in entries:
                if entry.key == full:
                    return entry.value
            if not wait_for_change(self.kv, extra, revision, deadline):
                raise RendezvousTimeoutError(f"extra data {key!r} of round {version} not published within {timeout} s")

    def store_prefix(self, version: int, round_id: str | None = None) -> str:
        """Key prefix (ending in ``/``) of the c10d Store of round ``version`` (``round_id``: as for
        :meth:`store_extra_data`): ``ROOT/store/v_V.ID/``."""
        return self.keys.store_prefix(version, self._rid_of(version, round_id))

    def describe(self) -> dict[str, Any]:
        """The run's current state as plain data: its ``run_id`` and ``incarnation`` (int), the record's fields,
        alive members, joined and waiting, ``queued`` (nodes in the admission queue) and ``group_ranks`` (the
        group rank of each slot) when the round's rank policy gave them.

        Raises:
            RendezvousStateError: the round record or a counter is corrupt.
        """
        record = self._read_state()[1]
        if record is None:
            return {"run_id": self.run_id, "incarnation": self.incarnation, "status": "absent"}
        out: dict[str, Any] = {"run_id": self.run_id, "incarnation": self.incarnation, **record.as_dict()}
        if record.version > 0:
            alive, _ = self.kv.list(self.keys.alive_dir(record.version, record.id))
            out["alive"] = [member_record(e) for e in alive]
            out["joined"] = self._tickets(self.keys.joined(record.version, record.id))
            out["waiting"] = self._tickets(self.keys.waiting(record.version, record.id))
        out["queued"] = len(self.kv.list(self.keys.queue_dir)[0])
        if record.ranks is not None:  # slot -> group rank (docs/ranks.md); a member's "rank" above is its slot
            ranks = self.kv.get(self.keys.ranks(record.version, record.id))
            out["group_ranks"] = member_record(ranks).get("ranks") if ranks is not None else None
        return out

    def _rid_of(self, version: int, round_id: str | None) -> str | None:
        """``round_id``, else the id of this node's current round if its version is ``version``."""
        if round_id is not None:
            return round_id or None
        current = self.current
        return (current.round_id or None) if current is not None and current.version == version else None
