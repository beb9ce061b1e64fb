"""Lapse detection for final rounds: one watch per round and process, shared by its members there.

Every member of a final round subscribes (:func:`subscribe`); the first subscriber of a round in
this process starts a daemon thread that watches the round's keep-alive keys
(``ROOT/v_V.ID/alive/``) through a subscriber's client. On a ``DELETE`` event (a delete or an
expiry) it lists them; if a rank in ``0 .. world-1`` has no key and the run is not closed, it
destroys the round (compare-and-delete of the final record) and ends -- once the backend has
answered this process without a break for a whole ``keep_alive_ttl`` (the subscribers'
keep-alives tell since when), and at the latest ``3 x keep_alive_ttl`` after a prompt look first
showed the key missing: a key that vanished while the backend was away from everybody is written
again by its live member within that time, and the round stands. It goes on with another
subscriber's client if one is closed, retries backend errors with a jittered backoff (one WARNING
per outage) and ends when the last subscriber unsubscribes. Why members watch their own round, and
why they wait out an outage: ``docs/design.md`` ("Membership rules", "The backend away").
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..backoff import Backoff
from ..forksafe import PerProcess
from ..errors import (
    BackendClosedError,
    BackendUnavailableError,
    HistoryCompactedError,
    RdzvError,
)
from ..kv import KVBackend
from ..outage import OutageLog, Responsiveness, judged_at
from .record import RoundRecord, RunKeys, Status, missing_ranks
from .state_io import delete_round_record, round_ended

__all__ = ["WatchedRound", "destroy", "subscribe", "unsubscribe", "watched_rounds", "THREAD_PREFIX"]

log = logging.getLogger(__name__)

#: Thread-name prefix of the watch threads: they count as keep-alive traffic in the benchmarks
#: (``benchmarks.counting``), which they are.
THREAD_PREFIX = "rdzv-keepalive-roundwatch"
#: Seconds one watch call waits at most before the thread checks whether it should stop.
WATCH_SLICE = 5.0
#: Seconds between two looks at the round while a missing key awaits judgement (has the round ended?).
ROUND_END_POLL = 0.2


#: A subscriber's evidence: ``time.monotonic()`` since which its client saw the backend answer without a break.
Since = Callable[[], float]
#: A subscriber's callback when the watch ends after judging a missing key and the round is over.
OnEnd = Callable[["WatchedRound"], object]


@dataclass(frozen=True)
class WatchedRound:
    """A final round to watch: its run's keys, version, random id (``""`` for a record without one),
    ``world`` (ranks ``0 .. world-1`` each have a key), ``ttl`` (the keep-alive TTL, seconds: how long the
    backend must have answered without a break before a missing key counts as lost) and ``ranks`` (the
    final record's rank policy, ``None`` for join order)."""

    keys: RunKeys
    version: int
    rid: str
    world: int
    ttl: float
    ranks: str | None = None

    @property
    def record(self) -> RoundRecord:
        """The round's final record, as written when it became final."""
        return RoundRecord(Status.FINAL, self.version, self.rid or None, participants=self.world, ranks=self.ranks)

    @property
    def run_id(self) -> str:
        return self.keys.run_id

    @property
    def alive_prefix(self) -> str:
        """The prefix of the round's keep-alive keys (ends in ``/``)."""
        return self.keys.alive_dir(self.version, self.rid or None)

    @property
    def ident(self) -> tuple[str, int, str]:
        """``(keep-alive prefix, version, round id)``: the round ids are random, so equal idents are one round."""
        return (self.alive_prefix, self.version, self.rid)


class _RoundWatch:
    """One round's watch thread and its subscribers (member id -> backend client, evidence)."""

    def __init__(self, watched: WatchedRound) -> None:
        self.watched = watched
        self.subscribers: dict[object, tuple[KVBackend, Since | None, OnEnd | None]] = {}
        # This watch's own calls: failed, or a listing slower than TTL/3 (no evidence the backend was there).
        self.answers = Responsiveness(slow=watched.ttl / 3, max_gap=float("inf"))
        self.judge_at: float | None = None  # a rank is missing: look again then (monotonic)
        self.judged = False  # a missing key was judged lost (the round destroyed here or by someone else)
        self.over = False  # the judgement showed the round over with the run going on (no need to look again)
        self.missing_since: float | None = None  # when a prompt listing first showed a rank missing (monotonic)
        self.dead: list[KVBackend] = []  # clients found closed
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"{THREAD_PREFIX}-{watched.run_id}-v{watched.version}")

    # -- on the watch thread ------------------------------------------------------------------
    def _client(self) -> KVBackend | None:
        with self.lock:
            for kv, _, _ in self.subscribers.values():
                if not any(kv is d for d in self.dead):
                    return kv
        return None

    def _answering_since(self) -> float:
        """Since when (monotonic) the backend answered this process without a break: the subscribers' best
        evidence, unless this watch itself failed later. A subscriber without evidence vouches always."""
        with self.lock:
            evidence = [since() if since is not None else -float("inf") for _, since, _ in self.subscribers.values()]
        return max(self.answers.last_break, min(evidence, default=-float("inf")))

    def _run(self) -> None:
        outage = OutageLog(log.log)
        revision: int | None = None  # None: (re-)list before watching
        backoff = Backoff(base=0.05, cap=1.0)  # between retries of backend errors
        while not self.stopped.is_set():
            kv = self._client()
            if kv is None:
                return  # every subscriber's client is closed: nobody left to protect
            try:
                if revision is None:
                    revision = self._check(kv)
                    if revision is None:
                        self._ended()
                        return  # the round is gone (destroyed here, or already) or the run closed
                # While a missing key awaits judgement, look again every ROUND_END_POLL s: another node may
                # have ended the round meanwhile (its record is not under the watched prefix).
                wait = WATCH_SLICE if self.judge_at is None else max(0.0, min(
                    ROUND_END_POLL, self.judge_at - time.monotonic()))
                events = kv.watch(self.watched.alive_prefix, revision, wait)
                outage.recovered("round watch of run %s version %d works again", self.watched.run_id,
                                 self.watched.version)
                backoff.reset()
                if events:
                    revision = None  # a key went away, was marked re-joining, or came back: look again
                elif self.judge_at is not None:
                    revision = None  # a rank was missing: judge it now, or see whether the round ended
            except HistoryCompactedError:
                revision = None
            except BackendClosedError:
                with self.lock:
                    self.dead.append(kv)  # that subscriber's client is gone: go on with another one's
                revision = None
            except BackendUnavailableError as exc:
                self.answers.broken()
                outage.failed("round watch of run %s version %d: backend unavailable, retrying: %s",
                              self.watched.run_id, self.watched.version, exc)
                revision = None
                self.stopped.wait(backoff.delay())
            except RdzvError as exc:  # corrupt data or a bug below: say so, keep watching (bounded rate)
                log.warning("round watch of run %s version %d failed: %s: %s", self.watched.run_id,
                            self.watched.version, type(exc).__name__, exc)
                revision = None
                self.stopped.wait(1.0)

    def _ended(self) -> None:
        """The watch ended after judging a missing key: if the round is over and the run goes on (known from
        the judgement, else :func:`~.rendezvous.state_io.round_ended`: one look for every subscriber), tell
        the subscribers (``on_end``); a backend error is logged and tells nobody, what a callback raises is
        logged."""
        kv = self._client()
        if not self.judged or self.stopped.is_set() or kv is None:
            return
        try:
            if not self.over and not round_ended(kv, self.watched.keys, self.watched.version,
                                                 self.watched.rid or None):
                return
        except RdzvError as exc:  # unreachable, closed, or a corrupt record: the agents re-join without the mark
            log.warning("round watch of run %s version %d: could not tell whether the round ended: %s",
                        self.watched.run_id, self.watched.version, exc)
            return
        with self.lock:
            callbacks = [on_end for _, _, on_end in self.subscribers.values() if on_end is not None]
        for on_end in callbacks:
            try:
                on_end(self.watched)
            except Exception:  # a subscriber's bug must not hide the others' notice; logged with its traceback
                log.exception("round watch of run %s version %d: a subscriber's end callback failed",
                              self.watched.run_id, self.watched.version)

    def _check(self, kv: KVBackend) -> int | None:
        """List the keep-alive keys; destroy the round if a rank has none and the backend answered this
        process without a break for ``ttl`` seconds (else look again when it has). The revision to watch
        from, or ``None`` when the watch should end (round destroyed, record changed, run closed)."""
        k = self.watched
        started = time.monotonic()
        entries, revision = kv.list(k.alive_prefix)
        now = time.monotonic()
        self.answers.record(started, now, ok=True)
        missing = missing_ranks(entries, k.world)
        if not missing:
            self.judge_at = self.missing_since = None
            return revision
        if self.stopped.is_set():
            # The last subscriber left; its member deletes its key after unsubscribing, so a key seen
            # missing now may be that member's own: not a lapse for this watch to act on.
            return None
        if self.missing_since is None:
            self.missing_since = now
        # The backend was away: a live member writes its key again meanwhile. Judged once the backend answered
        # for a TTL, and at the latest 3 TTL after a prompt look first showed the key missing (a loaded host
        # whose calls keep stalling must not put the judgement off for ever).
        judge_at = judged_at(self._answering_since(), self.missing_since, k.ttl)
        if now < judge_at and round_ended(kv, k.keys, k.version, k.rid or None):
            self.judged = self.over = True  # another node destroyed it already: nothing to judge
            return None
        if now < judge_at:
            if self.judge_at is None:
                log.info("run=%s version=%d: keep-alive of rank(s) %s missing after the backend was away; "
                         "judged in %.1f s unless written again", k.run_id, k.version, missing, judge_at - now)
            self.judge_at = judge_at
            return revision
        self.judged = True
        self.over = destroy(kv, k, f"keep-alive of rank(s) {missing} lapsed or was deleted (the backend answered for "
                       f"{now - self._answering_since():.1f} s, missing for {now - self.missing_since:.1f} s)")
        return None


