"""The rendezvous state machine of one node: the phases of a round and the I/O they perform.

After torchelastic's ``EtcdRendezvous`` (see ``docs/design.md`` for the states, what was kept
and changed, and why)::

    (absent) --create--> setup --CAS--> joinable --CAS--> frozen --CAS--> final
                                         |  last call            |  all confirmed
       closed <--CAS-- (any state)       |  (min <= n < max)     |
    final round whose keep-alive lapsed --compare_and_delete--> (absent)

:func:`~rdzv_core.rendezvous.steps.next_step` decides what a node does with the record it
read; :class:`RoundMachine` performs it. Keys: :class:`~rdzv_core.rendezvous.record.RunKeys`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from ..backoff import Backoff
from . import roundwatch
from ..errors import (
    BackendClosedError,
    BackendUnavailableError,
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    RendezvousGracefulExitError,
    RendezvousStateError,
)
from .keepalive import KeepAlive
from ..kv import Entry, KVBackend, wait_for_change
from .admission import Admission, unmarked_grace, write_last_final
from .gate import Gate
from .ledger import NodeLedger
from .membership import Membership
from ..outage import Responsiveness, judged_at
from .params import Progress, RendezvousParams, RoundResult
from .ranks import load_rank, member_fields, store_ranks
from .record import RoundRecord, RunKeys, Status, encode_json, missing_ranks
from .steps import DeadlinePassedError, Held, Retry, Stall, Step, next_step

__all__ = ["RoundMachine", "SETUP_STAGGER", "SPARE_LOG_EVERY"]

#: seconds: the shortest window over which nodes that find no round stagger their setup (see ``_setup``).
SETUP_STAGGER = 0.05
#: Seconds between two INFO lines of a node waiting as a spare.
SPARE_LOG_EVERY = 60.0


class RoundMachine(Membership):
    """One node's rounds of one run over a :class:`KVBackend`: the protocol under :class:`Rendezvous`.

    Args:
        kv: the backend (not closed by this object).
        run_id: the run id: 1-128 characters from ``A-Za-z0-9_.-=+:@~``, not ``.``/``..``.
        params: :class:`RendezvousParams`.
        on_progress: optional callback receiving :class:`Progress` while waiting.

    Raises:
        InvalidURLError: ``run_id`` is not a valid run id (names the field and value).
    """

    def __init__(
        self,
        kv: KVBackend,
        run_id: str,
        params: RendezvousParams,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.kv = kv
        self.keys = RunKeys(params.prefix, run_id, params.incarnation)  # the one key root of a URL's run
        self.run_id = self.keys.run_id
        self.params = params
        self.on_progress = on_progress
        #: called after each keep-alive refresh of this node's key
        #: (see :class:`~rdzv_core.rendezvous.keepalive.KeepAlive`).
        self.on_keepalive: Callable[[BaseException | None], object] | None = None
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: this node's name in its keep-alive record, the rank policies' tie-break (the handler sets ``local_addr``).
        self.host = socket.gethostname()
        #: this node's name in the run's ledger (``node_name``: the scheduler's node name, else the host name).
        self.node_name = params.node_name or socket.gethostname()
        self.ledger = NodeLedger(kv, self.keys, params.quarantine, scope=params.ledger_scope)
        #: the gate before each round: pre-flight checks (the handler sets them) and quarantine.
        self.gate = Gate(self, self.ledger, self.node_name)
        #: ``(version, round id, group rank)`` of the last round this node was a member of (``stable`` ranks).
        self.last_round: tuple[int, str, int] | None = None
        self._keepalive: KeepAlive | None = None
        self._alive_key: str | None = None
        self._alive_info: dict[str, Any] = {}
        self._finished = False  # this member's key is marked finished (mark_finished)
        # This node's place in the admission order of a round that follows a final one (docs/design.md).
        self._admission = Admission(kv, self.keys, self.node_id, params.keep_alive_ttl)
        self._final_ranks: str | None = None  # the rank policy of the final record _confirm returned
        # Since when this member's keep-alive saw the backend answer without a break (the round watch's evidence).
        self._evidence: Responsiveness | None = None
        self._watched: roundwatch.WatchedRound | None = None  # the round whose lapse watch we subscribed to
        self._spare_since: float | None = None  # when this node began waiting as a spare (monotonic)
        self._announced: set[int] = set()
        self._stall = Stall()
        self._lock = threading.Lock()
        self.current: RoundResult | None = None
        # The round this node took a ticket in during the current next_round(); kept across a
        # BackendUnavailableError (the retry resumes it), dropped on a Retry and when next_round ends.
        self._held: Held | None = None
        # Whether this node may have written into the run (it took its place in a next_round): set_closed
        # leaves a run that was closed before that as it is.
        self._wrote = False

    @property
    def incarnation(self) -> int:
        """The run's incarnation (:attr:`RunKeys.incarnation`; ``docs/design.md``, "Incarnations")."""
        return self.keys.incarnation

    @property
    def root(self) -> str:
        """The run's key root ``PREFIX/run_RUN_ID`` (:attr:`RunKeys.root`)."""
        return self.keys.root

    # -- one attempt ---------------------------------------------------------------------------
    def _attempt(self, deadline: float) -> RoundResult:
        """One attempt (after ``EtcdRendezvous.init_phase``): read the record, perform :func:`next_step`.

        Raises:
            Retry: start over (the round changed, or this step only waited).
        """
        started = time.monotonic()
        entry, record, seen = self._read_state_at()
        if entry is None or record is None:
            entry, record = self._setup(time.monotonic() - started, deadline)
            seen = entry.revision
        step = next_step(record, self._held, self.params.limit, entry.key)
        if step is Step.CLOSED:
            if self._spare_since is not None:
                raise RendezvousGracefulExitError(f"run {self.run_id} closed while this node waited as a spare")
            raise self.closed_error()
        self._spare_since = None
        if step is Step.JOIN:
            return self._join(record.version, record.id, deadline)
        if step is Step.RESUME:  # a backend error interrupted this node after it joined (or confirmed)
            held = self._held
            assert held is not None and record.participants is not None  # next_step checked both
            return self._confirm(held.version, held.rid, held.ticket - 1, record.participants, deadline)
        if step is Step.WAIT_AS_LATE_NODE:
            raise Retry("final round changed", credit=self._wait_as_late_node(entry, record, deadline))
        if step is Step.CHECK_FROZEN_STALL:
            self._check_frozen_stall(entry, record)
        self._progress("setup" if record.status is Status.SETUP else "waiting", record.version, 0, deadline)
        wait_for_change(self.kv, self.keys.state_dir, entry.revision,
                        min(time.monotonic() + self.params.keep_alive_ttl / 3, deadline), seen)
        raise Retry(f"round was {record.status.value}")

    # -- the phases -----------------------------------------------------------------------------
    def _setup(self, read_seconds: float, deadline: float) -> tuple[Entry, RoundRecord]:
        """Create a new round: setup (ephemeral) -> joinable (after ``try_create_rendezvous``).

        First sleeps a random time in ``[0, W)``, W = max(:data:`SETUP_STAGGER`, 16 x
        ``read_seconds``) and at most 1 s, and reads again, so nodes that start together do
        not all race the create (``docs/design.md``, "setup stagger").

        Raises:
            Retry: another node created the record meanwhile (re-read it), or won the race.
        """
        ttl = self.params.keep_alive_ttl
        window = min(1.0, max(SETUP_STAGGER, 16 * read_seconds))
        Backoff(base=window, cap=window).sleep(deadline)  # its first sleep: uniform(0, window), within the deadline
        if self._read_state()[0] is not None:
            raise Retry("another node is setting up a round")
        try:
            setup = self.kv.create(self.keys.round_record, RoundRecord(Status.SETUP).encode(), ttl=ttl)
        except KeyExistsError:
            raise Retry("another node is setting up a round", delay=True) from None  # backoff: no busy loop
        version = self._add(self.keys.version_counter)
        record = RoundRecord(Status.JOINABLE, version, uuid.uuid4().hex[:16])
        try:
            entry = self.kv.compare_and_swap(self.keys.round_record, record.encode(), setup.revision)
        except (CompareFailedError, KeyNotFoundError):
            raise Retry("setup record changed before it became joinable", delay=True) from None
        self._log(logging.INFO, "created the round", version=version)
        return entry, record

    def _join(self, version: int, rid: str | None, deadline: float) -> RoundResult:
        """Take a ticket, run the last call if ours, wait for the freeze (after ``join_phase``).

        A node resumed after a backend error keeps the ticket it holds (:class:`Held`).
        """
        p = self.params
        held = self._held
        if held is not None and held.is_round(version, rid):
            ticket = held.ticket  # joined before a backend error: the ticket is still ours
            self._log(logging.INFO, "resuming with ticket %d", ticket, version=version)
        else:
            queued = self._wait_for_place(version, rid, deadline)
            ticket = self._take_ticket(self.keys.joined(version, rid))
            self._held = Held(version, rid, ticket)
            self._log(logging.INFO, "joined with ticket %d", ticket, version=version)
            if queued:
                self._admission.entered(version, rid)
            else:
                self._mark_rejoined(version, rid)
        if ticket == p.limit:
            self._freeze(version, rid, p.limit, deadline)
        elif ticket == p.min_nodes:
            self._last_call(version, rid, deadline)
        entry, record = self._wait_until_not_joinable(version, rid, deadline)
        if record.status is not Status.FROZEN or not record.is_round(version, rid):
            raise Retry(f"round {version} became {record.status.value} before it froze")
        world = record.participants
        assert world is not None  # a decoded frozen record has participants
        if world > p.limit:
            raise RendezvousStateError(f"round record at {entry.key!r} has {world} participants, more than "
                                       f"max_nodes={p.max_nodes}", entry.key)
        if ticket > world:
            raise Retry(f"round {version} froze with {world} nodes before ticket {ticket}")
        return self._confirm(version, rid, ticket - 1, world, deadline)

    def _wait_for_place(self, version: int, rid: str | None, deadline: float) -> bool:
        """Before this node takes a ticket in round ``(version, rid)``: if it was not a member of the previous
        round, queue and wait until its ticket cannot push an incumbent or a node queued ahead of it out of
        the round, at most ``keep_alive_ttl`` s since it began to join (:mod:`.admission`). Whether it queued.
        """
        admission = self._admission
        if not admission.begin(version, self.last_round):
            return False
        since = admission.since
        assert since is not None  # begin() set it
        until = min(since + self.params.keep_alive_ttl, deadline)
        while time.monotonic() < until:
            expected, revision = admission.look(version, rid, since, self.params.keep_alive_ttl / 3)
            if expected.room_for_me(self.params.limit):
                break
            record = self._read_state()[1]
            if record is None or record.status is not Status.JOINABLE or not record.is_round(version, rid):
                break
            self._progress("joining", version, expected.joined, deadline)
            wait_for_change(self.kv, self.keys.tree, revision, min(expected.until, until))
        return True

    def _freeze(self, version: int, rid: str | None, participants: int, deadline: float) -> None:
        """CAS joinable -> frozen with ``participants`` members (the frozen record has no TTL)."""
        frozen = RoundRecord(Status.FROZEN, version, rid, participants=participants)
        try:
            if self._transition(version, rid, Status.JOINABLE, lambda _: frozen, deadline) is not None:
                self._log(logging.INFO, "froze the round with %d nodes", participants, version=version)
        except DeadlinePassedError:
            pass

    def _last_call(self, version: int, rid: str | None, deadline: float) -> None:
        """Own the last call: keep the round alive by TTL, freeze at the end (after
        ``handle_join_last_call``).

        Raises:
            DeadlinePassedError: the deadline passed before the round was marked.
        """
        p = self.params
        ttl = p.keep_alive_ttl
        marked = self._transition(version, rid, Status.JOINABLE, lambda r: r.replace(last_call=self.node_id),
                                  deadline, ttl=ttl)  # ephemeral from now on
        if marked is None:
            return
        started = time.monotonic()
        end = min(started + p.last_call_timeout, deadline)
        self._log(logging.INFO, "reached min_nodes; last call for %.1f s", p.last_call_timeout, version=version)
        # A round after a final one (docs/design.md, "Re-forming"): past the last call, nodes still expected
        # (incumbents, queued nodes: .admission) are waited for while places are free, within keep_alive_ttl of
        # when this node began to join; with reform=fast it freezes as soon as nobody is expected.
        since = self._admission.since if self._admission.since is not None else started
        awaits = self._admission.previous is not None
        fast = awaits and p.reform == "fast"
        until = min(max(end, since + ttl), deadline)
        while True:
            entry, record, seen = self._read_state_at()
            if entry is None or record is None or record.status is not Status.JOINABLE or \
                    not record.is_round(version, rid):
                return
            now = time.monotonic()
            prefix, after, wake = self.keys.state_dir, entry.revision, min(now + ttl / 3, end)
            if now >= end or fast:
                expected = self._admission.look(version, rid, since, unmarked_grace(ttl)) \
                    if awaits and now < until else None
                if expected is None or not expected[0].awaited(p.limit):
                    joined = min(self._tickets(self.keys.joined(version, rid)), p.limit)
                    if now < end:
                        self._log(logging.INFO, "nobody else expected: freezing at once with %d nodes", joined,
                                  version=version)
                    self._freeze(version, rid, joined, deadline)
                    return
                prefix, after = self.keys.tree, expected[1]
                wake = min(now + ttl / 3, until if now >= end else end, expected[0].until)
            try:
                self.kv.refresh(self.keys.round_record, ttl)
            except KeyNotFoundError:
                return
            self._progress("last-call", version, self._tickets(self.keys.joined(version, rid)), deadline)
            wait_for_change(self.kv, prefix, after, wake, seen)

    def _wait_until_not_joinable(self, version: int, rid: str | None, deadline: float) -> tuple[Entry, RoundRecord]:
        """Wait for the round to leave ``joinable``; destroy it if it reached ``min_nodes`` and has had
        no last-call owner for two looks ``2 x keep_alive_ttl`` apart (``docs/design.md``)."""
        ttl = self.params.keep_alive_ttl
        stalled_at: int | None = None
        while True:
            entry, record, seen = self._read_state_at()
            if entry is None or record is None:
                raise Retry(f"round {version} expired before it froze")
            if record.status is not Status.JOINABLE or not record.is_round(version, rid):
                return entry, record
            joined = self._tickets(self.keys.joined(version, rid))
            self._progress("joining", version, joined, deadline)
            if joined >= self.params.min_nodes and record.last_call is None:
                if stalled_at == entry.revision:
                    if self._destroy(entry, f"round {version} stalled with {joined} nodes and no last-call owner"):
                        raise Retry("stalled round destroyed")
                    continue  # the record moved on first: read it again
                stalled_at = entry.revision
            else:
                stalled_at = None
            if time.monotonic() >= deadline:
                raise DeadlinePassedError()
            wait_for_change(self.kv, self.keys.state_dir, entry.revision,
                            min(time.monotonic() + 2 * ttl, deadline), seen)

    def _confirm(self, version: int, rid: str | None, rank: int, world: int, deadline: float) -> RoundResult:
        """Confirm membership with a keep-alive key; the last to confirm makes the round final
        (after ``confirm_phase``). Two writes per member: its keep-alive key and, once per member and
        round (also when resumed), the ``confirmed`` counter."""
        p = self.params
        ttl = p.keep_alive_ttl
        alive_key = self.keys.alive(version, rid, rank)
        want = p.node_rank if p.rank_policy != "join" else None
        info = {"rank": rank, "node": self.node_id, "host": self.host, "name": self.node_name,
                "since": round(time.time(), 3),
                **member_fields(self.last_round, p.labels, want, p.node_order)}
        self.kv.put(alive_key, encode_json(info), ttl=ttl)
        self._alive_key, self._alive_info = alive_key, info
        self._keepalive = self._start_keepalive(alive_key, info, f"rdzv-keepalive-{self.run_id}-v{version}")
        held = self._held
        in_doubt = False
        if held is not None and held.confirmed and held.is_round(version, rid):
            # Resumed after a backend error: counted already, or the add never took effect. Never count
            # twice (that would make the round final without a member); a lost count is repaired from
            # the keep-alive keys instead (_check_frozen_stall).
            confirmed = self._tickets(self.keys.confirmed(version, rid))
            in_doubt = confirmed < world
        else:
            self._held = Held(version, rid, rank + 1, confirmed=True)
            confirmed = self._take_ticket(self.keys.confirmed(version, rid))
        if confirmed == world:
            self._make_final(version, rid, world, deadline)
        while True:
            entry, record, seen = self._read_state_at()
            if entry is None or record is None or not record.is_round(version, rid) or \
                    record.status not in (Status.FROZEN, Status.FINAL):
                raise Retry(f"round {version} ended before it became final")
            if record.status is Status.FINAL:
                self._final_ranks = record.ranks
                group_rank = rank if record.ranks is None else load_rank(self.kv, self.keys, version, rid, rank, world)
                return RoundResult(version, group_rank, world, rid or "", slot=rank)
            if self._check_frozen_stall(entry, record, repair=in_doubt):
                self._make_final(version, rid, world, deadline)
                in_doubt = False
                continue
            self._progress("confirming", version, world, deadline)
            if time.monotonic() >= deadline:
                raise DeadlinePassedError()
            wait_for_change(self.kv, self.keys.state_dir, entry.revision,
                            min(time.monotonic() + ttl / 3, deadline), seen)

    def _publish_ranks(self, version: int, rid: str | None, world: int, policy: str) -> None:
        """:func:`~.ranks.store_ranks` for the round this node completes (before it becomes final).

        Raises:
            Retry: a member's key is missing (it left or lapsed): the frozen round is destroyed.
        """
        ranks = store_ranks(self.kv, self.keys, version, rid, world, policy)
        if ranks is None:
            entry = self._read_state()[0]
            if entry is not None:
                self._destroy(entry, f"round {version}: a member's keep-alive key vanished before it became final")
            raise Retry(f"round {version} lost a member before its ranks were given")
        self._log(logging.INFO, "group ranks by %s: %s", policy, ranks[:32], version=version)

    def _make_final(self, version: int, rid: str | None, world: int, deadline: float) -> None:
        """Make frozen round ``(version, rid)`` of ``world`` members final: its ranks (a rank policy's),
        then the record. Does nothing if the record is no longer that frozen round."""
        entry, record = self._read_state()
        if entry is None or record is None or record.status is not Status.FROZEN or not record.is_round(version, rid):
            return
        policy = None if self.params.rank_policy == "join" else self.params.rank_policy
        if policy is not None:
            self._publish_ranks(version, rid, world, policy)
        final = RoundRecord(Status.FINAL, version, rid, participants=world, ranks=policy)
        try:
            made = self._transition(version, rid, Status.FROZEN, lambda _: final, deadline, current=(entry, record))
        except DeadlinePassedError:
            return
        if made is not None:
            try:
                write_last_final(self.kv, self.keys, version, rid)
            except (BackendUnavailableError, BackendClosedError) as exc:  # newcomers then see the round end later
                self._log(logging.WARNING, "could not record the last final round: %s", exc, version=version)

    def _check_frozen_stall(self, entry: Entry, record: RoundRecord, repair: bool = False) -> bool:
        """Destroy a frozen round whose (record revision, confirmation count) has not changed for
        ``keep_alive_ttl`` seconds on this node's monotonic clock.

        With ``repair`` (this member's own count may be the one lost: its ``add`` failed without an
        answer), after ``keep_alive_ttl / 3`` unchanged it first lists the keep-alive keys: a key for every
        slot means every member confirmed, and the round may be made final instead.

        Returns:
            ``True`` if the round is to be made final (``repair`` and every slot's key present).

        Raises:
            Retry: this node destroyed the round (it returns if the record changed first).
        """
        world = record.participants or 0
        confirmed = self._tickets(self.keys.confirmed(record.version, record.id))
        unchanged = self._stall.same_for((entry.key, entry.revision, confirmed))
        if repair and unchanged >= self.params.keep_alive_ttl / 3:
            alive, _ = self.kv.list(self.keys.alive_dir(record.version, record.id))
            if not missing_ranks(alive, world):
                self._log(logging.INFO, "%d of %d confirmations counted, every member's key present: "
                          "making the round final", confirmed, world, version=record.version)
                return True
        if unchanged >= self.params.keep_alive_ttl:
            if self._destroy(entry, f"round {record.version} stalled while frozen: {confirmed} of "
                                    f"{record.participants} members confirmed"):
                raise Retry("stalled frozen round destroyed")
            # the record moved on first (the last member confirmed, or another node destroyed it): the
            # caller reads it again; giving the round up here would leave a round that just became final
        return False

    def _wait_as_late_node(self, entry: Entry, record: RoundRecord, deadline: float) -> float:
        """Count ourselves as waiting; destroy the round if a member's keep-alive lapsed (after
        ``handle_existing_rendezvous``). In a full round (``max_nodes`` members) this node is a
        *spare*: it waits without a deadline and logs every :data:`SPARE_LOG_EVERY` s.

        Returns:
            the seconds spent as a spare (credited back to the overall deadline).
        """
        version, rid = record.version, record.id
        world = record.participants or 0
        spare = world >= self.params.limit
        if version not in self._announced:
            self._take_ticket(self.keys.waiting(version, rid))
            self._announced.add(version)
        started = time.monotonic()
        if spare and self._spare_since is None:
            self._spare_since = started
        logged = -float("inf")
        alive_dir = self.keys.alive_dir(version, rid)
        ttl = self.params.keep_alive_ttl
        # A member of that round knows it is over (it left to re-rendezvous); anyone else acts on a missing key
        # only once the backend answered its looks for a whole TTL (docs/design.md, "The backend away").
        member = self.last_round is not None and self.last_round[:2] == (version, rid or "")
        self._admission.saw_final(version, rid)
        if not member:
            self._admission.enqueue()  # arrival order among the nodes waiting for a place (once per next_round)
        answering = Responsiveness(slow=ttl / 3, max_gap=2 * ttl / 3)
        missing_since: float | None = None  # when a prompt look first showed a rank missing
        while True:
            looked = time.monotonic()
            alive, revision = self.kv.list(alive_dir)
            answering.record(looked, now := time.monotonic(), ok=True)
            missing = missing_ranks(alive, world)
            missing_since = (missing_since or now) if missing else None
            if missing_since is not None and (member or now >= judged_at(answering.since, missing_since, ttl)):
                self._destroy(entry, f"round {version}: keep-alive of rank(s) {missing} lapsed")
                break
            now = time.monotonic()
            if spare and now - logged >= SPARE_LOG_EVERY:
                logged = now
                self._log(logging.INFO, "run full (%d of max_nodes=%d members): waiting as a spare", world,
                          self.params.max_nodes, version=version)
            self._progress("spare" if spare else "waiting", version, world, deadline + (now - started) * spare)
            if not spare and now >= deadline:
                break
            next_check = now + (ttl / 3 if missing else ttl)
            wait_for_change(self.kv, self.keys.tree, revision, next_check if spare else min(next_check, deadline))
            entry_now = self._read_state()[0]
            if entry_now is None or entry_now.revision != entry.revision:
                break
        self._admission.waited()
        return time.monotonic() - started if spare else 0.0

    def _progress(self, phase: str, version: int, joined: int, deadline: float) -> None:
        if self.on_progress is not None:
            p = self.params
            self.on_progress(Progress(phase, version, joined, p.min_nodes, p.limit,
                                      max(0.0, deadline - time.monotonic())))
