"""The in-process keyspace of ``memory://`` (:class:`MemoryBackend`); how it works: docs/backends/memory.md.

One lock per named keyspace; watches wait on gates of their own, indexed by prefix
(:mod:`rdzv_backends._waiters`), woken a few at a time by a relay (:class:`_Guard`); one waiting
watch keeps time for TTL expiry. The last :data:`HISTORY_LIMIT` events are kept.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import threading
import time
from dataclasses import dataclass, field

from rdzv_backends._waiters import Waiter, WaiterRegistry
from rdzv_backends.memory._settings import CAPABILITIES
from rdzv_core.errors import CompareFailedError, HistoryCompactedError, KeyExistsError, KeyNotFoundError
from rdzv_core.kv import Entry, Event, EventType, KVBackend, parse_counter

__all__ = ["MemoryBackend", "HISTORY_LIMIT", "WATCH_BATCH", "WAKE_TOKENS"]

#: Events kept for watchers (the count etcd v2 keeps, too).
HISTORY_LIMIT = 10_000
#: Most events one ``watch`` call returns (callers watch again for the rest).
WATCH_BATCH = 1000
#: Watches woken at once when one event concerns many; the others are woken in a relay.
WAKE_TOKENS = 4


class _Waiter(Waiter):
    """One blocked ``watch``: the event delivered to it, and its own gate.

    The thread that records a matching event (holding the keyspace lock) appends it to
    ``events``, unregisters the waiter and sets ``delivered``; the gate (a bare lock, locked
    while closed) is opened once that thread has released the keyspace lock (:class:`_Guard`).
    It is also opened to end a wait early (timekeeping, close); the watch then re-checks.
    """

    __slots__ = ("delivered", "_gate", "chain")

    def __init__(self, prefix: str, owner: MemoryBackend) -> None:
        super().__init__(prefix, owner)
        self.delivered = False
        self.chain: collections.deque[_Waiter] | None = None
        self._gate = threading.Lock()
        self._gate.acquire()

    def open(self) -> None:
        """Wake the waiting thread (no-op if the gate is open)."""
        try:
            self._gate.release()
        except RuntimeError:  # already open
            pass

    def wait(self, timeout: float) -> None:
        """Block until the gate opens (closing it again) or ``timeout`` seconds pass."""
        self._gate.acquire(timeout=max(timeout, 0.0))

    def close_gate(self) -> None:
        """Close the gate if it is open."""
        self._gate.acquire(blocking=False)


class _Guard:
    """``with keyspace.guard:`` holds the keyspace lock (not re-entrant); on exit it releases
    the lock first, then opens the gates of the waiters woken meanwhile: those handed an event
    form a relay, of which only :data:`WAKE_TOKENS` gates open here; every watch leaving with an
    event opens the next (docs/backends/memory.md, "The wake-up relay").
    """

    __slots__ = ("_ks",)

    def __init__(self, ks: "_Keyspace") -> None:
        self._ks = ks

    def __enter__(self) -> None:
        self._ks.lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        ks = self._ks
        woken, relay = ks.woken, ks.relay
        if woken:
            ks.woken = []
        if relay is not None:
            ks.relay = None
        ks.lock.release()
        for waiter in woken:
            waiter.open()
        if relay is not None:
            for _ in range(WAKE_TOKENS):
                try:
                    relay.popleft().open()
                except IndexError:  # fewer watches (or some left at their deadline and took tokens)
                    break


@dataclass
class _Keyspace:
    """One named in-process keyspace shared by every backend opened on it.

    ``lock`` guards everything; the methods below run with it held, taken through
    ``with guard:`` (which opens the gates queued in ``woken`` after releasing it).
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    data: dict[str, tuple[bytes, int, float | None]] = field(default_factory=dict)  # value, revision, expiry
    keys: list[str] = field(default_factory=list)  # the keys of ``data``, sorted (``list`` bisects it)
    revision: int = 0
    history: list[Event] = field(default_factory=list)
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap of (expires_at, key), stale ones too
    waiters: WaiterRegistry[_Waiter] = field(default_factory=WaiterRegistry)  # blocked watches
    timekeeper: _Waiter | None = None  # the waiter that sleeps until the next expiry
    woken: list[_Waiter] = field(default_factory=list)  # gates to open once the lock is released
    relay: collections.deque[_Waiter] | None = None  # watches handed an event under the lock now held
    guard: _Guard = field(init=False)

    def __post_init__(self) -> None:
        self.guard = _Guard(self)

    def next_revision(self) -> int:
        self.revision += 1
        return self.revision

    def record(self, event: Event) -> None:
        """Append ``event`` to the history and deliver it to the waiters whose prefix selects it."""
        self.history.append(event)
        if len(self.history) > HISTORY_LIMIT:
            del self.history[: len(self.history) - HISTORY_LIMIT]
        if not self.waiters:
            return
        for waiter in self.waiters.pop_matching(event.key):
            if self.relay is None:
                self.relay = collections.deque()
            waiter.events.append(event)
            waiter.chain = self.relay  # before ``delivered``: a watch that sees that passes a token on
            waiter.delivered = True
            self.relay.append(waiter)
            if waiter is self.timekeeper:
                self._hand_off_timekeeping()

    def next_expiry(self) -> float | None:
        """The earliest live expiry (``time.monotonic`` seconds); drops stale heap entries."""
        heap = self.expiries
        while heap:
            expires, key = heap[0]
            item = self.data.get(key)
            if item is not None and item[2] == expires:
                return expires
            heapq.heappop(heap)  # deleted, rewritten or refreshed since
        return None

    def expire(self) -> None:
        """Delete every key whose expiry has passed, each with a ``DELETE`` event."""
        now = time.monotonic()
        while (expires := self.next_expiry()) is not None and expires <= now:
            _, key = heapq.heappop(self.expiries)
            self.drop(key)
            self.record(Event(EventType.DELETE, key, self.next_revision()))

    def live(self, key: str) -> tuple[bytes, int, float | None] | None:
        self.expire()
        return self.data.get(key)

    def schedule(self, key: str, expires: float) -> None:
        """Remember ``key``'s expiry; wake the timekeeper if it is now the earliest."""
        heapq.heappush(self.expiries, (expires, key))
        if self.timekeeper is not None and self.expiries[0] == (expires, key):
            self.woken.append(self.timekeeper)

    def write(self, key: str, value: bytes, ttl: float | None) -> Entry:
        rev = self.next_revision()
        expires = None if ttl is None else time.monotonic() + ttl
        if key not in self.data:
            bisect.insort(self.keys, key)
        self.data[key] = (value, rev, expires)
        if expires is not None:
            self.schedule(key, expires)
        self.record(Event(EventType.PUT, key, rev, value))
        return Entry(key, value, rev)

    def remove(self, key: str) -> None:
        self.drop(key)
        self.record(Event(EventType.DELETE, key, self.next_revision()))

    def drop(self, key: str) -> None:
        """Delete ``key`` from ``data`` and the key index (no event)."""
        del self.data[key]
        del self.keys[bisect.bisect_left(self.keys, key)]

    def entries(self, prefix: str) -> list[Entry]:
        """The entries whose key starts with ``prefix``, sorted by key (O(log n + found))."""
        keys = self.keys
        lo = bisect.bisect_left(keys, prefix) if prefix else 0
        hi = bisect.bisect_left(keys, prefix[:-1] + chr(ord(prefix[-1]) + 1)) if prefix else len(keys)
        data = self.data
        return [Entry(k, data[k][0], data[k][1]) for k in keys[lo:hi]]

    def check_revision(self, key: str, expected: int) -> tuple[bytes, int, float | None]:
        item = self.live(key)
        if item is None:
            raise KeyNotFoundError(f"key {key!r} not found", key)
        if item[1] != expected:
            raise CompareFailedError(
                f"key {key!r} is at revision {item[1]}, not {expected}", key, expected, item[1]
            )
        return item

    def add_waiter(self, waiter: _Waiter) -> None:
        self.waiters.add(waiter)
        if self.timekeeper is None:
            self.timekeeper = waiter

    def remove_waiter(self, waiter: _Waiter) -> None:
        """Unregister ``waiter`` (if still registered); hand its timekeeping on."""
        self.waiters.discard(waiter)
        if self.timekeeper is waiter:
            self._hand_off_timekeeping()

    def _hand_off_timekeeping(self) -> None:
        """The timekeeper leaves: make another waiter the timekeeper and wake it to time its sleep."""
        self.timekeeper = self.waiters.first()
        if self.timekeeper is not None:
            self.woken.append(self.timekeeper)

    def wake_owner(self, owner: "MemoryBackend") -> None:
        """Wake the waiters of ``owner`` (it is being closed)."""
        self.woken.extend(self.waiters.of_owner(owner))