def destroy(kv: KVBackend, watched: WatchedRound, reason: str) -> bool:
    """Destroy the final round ``watched`` (compare-and-delete of its record at the revision read) unless
    the run is closed (the job ended: nothing to re-form); ``reason`` is logged. Whether this call destroyed it
    (``False``: closed, or destroyed or replaced by someone else first).

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
        RendezvousStateError: the round record is corrupt.
    """
    if kv.get(watched.keys.closed) is not None:
        return False
    entry = kv.get(watched.keys.round_record)
    if entry is None:
        return False
    record = RoundRecord.decode(entry)
    if record.status is not Status.FINAL or not record.is_round(watched.version, watched.rid or None) or \
            not delete_round_record(kv, watched.keys, entry.revision):
        return False
    log.info("run=%s version=%d: destroyed the round: %s", watched.run_id, watched.version, reason)
    return True


class _Watches:
    """This process's round watches by :attr:`WatchedRound.ident`, and the lock that guards them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_round: dict[tuple[str, int, str], _RoundWatch] = {}


#: Made on first use; a forked child starts with none (the parent's watch threads are gone).
_WATCHES: PerProcess[_Watches] = PerProcess(_Watches)


def subscribe(member: object, kv: KVBackend, watched: WatchedRound, since: Since | None = None,
              on_end: OnEnd | None = None) -> None:
    """Add ``member`` (any hashable id) with its client ``kv`` to the watch of round ``watched``;
    the first subscriber of a round in this process starts the watch. ``since``: the member's evidence
    (``time.monotonic()`` since which its client saw the backend answer without a break, e.g. its
    keep-alive's :attr:`~rdzv_core.rendezvous.keepalive.KeepAlive.responsiveness`); without it, a missing key
    is acted on at once. ``on_end(watched)``: called on the watch's thread when the watch ends after
    judging a missing key and the round is over while the run goes on (destroyed here or by another node)."""
    watches = _WATCHES.get()
    with watches.lock:
        watch = watches.by_round.get(watched.ident)
        if watch is None:
            watch = watches.by_round[watched.ident] = _RoundWatch(watched)
            start = True
        else:
            start = False
        with watch.lock:
            watch.subscribers[member] = (kv, since, on_end)
    if start:
        watch.thread.start()


def unsubscribe(member: object, watched: WatchedRound) -> None:
    """Remove ``member`` from the watch of round ``watched``; the last one out stops it (does not wait)."""
    watches = _WATCHES.get()
    with watches.lock:
        watch = watches.by_round.get(watched.ident)
        if watch is None:
            return
        with watch.lock:
            watch.subscribers.pop(member, None)
            empty = not watch.subscribers
        if empty:
            del watches.by_round[watched.ident]
            watch.stopped.set()


def watched_rounds() -> dict[tuple[str, int, str], int]:
    """``(keep-alive prefix, version, round id)`` -> subscribers of every round watched in this process."""
    watches = _WATCHES.get()
    with watches.lock:
        return {ident: len(w.subscribers) for ident, w in watches.by_round.items()}


