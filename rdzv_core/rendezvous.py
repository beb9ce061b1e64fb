"""The rendezvous state machine, written once against the KV protocol.

After torchelastic's ``EtcdRendezvous`` (``rendezvous_barrier``, ``init_phase``,
``join_phase``, ``confirm_phase``, ``handle_existing_rendezvous``): a round goes

::

    (absent) --create--> setup --CAS--> joinable --CAS--> frozen --CAS--> final
                                         |  last call            |  all confirmed
       closed <--CAS-- (any state)       |  (min <= n < max)     |
    final round whose keep-alive lapsed --compare_and_delete--> (absent)

Semantics kept from the seed: a version counter numbers rounds; ranks are given in
join order; the member that reached ``min_nodes`` owns the *last call* (waits
``last_call_timeout`` more for others, keeping the round record alive by TTL,
then freezes it); reaching ``max_nodes`` freezes at once; every member of a
frozen round confirms and then keeps a per-member keep-alive key alive by TTL;
nodes arriving while a round is final are counted as waiting
(``num_nodes_waiting``) and watch the keep-alive keys — a lapsed one makes them
destroy the round by compare-and-delete so a new round can form; ``set_closed``
ends the run; extra data can be stored per round.

Membership rules added here (``docs/design.md``): nodes beyond ``max_nodes`` are
*spares* that do not make the members restart; the members of a final round
watch its keep-alive keys too (:mod:`rdzv_core.roundwatch`, one watch per
process), so a silently lost member is noticed within about ``keep_alive_ttl``;
a member that finished keeps its key, marked, so the others carry on.

What changed from the seed, and why (see ``docs/design.md``): the seed appends
every join and every confirmation to one JSON blob by compare-and-swap, so N
agents cost O(N^2) backend work. Here the round record changes only on state
transitions; joins take a ticket from an atomic counter (``add``), confirmations
count on another, waiting nodes on a third: O(1) writes per agent. Waits use
watches on the round record, bounded by deadlines; retries back off with jitter.

Keys, under ``ROOT = PREFIX/run_RUN_ID``::

    ROOT/state/round            JSON round record (the only key CAS'd)
    ROOT/state/closed           present once the run is closed (never expires)
    ROOT/counter/version        round version counter
    ROOT/v_V.ID/joined          join tickets of round V (ticket t -> rank t-1)
    ROOT/v_V.ID/confirmed       confirmations of round V
    ROOT/v_V.ID/waiting         late nodes counted while V is final
    ROOT/v_V.ID/alive/rank_R    keep-alive key of rank R (TTL; no TTL and "finished" once it finished)
    ROOT/v_V.ID/extra/KEY       extra data of round V
    ROOT/store/v_V.ID/...       the c10d Store of round V (see rdzv_core.store)

``ID`` is the round record's random id (:func:`round_segment`), so no round --
not even one of the same version after the backend lost the run's keys -- sees
another's keys.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import (
    RendezvousGracefulExit,
    BackendClosed,
    BackendUnavailable,
    CompareFailed,
    ConfigError,
    KeyExists,
    KeyNotFound,
    CorruptEntry,
    RendezvousClosed,
    RendezvousStateError,
    RendezvousTimeout,
)
from .kv import Entry, KVBackend, escape_segment, join_key, parse_counter, wait_for_change
from . import roundwatch
from .keepalive import KeepAlive
from .outage import OutageLog
from .url import validate_run_id

__all__ = ["RendezvousParams", "Rendezvous", "RoundResult", "Progress", "round_segment"]

log = logging.getLogger(__name__)

SETUP, JOINABLE, FROZEN, FINAL, CLOSED = "setup", "joinable", "frozen", "final", "closed"
_STATUSES = (SETUP, JOINABLE, FROZEN, FINAL)  # CLOSED is its own key
MAX_STATE_BYTES = 4096
MIN_KEEP_ALIVE_TTL = 0.1  #: seconds
#: seconds: the shortest window over which nodes that find no round stagger their setup (see ``_setup``).
SETUP_STAGGER = 0.05
#: Seconds between two INFO lines of a node waiting as a spare.
SPARE_LOG_EVERY = 60.0


@dataclass(frozen=True)
class RendezvousParams:
    """Rendezvous parameters (URL query keys of the same names).

    ===================  =========  ===================================================
    parameter            default    meaning
    ===================  =========  ===================================================
    min_nodes            (needed)   nodes needed for a round to be valid (int >= 1)
    max_nodes            min_nodes  nodes admitted at most (int >= min_nodes)
    timeout              600.0      overall seconds for one ``next_round`` call
    last_call_timeout    30.0       seconds the min-th node waits for more nodes
    keep_alive_ttl       5.0        TTL (s) of keep-alive keys and of transient
                                    round records; refreshed every TTL/3
    prefix               torchelastic/p2p   key prefix in the backend
    ===================  =========  ===================================================

    ``last_call_timeout`` is 30 s as in the seed's docstring and PyTorch's
    shipped handler (the seed's constant of 1 s contradicts its own docs).

    Raises:
        ConfigError: a value is out of range (names the field and value).
    """

    min_nodes: int
    max_nodes: int | None = None
    timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_ttl: float = 5.0
    prefix: str = "torchelastic/p2p"

    @classmethod
    def from_query(cls, query: Mapping[str, Any]) -> "RendezvousParams":
        """The parameters a URL's parsed query gives (``RendezvousURL.params``, canonical
        key names); other keys are ignored, ``min_nodes`` is 1 when absent.

        Raises:
            ConfigError: a value is out of range (names the field and value).
        """
        fields = ("min_nodes", "max_nodes", "timeout", "last_call_timeout", "keep_alive_ttl", "prefix")
        return cls(**{"min_nodes": 1, **{k: query[k] for k in fields if k in query}})

    def __post_init__(self) -> None:
        if self.max_nodes is None:
            object.__setattr__(self, "max_nodes", self.min_nodes)
        for name in ("min_nodes", "max_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "must be an int >= 1")
        if self.min_nodes > self.max_nodes:  # type: ignore[operator]
            raise ConfigError("min_nodes", self.min_nodes, f"greater than max_nodes={self.max_nodes}")
        for name in ("timeout", "last_call_timeout", "keep_alive_ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e7:
                raise ConfigError(name, value, "must be a number of seconds > 0 and <= 1e7")
        if self.keep_alive_ttl < MIN_KEEP_ALIVE_TTL:
            raise ConfigError("keep_alive_ttl", self.keep_alive_ttl,
                              f"must be >= {MIN_KEEP_ALIVE_TTL} s (it is refreshed every TTL/3 over the network)")


@dataclass(frozen=True)
class _Held:
    """The round this node holds a ticket in, while ``next_round`` runs (see ``Rendezvous._held``)."""

    version: int
    rid: str | None
    ticket: int
    confirmed: bool = False


@dataclass(frozen=True)
class RoundResult:
    """A completed round: ``version`` (int), this node's ``rank`` and the ``world_size``.

    ``round_id`` (str) is the random id the round record got at setup: with the
    version it identifies the round even if a run's keys were lost and the version
    counter started again.
    """

    version: int
    rank: int
    world_size: int
    round_id: str = ""


@dataclass(frozen=True)
class Progress:
    """What a waiting node sees, for progress output.

    Attributes:
        phase: ``"joining"``, ``"last-call"``, ``"confirming"``, ``"waiting"`` (late node) or ``"setup"``.
        version: the round version (0 if unknown).
        joined: nodes that joined the round so far (or 0 if unknown).
        min_nodes, max_nodes: the parameters.
        remaining: seconds left of the overall timeout.
    """

    phase: str
    version: int
    joined: int
    min_nodes: int
    max_nodes: int
    remaining: float


class _Retry(Exception):
    """Internal: start the attempt over (after a backoff if ``delay``).

    ``credit``: seconds the attempt spent waiting as a spare, given back to the
    overall deadline (a spare waits for a place, not for a round to form).
    """

    def __init__(self, reason: str, delay: bool = False, credit: float = 0.0) -> None:
        super().__init__(reason)
        self.delay = delay
        self.credit = credit


class _Backoff:
    """Jittered exponential backoff: 10 ms doubling to 1 s (full jitter)."""

    def __init__(self, base: float = 0.01, cap: float = 1.0) -> None:
        self.base, self.cap, self.n = base, cap, 0

    def sleep(self, deadline: float) -> None:
        delay = random.uniform(0, min(self.cap, self.base * (2**self.n)))
        self.n = min(self.n + 1, 16)
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))


class _Stall:
    """How long (monotonic seconds) a round has shown one progress snapshot."""

    def __init__(self) -> None:
        self.snapshot: object = None
        self.since = 0.0

    def same_for(self, snapshot: object) -> float:
        now = time.monotonic()
        if snapshot != self.snapshot:
            self.snapshot, self.since = snapshot, now
        return now - self.since


class Rendezvous:
    """One node's view of the rendezvous of one run over a :class:`KVBackend`.

    Args:
        kv: the backend (not closed by this object).
        run_id: the run id: 1-128 characters from ``A-Za-z0-9_.-=+:@~``, not ``.``/``..``
            (one key segment, so it cannot reach another run's keys).
        params: :class:`RendezvousParams`.
        on_progress: optional callback receiving :class:`Progress` while waiting.

    Thread-safety: one ``next_round`` at a time per object.

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
        self.run_id = validate_run_id(run_id)
        self.params = params
        self.on_progress = on_progress
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.root = join_key(params.prefix, "run_" + run_id)
        self._state_dir = self.root + "/state/"
        self._state_key = self._state_dir + "round"
        self._closed_key = self._state_dir + "closed"
        self._keepalive: KeepAlive | None = None
        self._alive_key: str | None = None
        self._alive_info: dict[str, Any] = {}
        self._finished = False  # this member's key is marked finished (mark_finished)
        # After waiting as a late node: (incumbents, monotonic deadline): the members still in that round
        # when it ended; the next round's ticket is taken only once that many joined (or at the deadline),
        # so a spare never displaces a member that is re-forming (see _defer_to_incumbents).
        self._defer: tuple[int, float] | None = None
        self._previous: int | None = None  # version of the round this node was a member of before next_round
        self._final_revision = 0  # revision of the final record of the round _confirm returned
        self._watched: roundwatch.RoundKeys | None = None  # the round whose lapse watch we subscribed to
        self._spare_since: float | None = None  # when this node began waiting as a spare (monotonic)
        self._announced: set[int] = set()
        self._stall = _Stall()
        self._lock = threading.Lock()
        self.current: RoundResult | None = None
        # The round this node took a ticket in during the current next_round(): (version, round id,
        # ticket, confirmed). Kept across a BackendUnavailable, so the retry resumes with the same
        # ticket instead of joining (and confirming) a second time; dropped on a _Retry and when
        # next_round returns or raises.
        self._held: _Held | None = None

    # -- public API ---------------------------------------------------------
    def next_round(self) -> RoundResult:
        """Block until this node is a member of a final round; return its result.

        After torchelastic's ``EtcdRendezvous.rendezvous_barrier``. Leaves the
        previous round first (its keep-alive key is deleted at once, so the other
        members' waiting nodes re-form promptly).

        Raises:
            RendezvousClosed: the run is closed (:class:`RendezvousGracefulExit` if it
                closed while this node waited as a spare).
            RendezvousTimeout: no round within ``params.timeout`` seconds (time spent
                waiting as a spare, for a full round to lose a member, does not count).
            RendezvousStateError: the stored round record is corrupt.
            BackendUnavailable: the backend was unreachable at the deadline (the last
                attempt failed on it; if it answered since, the timeout is raised instead).
        """
        with self._lock:
            self._previous = self.current.version if self.current is not None else None
            self.leave()
            self._spare_since = self._defer = None
            try:
                return self._rounds_until(time.monotonic() + self.params.timeout)
            finally:
                self._held = None  # a ticket is held only while next_round runs

    def _rounds_until(self, deadline: float) -> RoundResult:
        """:meth:`next_round`'s retry loop: attempts until one completes or ``deadline`` passes."""
        backoff = _Backoff()
        last_error: BackendUnavailable | None = None
        outage = OutageLog(self._log)  # one WARNING per outage, not one per retry
        while time.monotonic() < deadline:
            try:
                result = self._attempt(deadline)
                outage.recovered("backend reachable again")
                self.current = result
                self._watch_round(result)
                self._log(logging.INFO, "round complete: world size %d", result.world_size)
                return result
            except _Retry as retry:
                outage.recovered("backend reachable again")
                last_error = None  # reachable again: running out of time now is a timeout
                self._log(logging.DEBUG, "retrying rendezvous: %s", retry)
                self._held = None  # that round is given up: a new attempt takes a new ticket
                self._stop_keepalive(delete=True)
                deadline += retry.credit
                if retry.delay:
                    backoff.sleep(deadline)
            except CorruptEntry as exc:
                remedy = "; reset the run's state (rdzv reset URL)" if exc.key is not None else ""
                raise RendezvousStateError(f"run {self.run_id}: {exc}{remedy}", exc.key) from exc
            except BackendUnavailable as exc:
                last_error = exc
                outage.failed("backend unavailable, retrying until the deadline: %s", exc)
                self._stop_keepalive(delete=False)  # the round's ticket stays held: the retry resumes it
                backoff.sleep(deadline)
        if last_error is not None:
            raise last_error
        raise RendezvousTimeout(
            f"run {self.run_id}: no round completed within {self.params.timeout} s "
            f"(min_nodes={self.params.min_nodes}, max_nodes={self.params.max_nodes})"
        )

    def leave(self, finished: bool = False) -> None:
        """Leave the current round (the run stays open).

        Args:
            finished: this node's work is done and the other members carry on in the
                round: as :meth:`mark_finished`, its key stays (marked, without TTL)
                instead of being deleted, so nobody takes it for a lost member (a
                deleted key makes the other members destroy the round and re-form).
                Implied once :meth:`mark_finished` was called.
        """
        self._unwatch_round()
        if finished or self._finished:
            self.mark_finished()
            self._stop_keepalive(delete=False)  # marked: the key stays; not marked (backend away): it lapses
        else:
            self._stop_keepalive(delete=True)
        self._finished = False
        self.current = None

    def mark_finished(self) -> bool:
        """Mark this member of the current round finished: its work is done.

        Its keep-alive key is rewritten without TTL with a ``finished`` time and no
        longer refreshed, so if this node now ends or dies -- it waits at an exit
        barrier, say -- the other members carry on instead of taking it for lost
        (:mod:`rdzv_core.roundwatch` and waiting nodes only count missing keys).
        Returns whether the key was marked (``False``: no round, already marked, or
        the backend was unreachable: then the key stays refreshed). Idempotent.
        """
        if self._finished or self._alive_key is None:
            return False
        key, ttl = self._alive_key, self.params.keep_alive_ttl
        self._stop_keepalive(delete=False, forget=False)  # first: no refresh may give the key a TTL again
        try:
            self.kv.put(key, _encode({**self._alive_info, "finished": round(time.time(), 3)}))
        except (BackendUnavailable, BackendClosed) as exc:
            self._log(logging.WARNING, "could not mark this member finished: %s", exc)
            self._keepalive = KeepAlive(self.kv, key, ttl, value=_encode(self._alive_info),
                                        name=f"rdzv-keepalive-{self.run_id}")
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
        entry, state = self._read_state()
        current = self.current
        if state is None or current is None or state["status"] != FINAL or \
                not _same_round(state, current.version, current.round_id or None):
            return False
        mine = f"rank_{current.rank}"
        for e in self.kv.list(self._vkey(current.version, current.round_id or None, "alive") + "/")[0]:
            member = _member(e)
            if e.key.rsplit("/", 1)[-1] != mine and "corrupt" not in member and "finished" not in member:
                return True
        return False

    def others_carry_on(self) -> bool:
        """Whether the run goes on without this node: its live round is one this node is not in.

        True when the round record is a final round other than this node's current
        one, or any round of a higher version than this node's current one (the others
        re-formed without it). Then closing the run (what torch's handlers do at the end
        of a job) would stop nodes that still train; :meth:`RdzvHandler.shutdown` leaves
        it open instead. False for a closed or absent run, and while this node is a
        member of the live round.
        """
        state = self._read_state()[1]
        if state is None or state["status"] in (CLOSED, SETUP):
            return False
        current = self.current
        if current is not None and _same_round(state, current.version, current.round_id or None):
            return False
        if state["status"] == FINAL:
            return True
        return current is not None and state["version"] > current.version

    def is_closed(self) -> bool:
        """Whether the run is closed (eventually consistent, like torch's handlers)."""
        state = self._read_state()[1]
        return state is not None and state["status"] == CLOSED

    def set_closed(self) -> None:
        """Mark the run closed so no node starts another round (after the seed's ``set_closed``).

        The mark is its own key without TTL, so no TTL refresh of a round record can
        ever make a closed run expire back into an open one.
        """
        self.kv.put(self._closed_key, b"closed")
        self._log(logging.INFO, "run closed")

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for a round with this node in it (after the seed's ``num_nodes_waiting``).

        As in the seed: the late nodes counted while the current round is final --
        but only while it has fewer than ``max_nodes`` members: nodes beyond that
        are *spares* (torch's redundancy list), which must not make the members
        restart; a spare takes a place when a member is lost. In addition, when
        this node holds a round (``self.current``) that is no longer the run's live
        round -- destroyed because a member's keep-alive key lapsed (seen by the
        members' own watch, :mod:`rdzv_core.roundwatch`, or by a waiting node), or
        lost with the run's keys -- it returns the nodes that joined the round
        now forming, and at least 1: a member must re-rendezvous rather than train
        on in a round the others have left. 0 once the run is closed.
        """
        state = self._read_state()[1]
        current = self.current
        if state is not None and state["status"] == CLOSED:
            return 0
        if current is not None and (
            state is None or not _same_round(state, current.version, current.round_id or None)
        ):
            joined = 0
            if state is not None and state["status"] == JOINABLE:
                joined = self._counter(self._vkey(state["version"], state.get("id"), "joined"))
            return max(1, joined)
        if state is None or state["status"] != FINAL:
            return 0
        if state["participants"] >= (self.params.max_nodes or self.params.min_nodes):
            return 0  # the round is full: the nodes waiting are spares, admitted only when a member is lost
        return self._counter(self._vkey(state["version"], state.get("id"), "waiting"))

    def store_extra_data(self, version: int, key: str, value: bytes, round_id: str | None = None) -> None:
        """Store ``value`` under ``key`` for round ``version`` (after the seed's ``store_extra_data``).

        ``round_id``: the round's id (:attr:`RoundResult.round_id`); default: this node's
        current round's if its version is ``version`` (else a round without id).
        """
        self.kv.put(self._vkey(version, self._rid_of(version, round_id), "extra", escape_segment(key)), value)

    def load_extra_data(self, version: int, key: str, timeout: float, round_id: str | None = None) -> bytes:
        """Wait up to ``timeout`` seconds for extra data ``key`` of round ``version`` (``round_id``:
        as for :meth:`store_extra_data`).

        Raises:
            RendezvousTimeout: not published in time (the seed waited forever).
        """
        extra = self._vkey(version, self._rid_of(version, round_id), "extra") + "/"
        full = extra + escape_segment(key)
        deadline = time.monotonic() + timeout
        while True:
            entries, revision = self.kv.list(extra)
            for entry in entries:
                if entry.key == full:
                    return entry.value
            if not wait_for_change(self.kv, extra, revision, deadline):
                raise RendezvousTimeout(f"extra data {key!r} of round {version} not published within {timeout} s")

    def store_prefix(self, version: int, round_id: str | None = None) -> str:
        """Key prefix (ending in ``/``) of the c10d Store of round ``version`` (``round_id``: as for
        :meth:`store_extra_data`): ``ROOT/store/v_V.ID/``."""
        return join_key(self.root, "store", round_segment(version, self._rid_of(version, round_id))) + "/"

    def describe(self) -> dict[str, Any]:
        """The run's current state as plain data: status, version, participants, alive ranks, waiting."""
        entry, state = self._read_state()
        if state is None:
            return {"run_id": self.run_id, "status": "absent"}
        out: dict[str, Any] = {"run_id": self.run_id, **state}
        version = state.get("version")
        if isinstance(version, int) and version > 0:
            rid = state.get("id")
            alive, _ = self.kv.list(self._vkey(version, rid, "alive") + "/")
            out["alive"] = [_member(e) for e in alive]
            for name in ("joined", "waiting"):
                out[name] = self._counter(self._vkey(version, rid, name))
        return out

    # -- one attempt (after the seed's init_phase) ----------------------------
    def _attempt(self, deadline: float) -> RoundResult:
        started = time.monotonic()
        entry, state = self._read_state()
        if entry is None or state is None:
            entry, state = self._setup(time.monotonic() - started, deadline)
        status = state["status"]
        if status == CLOSED:
            if self._spare_since is not None:
                raise RendezvousGracefulExit(f"run {self.run_id} closed while this node waited as a spare")
            raise RendezvousClosed(f"run {self.run_id} is closed")
        self._spare_since = None
        limit = self.params.max_nodes or self.params.min_nodes
        if state.get("participants", 0) > limit:  # a node of this job never admits more than max_nodes
            raise RendezvousStateError(
                f"round record at {entry.key!r} has {state['participants']} participants, more than "
                f"max_nodes={limit}; reset the run's state",
                entry.key,
            )
        if status == JOINABLE:
            return self._join(state["version"], state.get("id"), deadline)
        held = self._held
        if held is not None and status in (FROZEN, FINAL) and _same_round(state, held.version, held.rid):
            world = _int_field(state, "participants", self._state_key)
            if held.ticket <= world and (status == FROZEN or held.confirmed):
                # a backend error interrupted this node after it joined (or confirmed): carry on as that member
                return self._confirm(held.version, held.rid, held.ticket - 1, world, deadline)
        if status == FINAL:
            spare_seconds = self._wait_as_late_node(entry, state, deadline)
            raise _Retry("final round changed", credit=spare_seconds)
        if status == FROZEN:
            self._check_frozen_stall(entry, state)
        self._progress("setup" if status == SETUP else "waiting", state.get("version", 0), 0, deadline)
        wait_for_change(self.kv, self._state_dir, entry.revision,
                        min(time.monotonic() + self.params.keep_alive_ttl / 3, deadline))
        raise _Retry(f"round was {status}")

    def _setup(self, read_seconds: float, deadline: float) -> tuple[Entry, dict[str, Any]]:
        """Create a new round: setup (ephemeral) -> joinable (after the seed's try_create_rendezvous).

        The nodes of a job usually start together and all find no round. Before racing
        to create the setup record, each waits a random time in ``[0, W)`` (jittered
        backoff, as torch's dynamic handler delays its first round) and reads ``state/``
        again: the first to wake creates the record and the others find it instead of
        each losing a create. ``W`` = max(:data:`SETUP_STAGGER`, 16 x ``read_seconds``,
        the duration of the read that found no round), at most 1 s: the winner's create
        needs about two such round trips to be seen, so about N/8 of N nodes still race
        it (N - 1 without the stagger). Every node sleeps its share, so the first round
        completes up to ``W`` later (benchmark, memory, N = 8: 0.009 -> 0.054 s). A plain
        sleep, not a watch with that timeout: backends whose watches have a floor (etcd
        v2's long poll: 0.2 s) would end every node's wait at the same moment and all
        would create; and a watch variant (woken by the record, then a re-read) measured
        slower at N = 1,024 (etcd-v3 5.4-7.5 s against 1.8 s): 1,024 more wake-ups.

        Raises:
            _Retry: another node created the record meanwhile (re-read it), or won the race.
        """
        ttl = self.params.keep_alive_ttl
        window = min(1.0, max(SETUP_STAGGER, 16 * read_seconds))
        _Backoff(base=window, cap=window).sleep(deadline)  # its first sleep: uniform(0, window), within the deadline
        if self._read_state()[0] is not None:
            raise _Retry("another node is setting up a round")
        try:
            setup = self.kv.create(self._state_key, _encode({"status": SETUP}), ttl=ttl)
        except KeyExists:
            raise _Retry("another node is setting up a round", delay=True) from None  # backoff: no busy loop
        version = self._add(join_key(self.root, "counter", "version"))
        state = _round_record(JOINABLE, version, uuid.uuid4().hex[:16])
        try:
            entry = self.kv.compare_and_swap(self._state_key, _encode(state), setup.revision)
        except (CompareFailed, KeyNotFound):
            raise _Retry("setup record changed before it became joinable", delay=True) from None
        self._log(logging.INFO, "created the round", version=version)
        return entry, state

    def _join(self, version: int, rid: str | None, deadline: float) -> RoundResult:
        """Take a ticket, run the last call if ours, wait for the freeze (after the seed's join_phase).

        ``(version, rid)`` identify the round (``rid`` is the record's ``id``); every
        later phase checks both, so a round recreated under the same version after
        the run's keys were lost is never taken for this one. A node resumed by
        :meth:`next_round` after a backend error keeps the ticket it took (the seed
        would join again and count itself twice: a lone waiting node froze a round
        of 2 with itself as both members).
        """
        p = self.params
        held = self._held
        if held is not None and (held.version, held.rid) == (version, rid):
            ticket = held.ticket  # joined before a backend error: the ticket is still ours
            self._log(logging.INFO, "resuming with ticket %d", ticket, version=version)
        else:
            self._defer_to_incumbents(version, rid, deadline)
            ticket = self._add(self._vkey(version, rid, "joined"))
            self._held = _Held(version, rid, ticket)
            self._log(logging.INFO, "joined with ticket %d", ticket, version=version)
        if ticket == p.max_nodes:
            self._freeze(version, rid, p.max_nodes, deadline)
        elif ticket == p.min_nodes:
            self._last_call(version, rid, deadline)
        entry, state = self._wait_until_not_joinable(version, rid, deadline)
        if state["status"] != FROZEN or not _same_round(state, version, rid):
            raise _Retry(f"round {version} became {state['status']} before it froze")
        world = _int_field(state, "participants", self._state_key)
        if world > (p.max_nodes or world):
            raise RendezvousStateError(
                f"round record at {self._state_key!r} has {world} participants, more than max_nodes={p.max_nodes}",
                self._state_key,
            )
        if ticket > world:
            raise _Retry(f"round {version} froze with {world} nodes before ticket {ticket}")
        return self._confirm(version, rid, ticket - 1, world, deadline)

    def _defer_to_incumbents(self, version: int, rid: str | None, deadline: float) -> None:
        """After waiting as a late node: let the members of the old round take their tickets first.

        A spare that saw a member lapse and a survivor that is stopping its workers
        both head for the next round; tickets go in join order, and the spare, already
        waiting, would often win the survivor's place (the survivor then becomes the
        spare). So a late node that was not a member of the old round waits until as
        many nodes joined as still held keys in that round when it ended (a dead
        member's key counts until it lapses), at most ``keep_alive_ttl`` s, then joins.
        """
        defer, self._defer = self._defer, None
        if defer is None:
            return
        incumbents, until = defer[0], min(defer[1], deadline)
        joined_key = self._vkey(version, rid, "joined")
        version_dir = joined_key.rsplit("/", 1)[0] + "/"
        while time.monotonic() < until:
            revision = self.kv.list(version_dir)[1]
            joined = self._counter(joined_key)
            if joined >= incumbents:
                return
            state = self._read_state()[1]
            if state is None or state["status"] != JOINABLE or not _same_round(state, version, rid):
                return
            self._progress("joining", version, joined, deadline)
            wait_for_change(self.kv, self.root + "/", revision, until)

    def _freeze(self, version: int, rid: str | None, participants: int, deadline: float) -> None:
        """CAS joinable -> frozen with ``participants`` members.

        The frozen record has no TTL (the CAS removes the last call's): a round whose
        confirmations stop is destroyed by :meth:`_check_frozen_stall` instead, which
        saves every member a refresh of the record.
        """
        frozen = _encode(_round_record(FROZEN, version, rid, participants=participants))
        while time.monotonic() < deadline:
            entry, state = self._read_state()
            if entry is None or state is None or not _same_round(state, version, rid) or state["status"] != JOINABLE:
                return
            try:
                self.kv.compare_and_swap(self._state_key, frozen, entry.revision)
                self._log(logging.INFO, "froze the round with %d nodes", participants, version=version)
                return
            except (CompareFailed, KeyNotFound):
                continue

    def _last_call(self, version: int, rid: str | None, deadline: float) -> None:
        """Own the last call: keep the round alive by TTL, freeze at the end (after handle_join_last_call)."""
        p = self.params
        ttl = p.keep_alive_ttl
        while time.monotonic() < deadline:  # mark the round as having a last-call owner, ephemeral from now on
            entry, state = self._read_state()
            if entry is None or state is None or state["status"] != JOINABLE or not _same_round(state, version, rid):
                return
            try:
                marked = {**state, "last_call": self.node_id}
                entry = self.kv.compare_and_swap(self._state_key, _encode(marked), entry.revision, ttl=ttl)
                break
            except (CompareFailed, KeyNotFound):
                continue
        else:
            raise _Retry("deadline")
        end = min(time.monotonic() + p.last_call_timeout, deadline)
        self._log(logging.INFO, "reached min_nodes; last call for %.1f s", p.last_call_timeout, version=version)
        while True:
            entry, state = self._read_state()
            if entry is None or state is None or state["status"] != JOINABLE or not _same_round(state, version, rid):
                return
            now = time.monotonic()
            if now >= end:
                joined = self._counter(self._vkey(version, rid, "joined"))
                self._freeze(version, rid, min(joined, p.max_nodes or joined), deadline)  # type: ignore[type-var]
                return
            try:
                self.kv.refresh(self._state_key, ttl)
            except KeyNotFound:
                return
            self._progress("last-call", version, self._counter(self._vkey(version, rid, "joined")), deadline)
            wait_for_change(self.kv, self._state_dir, entry.revision, min(now + ttl / 3, end))

    def _wait_until_not_joinable(
        self, version: int, rid: str | None, deadline: float
    ) -> tuple[Entry, dict[str, Any]]:
        """Wait for the round to leave ``joinable``; destroy it if its last call stalled."""
        ttl = self.params.keep_alive_ttl
        stalled_at: int | None = None
        while True:
            entry, state = self._read_state()
            if entry is None or state is None:
                raise _Retry(f"round {version} expired before it froze")
            if state["status"] != JOINABLE or not _same_round(state, version, rid):
                return entry, state
            joined = self._counter(self._vkey(version, rid, "joined"))
            self._progress("joining", version, joined, deadline)
            if joined >= self.params.min_nodes and "last_call" not in state:
                # The node holding ticket min (or max) must mark or freeze the round; if it died
                # in between, nobody would: after two TTLs without change, destroy the round.
                if stalled_at == entry.revision:
                    self._destroy(entry, f"round {version} stalled with {joined} nodes and no last-call owner")
                    raise _Retry("stalled round destroyed")
                stalled_at = entry.revision
            else:
                stalled_at = None
            if time.monotonic() >= deadline:
                raise _Retry("deadline")
            wait_for_change(self.kv, self._state_dir, entry.revision, min(time.monotonic() + 2 * ttl, deadline))

    def _confirm(self, version: int, rid: str | None, rank: int, world: int, deadline: float) -> RoundResult:
        """Confirm membership with a keep-alive key; the last to confirm makes the round final.

        After the seed's ``confirm_phase``: two writes per member (its keep-alive key
        and the ``confirmed`` counter; the counter once per member and round, also when
        a backend error interrupted this node and :meth:`next_round` resumed it). While
        waiting for the others, members destroy the round if confirmations stall
        (:meth:`_check_frozen_stall`).
        """
        ttl = self.params.keep_alive_ttl
        alive_key = self._vkey(version, rid, "alive", f"rank_{rank}")
        info = {"rank": rank, "node": self.node_id, "host": socket.gethostname(), "since": round(time.time(), 3)}
        self.kv.put(alive_key, _encode(info), ttl=ttl)
        self._alive_key, self._alive_info = alive_key, info
        self._keepalive = KeepAlive(
            self.kv, alive_key, ttl, value=_encode(info), name=f"rdzv-keepalive-{self.run_id}-v{version}"
        )
        held = self._held
        if held is not None and held.confirmed and (held.version, held.rid) == (version, rid):
            # resumed after a backend error: counted already (or maybe: the add's answer was lost).
            # Never count twice -- a confirmation that was lost stalls the round, which is destroyed
            # after keep_alive_ttl; one counted twice would make it final without a member.
            confirmed = self._counter(self._vkey(version, rid, "confirmed"))
        else:
            self._held = _Held(version, rid, rank + 1, confirmed=True)
            confirmed = self._add(self._vkey(version, rid, "confirmed"))
        if confirmed == world:
            while time.monotonic() < deadline:
                entry, state = self._read_state()
                if entry is None or state is None or state["status"] != FROZEN or not _same_round(state, version, rid):
                    break
                final = _encode(_round_record(FINAL, version, rid, participants=world))
                try:
                    self.kv.compare_and_swap(self._state_key, final, entry.revision)
                    break
                except (CompareFailed, KeyNotFound):
                    continue
        while True:
            entry, state = self._read_state()
            if entry is None or state is None or not _same_round(state, version, rid) or state["status"] not in (
                FROZEN,
                FINAL,
            ):
                raise _Retry(f"round {version} ended before it became final")
            if state["status"] == FINAL:
                self._final_revision = entry.revision
                return RoundResult(version, rank, world, rid or "")
            self._check_frozen_stall(entry, state)
            self._progress("confirming", version, world, deadline)
            if time.monotonic() >= deadline:
                raise _Retry("deadline")
            wait_for_change(self.kv, self._state_dir, entry.revision, min(time.monotonic() + ttl / 3, deadline))

    def _check_frozen_stall(self, entry: Entry, state: dict[str, Any]) -> None:
        """Destroy a frozen round whose confirmations made no progress for ``keep_alive_ttl`` seconds.

        A frozen record has no TTL; a member that died before confirming would
        otherwise hold the round frozen for ever. Called (every ``keep_alive_ttl / 3``
        seconds) by confirmed members and by late nodes while they wait, with the
        time measured on this node's monotonic clock since it first saw this
        (record revision, confirmation count) -- the seed's frozen-record TTL, which
        every confirmation refreshed, measured without a write per member.

        Raises:
            _Retry: the round was destroyed (by this node or another).
        """
        version = state["version"]
        confirmed = self._counter(self._vkey(version, state.get("id"), "confirmed"))
        if self._stall.same_for((entry.key, entry.revision, confirmed)) >= self.params.keep_alive_ttl:
            self._destroy(entry, f"round {version} stalled while frozen: {confirmed} of "
                                 f"{state.get('participants')} members confirmed")
            raise _Retry("stalled frozen round destroyed")

    def _wait_as_late_node(self, entry: Entry, state: dict[str, Any], deadline: float) -> float:
        """Count ourselves as waiting; destroy the round if a member's keep-alive lapsed.

        After the seed's ``handle_existing_rendezvous`` / ``wait_for_rendezvous_to_free``.
        A round with ``max_nodes`` members is full: this node is then a *spare* (torch's
        redundancy list). The members are not asked to restart for it
        (:meth:`num_nodes_waiting`), it waits without a deadline (it waits for a place,
        not for a round to form) until a member's key lapses or the record changes,
        and it logs ``run full: waiting as a spare`` every :data:`SPARE_LOG_EVERY` s.

        Returns:
            the seconds spent as a spare (credited back to the overall deadline).
        """
        version = state["version"]
        world = _int_field(state, "participants", self._state_key)
        spare = world >= (self.params.max_nodes or self.params.min_nodes)
        rid = state.get("id")
        if version not in self._announced:
            self._add(self._vkey(version, rid, "waiting"))
            self._announced.add(version)
        started = time.monotonic()
        if spare and self._spare_since is None:
            self._spare_since = started
        logged = -float("inf")
        alive_prefix = self._vkey(version, rid, "alive") + "/"
        while True:
            alive, revision = self.kv.list(alive_prefix)
            ranks = {e.key.rsplit("/", 1)[-1] for e in alive}
            missing = [r for r in range(world) if f"rank_{r}" not in ranks]
            if missing:
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
            next_check = now + self.params.keep_alive_ttl
            wait_for_change(self.kv, self.root + "/", revision, next_check if spare else min(next_check, deadline))
            entry_now, state_now = self._read_state()
            if entry_now is None or entry_now.revision != entry.revision:
                break
        # The members still in the old round now will re-form: a late node lets them join first (_join). Those
        # that left it already are on their way (they do not count: a killed member's key would then hold the
        # late node for the TTL), and a member of that round does not wait at all (the dead key again).
        self._defer = None
        if version != self._previous:
            alive = self.kv.list(alive_prefix)[0]  # the last look, after the record changed
            working = sum(1 for e in alive if "finished" not in _member(e))
            self._defer = (working, time.monotonic() + self.params.keep_alive_ttl) if working else None
        return time.monotonic() - started if spare else 0.0

    # -- helpers --------------------------------------------------------------
    def _log(self, level: int, msg: str, *args: Any, version: int | None = None) -> None:
        """Log ``msg`` prefixed with ``run=RUN_ID version=V rank=R`` (``-`` where unknown).

        The same three values go into the record's ``extra`` as ``rdzv_run_id``,
        ``rdzv_version`` and ``rdzv_rank`` for structured handlers.
        """
        if not log.isEnabledFor(level):
            return
        current = self.current
        if version is None and current is not None:
            version = current.version
        rank = current.rank if current is not None and current.version == version else None
        extra = {"rdzv_run_id": self.run_id, "rdzv_version": version, "rdzv_rank": rank}
        log.log(
            level,
            "run=%s version=%s rank=%s: " + msg,
            self.run_id, "-" if version is None else version, "-" if rank is None else rank, *args,
            extra=extra,
        )

    def _destroy(self, entry: Entry, reason: str) -> None:
        try:
            self.kv.compare_and_delete(self._state_key, entry.revision)
            self._log(logging.INFO, "destroyed the round: %s", reason)
        except (CompareFailed, KeyNotFound):
            pass  # someone else changed it first

    def _read_state(self) -> tuple[Entry | None, dict[str, Any] | None]:
        """One read of ``ROOT/state/``: the round record, or a ``closed`` pseudo-state."""
        entries, _ = self.kv.list(self._state_dir)
        found = {e.key: e for e in entries}
        closed = found.get(self._closed_key)
        if closed is not None:
            return closed, {"status": CLOSED}
        entry = found.get(self._state_key)
        if entry is None:
            return None, None
        return entry, _decode_state(entry)

    def _counter(self, key: str) -> int:
        entry = self.kv.get(key)
        if entry is None:
            return 0
        try:
            return parse_counter(key, entry.value)
        except CorruptEntry as exc:
            raise RendezvousStateError(f"counter at {key!r} is corrupt: {exc}; reset the run's state", key) from None

    def _add(self, key: str) -> int:
        """``kv.add(key, 1)``, with a corrupt counter reported as :class:`RendezvousStateError`."""
        try:
            return self.kv.add(key, 1)
        except CorruptEntry as exc:
            raise RendezvousStateError(f"counter at {key!r} is corrupt: {exc}; reset the run's state", key) from None

    def _vkey(self, version: int, rid: str | None, *parts: str) -> str:
        """A key of round ``(version, rid)``: ``ROOT/v_V.RID/PARTS`` (``v_V`` for a record without id)."""
        return join_key(self.root, round_segment(version, rid), *parts)

    def _rid_of(self, version: int, round_id: str | None) -> str | None:
        """``round_id``, else the id of this node's current round if its version is ``version``."""
        if round_id is not None:
            return round_id or None
        current = self.current
        return (current.round_id or None) if current is not None and current.version == version else None

    def _watch_round(self, result: RoundResult) -> None:
        """Subscribe to the lapse watch of the round ``result`` (see :mod:`rdzv_core.roundwatch`)."""
        self._unwatch_round()
        self._watched = roundwatch.RoundKeys(
            run_id=self.run_id, alive_prefix=self._vkey(result.version, result.round_id or None, "alive") + "/",
            version=result.version, rid=result.round_id,
            world=result.world_size, state_key=self._state_key, closed_key=self._closed_key,
            final_revision=self._final_revision,
        )
        roundwatch.subscribe(self, self.kv, self._watched)

    def _unwatch_round(self) -> None:
        if self._watched is not None:
            roundwatch.unsubscribe(self, self._watched)
            self._watched = None

    def _stop_keepalive(self, delete: bool, forget: bool = True) -> None:
        if self._keepalive is not None:
            self._keepalive.stop()
            self._keepalive = None
        if delete and self._alive_key is not None:
            try:
                self.kv.delete(self._alive_key)
            except (BackendUnavailable, BackendClosed) as exc:
                self._log(logging.WARNING, "could not delete the keep-alive key (it will lapse): %s", exc)
        if forget:
            self._alive_key = None

    def _progress(self, phase: str, version: int, joined: int, deadline: float) -> None:
        if self.on_progress is not None:
            p = self.params
            self.on_progress(
                Progress(
                    phase, version, joined, p.min_nodes, p.max_nodes or p.min_nodes,
                    max(0.0, deadline - time.monotonic()),
                )
            )


def _member(entry: Entry) -> dict[str, Any]:
    """A keep-alive record as plain data; a malformed one is reported, not raised (``rdzv status`` shows it)."""
    try:
        member = json.loads(entry.value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        member = None
    if not isinstance(member, dict):
        return {"key": entry.key, "corrupt": repr(entry.value[:60])}
    return {"key": entry.key, **member}


#: A round id as written in a record (``uuid4().hex[:16]``) and read back: it becomes part of a key segment.
_ROUND_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def round_segment(version: int, rid: str | None) -> str:
    """The key segment of round ``(version, rid)``: ``v_V.RID``, or ``v_V`` for a record without id.

    The round's random id in every per-round key (and its Store's prefix) keeps a round
    from ever reading or writing another's keys -- also one of the same version, after
    the backend lost the run's keys and the version counter started again.
    """
    return f"v_{version}.{rid}" if rid else f"v_{version}"


def _round_record(status: str, version: int, rid: str | None, participants: int | None = None) -> dict[str, Any]:
    """A round record: ``status``, ``version``, the round's random ``id`` (if known), ``participants``."""
    record: dict[str, Any] = {"status": status, "version": version}
    if rid is not None:
        record["id"] = rid
    if participants is not None:
        record["participants"] = participants
    return record


def _same_round(state: dict[str, Any], version: int, rid: str | None) -> bool:
    """Whether the record ``state`` is the round ``(version, rid)`` (``rid`` ``None``: a record without id)."""
    return state.get("version") == version and state.get("id") == rid


def _encode(state: dict[str, Any]) -> bytes:
    return json.dumps(state, sort_keys=True).encode("utf-8")


def _decode_state(entry: Entry) -> dict[str, Any]:
    """Parse and check a round record; raise :class:`RendezvousStateError` naming what is wrong."""
    if len(entry.value) > MAX_STATE_BYTES:
        raise RendezvousStateError(
            f"round record at {entry.key!r} is {len(entry.value)} bytes (> {MAX_STATE_BYTES}); "
            "reset the run's state", entry.key
        )
    try:
        state = json.loads(entry.value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise RendezvousStateError(
            f"round record at {entry.key!r} is not JSON: {entry.value[:60]!r}", entry.key
        ) from None
    if not isinstance(state, dict) or state.get("status") not in _STATUSES:
        raise RendezvousStateError(f"round record at {entry.key!r} has no valid 'status': {state!r:.120}", entry.key)
    if state["status"] != SETUP:
        _int_field(state, "version", entry.key)
    rid = state.get("id")
    if rid is not None and not (isinstance(rid, str) and _ROUND_ID.fullmatch(rid)):
        raise RendezvousStateError(f"round record at {entry.key!r}: 'id' must be 1-64 letters, digits, '_' or '-' "
                                   f"(it names the round's keys), got {rid!r:.80}", entry.key)
    if state["status"] in (FROZEN, FINAL):
        _int_field(state, "participants", entry.key)
    return state


def _int_field(state: dict[str, Any], name: str, key: str, minimum: int = 1) -> int:
    value = state.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RendezvousStateError(f"round record at {key!r}: {name!r} must be an int >= {minimum}, got {value!r}", key)
    return value
