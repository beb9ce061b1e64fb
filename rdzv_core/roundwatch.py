"""Lapse detection for final rounds: one watch per round and process, shared by its members there.

While a round is final every member subscribes (:func:`subscribe`). The first
subscriber of a round in this process starts a daemon thread that watches the
round's keep-alive prefix (``ROOT/v_V.ID/alive/``) through a subscriber's backend
client; later subscribers of the same round -- the same ``(keep-alive prefix, version,
round id)``; the round id is random per round, so equal ids mean one keyspace -- share
it, so a process with 512 member threads has one watch, not 512. On a ``DELETE``
event (a key deleted, or expired: the protocol reports expiry as a delete) the
thread lists the prefix again; if a rank in ``0 .. world-1`` has no key and the
run is not closed, it destroys the round (compare-and-delete of the final record
at the revision it had when the round became final) and stops. The members'
``num_nodes_waiting()`` then answer >= 1 and their agents re-rendezvous, as they do
when a waiting node destroys a round after a lapse (the seed's
``handle_existing_rendezvous``) -- but within about ``keep_alive_ttl`` of the loss,
without any waiting node, and whether the lost node's sockets were closed (kill)
or not (a frozen host).

A member that finished (:meth:`Rendezvous.leave` with ``finished``) leaves its key
in place without TTL, so it is never missing. If the client in use is closed (its
member left), the watch goes on with another subscriber's client; it ends when
the last subscriber unsubscribes. Backend errors are retried with a jittered
backoff and logged once per outage; the watch re-lists after every error.

See ``docs/design.md`` (membership rules) for why members, not only waiting
nodes, destroy a round whose member lapsed.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from dataclasses import dataclass

from .errors import BackendClosed, BackendUnavailable, CompareFailed, HistoryCompacted, KeyNotFound, RdzvError
from .kv import EventType, KVBackend
from .outage import OutageLog

__all__ = ["RoundKeys", "subscribe", "unsubscribe", "watched_rounds", "THREAD_PREFIX"]

log = logging.getLogger(__name__)

#: Thread-name prefix of the watch threads: they count as keep-alive traffic in the benchmarks
#: (``benchmarks.counting``), which they are.
THREAD_PREFIX = "rdzv-keepalive-roundwatch"
#: Seconds one watch call waits at most before the thread checks whether it should stop.
WATCH_SLICE = 5.0


@dataclass(frozen=True)
class RoundKeys:
    """What identifies a final round and what destroying it takes.

    Attributes:
        run_id: the run id (for logs).
        alive_prefix: the prefix of the round's keep-alive keys ``rank_R`` (ends in ``/``).
        version: the round version (int).
        rid: the round's random id (``""`` for a record without one).
        world: number of members (int >= 1): ranks ``0 .. world-1`` each have a key.
        state_key: the round record's key; closed_key: the run's closed mark.
        final_revision: the revision of the final record (the compare-and-delete's expected revision).
    """

    run_id: str
    alive_prefix: str
    version: int
    rid: str
    world: int
    state_key: str
    closed_key: str
    final_revision: int

    @property
    def ident(self) -> tuple[str, int, str]:
        return (self.alive_prefix, self.version, self.rid)


class _RoundWatch:
    """One round's watch thread and its subscribers (member id -> backend client)."""

    def __init__(self, keys: RoundKeys) -> None:
        self.keys = keys
        self.subscribers: dict[object, KVBackend] = {}
        self.dead: list[KVBackend] = []  # clients found closed
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"{THREAD_PREFIX}-{keys.run_id}-v{keys.version}")

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
                events = kv.watch(self.keys.alive_prefix, revision, WATCH_SLICE)
                outage.recovered("round watch of run %s version %d works again", self.keys.run_id,
                                 self.keys.version)
                delay = 0.05
                if events:
                    revision = max(revision, max(e.revision for e in events))
                    if any(e.type is EventType.DELETE for e in events):
                        revision = None  # a key went away: look again
            except HistoryCompacted:
                revision = None
            except BackendClosed:
                with self.lock:
                    self.dead.append(kv)  # that subscriber's client is gone: go on with another one's
                revision = None
            except BackendUnavailable as exc:
                outage.failed("round watch of run %s version %d: backend unavailable, retrying: %s",
                              self.keys.run_id, self.keys.version, exc)
                revision = None
                self.stopped.wait(random.uniform(0.5, 1.0) * delay)
                delay = min(2 * delay, 1.0)
            except RdzvError as exc:  # corrupt data or a bug below: say so, keep watching (bounded rate)
                log.warning("round watch of run %s version %d failed: %s: %s", self.keys.run_id,
                            self.keys.version, type(exc).__name__, exc)
                revision = None
                self.stopped.wait(1.0)

    def _check(self, kv: KVBackend) -> int | None:
        """List the keep-alive keys; destroy the round if a rank has none. The revision to watch from,
        or ``None`` when the watch should end (round destroyed, record changed, run closed)."""
        k = self.keys
        entries, revision = kv.list(k.alive_prefix)
        present = {e.key[len(k.alive_prefix):] for e in entries}
        missing = [r for r in range(k.world) if f"rank_{r}" not in present]
        if not missing:
            return revision
        if kv.get(k.closed_key) is not None:
            return None  # the job ended: members leave, nothing to re-form
        if self.stopped.is_set():
            # The last subscriber left; its member deletes its key after unsubscribing, so a key seen
            # missing now may be that member's own: not a lapse for this watch to act on.
            return None
        try:
            kv.compare_and_delete(k.state_key, k.final_revision)
            log.info("run=%s version=%d: destroyed the round: keep-alive of rank(s) %s lapsed or was deleted",
                     k.run_id, k.version, missing)
        except (CompareFailed, KeyNotFound):
            pass  # destroyed (or replaced) by someone else first
        return None


_lock = threading.Lock()
_watches: dict[tuple[str, int, str], _RoundWatch] = {}


def subscribe(member: object, kv: KVBackend, keys: RoundKeys) -> None:
    """Add ``member`` (any hashable id) with its client ``kv`` to the watch of round ``keys``;
    the first subscriber of a round in this process starts the watch."""
    with _lock:
        watch = _watches.get(keys.ident)
        if watch is None:
            watch = _watches[keys.ident] = _RoundWatch(keys)
            start = True
        else:
            start = False
        with watch.lock:
            watch.subscribers[member] = kv
    if start:
        watch.thread.start()


def unsubscribe(member: object, keys: RoundKeys) -> None:
    """Remove ``member`` from the watch of round ``keys``; the last one out stops it (does not wait)."""
    with _lock:
        watch = _watches.get(keys.ident)
        if watch is None:
            return
        with watch.lock:
            watch.subscribers.pop(member, None)
            empty = not watch.subscribers
        if empty:
            del _watches[keys.ident]
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