_KEYSPACES: dict[str, _Keyspace] = {}
_KEYSPACES_LOCK = threading.Lock()


class MemoryBackend(KVBackend):
    """In-process backend (docs/backends/memory.md).

    Args:
        name: the keyspace name; backends with the same name share data (str).
    """

    capabilities = CAPABILITIES

    def __init__(self, name: str = "default") -> None:
        with _KEYSPACES_LOCK:
            self._ks = _KEYSPACES.setdefault(name, _Keyspace())
        self.name = name

    def __repr__(self) -> str:
        return f"MemoryBackend(name={self.name!r})"

    def _do_get(self, key: str) -> Entry | None:
        # Lock-free when the answer needs no expiry: one dict lookup is atomic, and
        # writers replace a key's tuple in one assignment, so this sees a state that
        # existed (the write took effect at that assignment).
        item = self._ks.data.get(key)
        if item is not None and item[2] is not None and item[2] <= time.monotonic():
            with self._ks.guard:
                item = self._ks.live(key)
        return None if item is None else Entry(key, item[0], item[1])

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        with self._ks.guard:
            self._ks.expire()
            return self._ks.entries(prefix), self._ks.revision

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        with self._ks.guard:
            if self._ks.live(key) is not None:
                raise KeyExistsError(f"key {key!r} exists", key)
            return self._ks.write(key, value, ttl)

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        with self._ks.guard:
            self._ks.expire()
            return self._ks.write(key, value, ttl)

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        with self._ks.guard:
            self._ks.check_revision(key, expected_revision)
            return self._ks.write(key, value, ttl)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        with self._ks.guard:
            self._ks.check_revision(key, expected_revision)
            self._ks.remove(key)

    def _do_delete(self, key: str) -> bool:
        with self._ks.guard:
            if self._ks.live(key) is None:
                return False
            self._ks.remove(key)
            return True

    def _do_refresh(self, key: str, ttl: float) -> None:
        with self._ks.guard:
            item = self._ks.live(key)
            if item is None:
                raise KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)
            expires = time.monotonic() + ttl
            self._ks.data[key] = (item[0], item[1], expires)
            self._ks.schedule(key, expires)

    def _do_ttl_remaining(self, key: str) -> float | None:
        with self._ks.guard:
            item = self._ks.live(key)
        if item is None:
            raise KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)
        return None if item[2] is None else max(0.0, item[2] - time.monotonic())

    def _do_add(self, key: str, delta: int) -> int:
        with self._ks.guard:
            item = self._ks.live(key)
            total = (0 if item is None else parse_counter(key, item[0])) + delta
            self._ks.write(key, str(total).encode("ascii"), None if item is None else _remaining(item[2]))
            return total

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        ks = self._ks
        with ks.guard:
            ks.expire()
            if ks.history and after_revision < ks.history[0].revision - 1:
                raise HistoryCompactedError(
                    f"events after revision {after_revision} were compacted "
                    f"(oldest kept: {ks.history[0].revision})",
                    prefix,
                )
            events = [e for e in _after(ks.history, after_revision) if e.key.startswith(prefix)]
            if events or timeout <= 0 or self._closed:
                return events[:WATCH_BATCH]
            # Nothing yet: every later event is newer than after_revision and is delivered to us.
            waiter = _Waiter(prefix, self)
            ks.add_waiter(waiter)
            wake_at = self._wake_at(waiter, deadline)
        try:
            while True:
                waiter.wait(wake_at - time.monotonic())
                if waiter.delivered:  # the fast path: no keyspace lock
                    return waiter.events
                with ks.guard:
                    waiter.close_gate()
                    if ks.timekeeper is waiter:
                        ks.expire()  # may deliver to this waiter, too
                    if waiter.delivered:
                        return waiter.events
                    if time.monotonic() >= deadline or self._closed:
                        return []
                    wake_at = self._wake_at(waiter, deadline)
        finally:
            if not waiter.delivered:
                with ks.guard:
                    ks.remove_waiter(waiter)
            elif waiter.chain:  # pass the wake-up token on
                try:
                    waiter.chain.popleft().open()
                except IndexError:  # the relay is done
                    pass

    def _wake_at(self, waiter: _Waiter, deadline: float) -> float:
        """When ``waiter`` must wake on its own: its deadline, or the next expiry if it keeps time."""
        if self._ks.timekeeper is waiter:
            next_expiry = self._ks.next_expiry()
            if next_expiry is not None:
                return min(deadline, next_expiry)
        return deadline

    def _do_close(self) -> None:
        with self._ks.guard:
            self._ks.wake_owner(self)


def _after(history: list[Event], revision: int) -> list[Event]:
    """Events of ``history`` (sorted by revision) with revision > ``revision``."""
    lo, hi = 0, len(history)
    while lo < hi:
        mid = (lo + hi) // 2
        if history[mid].revision <= revision:
            lo = mid + 1
        else:
            hi = mid
    return history[lo:]


def _remaining(expires: float | None) -> float | None:
    if expires is None:
        return None
    return max(expires - time.monotonic(), 1e-3)
