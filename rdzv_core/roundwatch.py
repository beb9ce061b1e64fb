"""Lapse detection for final rounds: one watch per round and process, shared by its members there.

Every member of a final round subscribes (:func:`subscribe`); the first subscriber of a round in
this process starts a daemon thread that watches the round's keep-alive keys
(``ROOT/v_V.ID/alive/``) through a subscriber's client. On a ``DELETE`` event (a delete or an
expiry) it lists them; if a rank in ``0 .. world-1`` has no key and the run is not closed, it
destroys the round (compare-and-delete of the final record at its final revision) and ends. It
goes on with another subscriber's client if one is closed, retries backend errors with a jittered
backoff (one WARNING per outage) and ends when the last subscriber unsubscribes. Why members watch
their own round: ``docs/design.md`` ("Membership rules").
"""

from __future__ import annotations

import logging
import os
import random
import threading
from dataclasses import dataclass

from .errors import (
    BackendClosedError,
    BackendUnavailableError,
    HistoryCompactedError,
    RdzvError,
)
from .kv import EventType, KVBackend
from .outage import OutageLog
from .rendezvous.record import RunKeys, missing_ranks
from .rendezvous.state_io import delete_round_record

__all__ = ["WatchedRound", "destroy", "subscribe", "unsubscribe", "watched_rounds", "THREAD_PREFIX"]

log = logging.getLogger(__name__)

#: Thread-name prefix of the watch threads: they count as keep-alive traffic in the benchmarks
#: (``benchmarks.counting``), which they are.
THREAD_PREFIX = "rdzv-keepalive-roundwatch"
#: Seconds one watch call waits at most before the thread checks whether it should stop.
WATCH_SLICE = 5.0


@dataclass(frozen=True)
class WatchedRound:
    """A final round to watch: its run's keys, version, random id (``""`` for a record without one),
    ``world`` (ranks ``0 .. world-1`` each have a key) and ``final_revision`` (the revision of the final
    record: the compare-and-delete's expected revision)."""

    keys: RunKeys
    version: int
    rid: str
    world: int
    final_revision: int

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
    """One round's watch thread and its subscribers (member id -> backend client)."""

    def __init__(self, watched: WatchedRound) -> None:
        self.watched = watched
        self.subscribers: dict[object, KVBackend] = {}
        self.dead: list[KVBackend] = []  # clients found closed
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"{THREAD_PREFIX}-{watched.run_id}-v{watched.version}")

    # -- on the watch thread ------------------------------------------------------------------
    def _client(self) -> KVBackend | None:
        with self.lock:
            for kv in self.subscribers.values():
                if not any(kv is d for d in self.dead):
                    return kv
        return None

    def _run(self) -> None:
        outage = OutageLog(log.log)
        revision: int | None = None  # None: (re-)list before watching
        delay = 0.05
        while not self.stopped.is_set():
            kv = self._client()
            if kv is None:
                return  # every subscriber's client is closed: nobody left to protect
            try:
                if revision is None:
                    revision = self._check(kv)
                    if revision is None:
                        return  # the round is gone (destroyed here, or already) or the run closed
                events = kv.watch(self.watched.alive_prefix, revision, WATCH_SLICE)
                outage.recovered("round watch of run %s version %d works again", self.watched.run_id,
                                 self.watched.version)
                delay = 0.05
                if events:
                    revision = max(revision, max(e.revision for e in events))
                    if any(e.type is EventType.DELETE for e in events):
                        revision = None  # a key went away: look again
            except HistoryCompactedError:
                revision = None
            except BackendClosedError:
                with self.lock:
                    self.dead.append(kv)  # that subscriber's client is gone: go on with another one's
                revision = None
            except BackendUnavailableError as exc:
                outage.failed("round watch of run %s version %d: backend unavailable, retrying: %s",
                              self.watched.run_id, self.watched.version, exc)
                revision = None
                self.stopped.wait(random.uniform(0.5, 1.0) * delay)
                delay = min(2 * delay, 1.0)
            except RdzvError as exc:  # corrupt data or a bug below: say so, keep watching (bounded rate)
                log.warning("round watch of run %s version %d failed: %s: %s", self.watched.run_id,
                            self.watched.version, type(exc).__name__, exc)
                revision = None
                self.stopped.wait(1.0)

    def _check(self, kv: KVBackend) -> int | None:
        """List the keep-alive keys; destroy the round if a rank has none. The revision to watch from,
        or ``None`` when the watch should end (round destroyed, record changed, run closed)."""
        k = self.watched
        entries, revision = kv.list(k.alive_prefix)
        missing = missing_ranks(entries, k.world)
        if not missing:
            return revision
        if self.stopped.is_set():
            # The last subscriber left; its member deletes its key after unsubscribing, so a key seen
            # missing now may be that member's own: not a lapse for this watch to act on.
            return None
        destroy(kv, k, f"keep-alive of rank(s) {missing} lapsed or was deleted")
        return None


def destroy(kv: KVBackend, watched: WatchedRound, reason: str) -> bool:
    """Destroy the final round ``watched`` (compare-and-delete of its record at its final revision) unless
    the run is closed (the job ended: nothing to re-form); ``reason`` is logged. Whether this call destroyed it
    (``False``: closed, or destroyed or replaced by someone else first).

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
    """
    if kv.get(watched.keys.closed) is not None or not delete_round_record(kv, watched.keys, watched.final_revision):
        return False
    log.info("run=%s version=%d: destroyed the round: %s", watched.run_id, watched.version, reason)
    return True


_lock = threading.Lock()
_watches: dict[tuple[str, int, str], _RoundWatch] = {}


def subscribe(member: object, kv: KVBackend, watched: WatchedRound) -> None:
    """Add ``member`` (any hashable id) with its client ``kv`` to the watch of round ``watched``;
    the first subscriber of a round in this process starts the watch."""
    with _lock:
        watch = _watches.get(watched.ident)
        if watch is None:
            watch = _watches[watched.ident] = _RoundWatch(watched)
            start = True
        else:
            start = False
        with watch.lock:
            watch.subscribers[member] = kv
    if start:
        watch.thread.start()


def unsubscribe(member: object, watched: WatchedRound) -> None:
    """Remove ``member`` from the watch of round ``watched``; the last one out stops it (does not wait)."""
    with _lock:
        watch = _watches.get(watched.ident)
        if watch is None:
            return
        with watch.lock:
            watch.subscribers.pop(member, None)
            empty = not watch.subscribers
        if empty:
            del _watches[watched.ident]
            watch.stopped.set()


def watched_rounds() -> dict[tuple[str, int, str], int]:
    """``(keep-alive prefix, version, round id)`` -> subscribers of every round watched in this process."""
    with _lock:
        return {ident: len(w.subscribers) for ident, w in _watches.items()}


def _reset_after_fork() -> None:
    # The parent's watch threads did not survive fork(), and the lock may have been held.
    global _lock, _watches
    _lock = threading.Lock()
    _watches = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
