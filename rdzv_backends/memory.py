"""``memory://[NAME]/RUN_ID`` — an in-process, thread-safe backend.

For tests and large simulations (thousands of agents as threads in one
process). Every :class:`MemoryBackend` opened with the same ``NAME`` (default
``default``) in one process shares one keyspace. TTLs use ``time.monotonic``;
watches are woken by a condition variable, and by the next expiry time, so an
expired key produces its ``DELETE`` event when it expires, not when next read.

The event history keeps the last :data:`HISTORY_LIMIT` events; a watch from an
older revision raises :class:`~rdzv_core.errors.HistoryCompacted`.
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass, field

from rdzv_core.errors import CompareFailed, HistoryCompacted, InvalidURLError, KeyExists, KeyNotFound
from rdzv_core.kv import Capabilities, Entry, Event, EventType, KVBackend, parse_counter
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL

__all__ = ["MemoryBackend", "HISTORY_LIMIT", "plugin"]

#: Events kept for watchers (the count etcd v2 keeps, too).
HISTORY_LIMIT = 10_000


@dataclass
class _Keyspace:
    """One named in-process keyspace shared by every backend opened on it."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    data: dict[str, tuple[bytes, int, float | None]] = field(default_factory=dict)  # value, revision, expiry
    revision: int = 0
    history: list[Event] = field(default_factory=list)
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap of (expires_at, key)

    # All methods below run with ``cond`` held.
    def next_revision(self) -> int:
        self.revision += 1
        return self.revision

    def record(self, event: Event) -> None:
        self.history.append(event)
        if len(self.history) > HISTORY_LIMIT:
            del self.history[: len(self.history) - HISTORY_LIMIT]
        self.cond.notify_all()

    def expire(self) -> None:
        now = time.monotonic()
        while self.expiries and self.expiries[0][0] <= now:
            _, key = heapq.heappop(self.expiries)
            item = self.data.get(key)
            if item is not None and item[2] is not None and item[2] <= now:
                del self.data[key]
                self.record(Event(EventType.DELETE, key, self.next_revision()))

    def live(self, key: str) -> tuple[bytes, int, float | None] | None:
        self.expire()
        return self.data.get(key)

    def write(self, key: str, value: bytes, ttl: float | None) -> Entry:
        rev = self.next_revision()
        expires = None if ttl is None else time.monotonic() + ttl
        self.data[key] = (value, rev, expires)
        if expires is not None:
            heapq.heappush(self.expiries, (expires, key))
        self.record(Event(EventType.PUT, key, rev, value))
        return Entry(key, value, rev)

    def remove(self, key: str) -> None:
        del self.data[key]
        self.record(Event(EventType.DELETE, key, self.next_revision()))

    def check_revision(self, key: str, expected: int) -> tuple[bytes, int, float | None]:
        item = self.live(key)
        if item is None:
            raise KeyNotFound(f"key {key!r} not found", key)
        if item[1] != expected:
            raise CompareFailed(
                f"key {key!r} is at revision {item[1]}, not {expected}", key, expected, item[1]
            )
        return item


_KEYSPACES: dict[str, _Keyspace] = {}
_KEYSPACES_LOCK = threading.Lock()


class MemoryBackend(KVBackend):
    """In-process backend; see the module docstring.

    Args:
        name: the keyspace name; backends with the same name share data (str).
    """

    capabilities = Capabilities(
        multi_host=False, server_side_ttl=False, native_watch=True, persistent=False, multi_process=False,
        ttl_resolution=0.05
    )

    def __init__(self, name: str = "default") -> None:
        with _KEYSPACES_LOCK:
            self._ks = _KEYSPACES.setdefault(name, _Keyspace())
        self.name = name

    def __repr__(self) -> str:
        return f"MemoryBackend(name={self.name!r})"

    def _do_get(self, key: str) -> Entry | None:
        with self._ks.cond:
            item = self._ks.live(key)
            return None if item is None else Entry(key, item[0], item[1])

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        with self._ks.cond:
            self._ks.expire()
            entries = [Entry(k, v[0], v[1]) for k, v in self._ks.data.items() if k.startswith(prefix)]
            return sorted(entries, key=lambda e: e.key), self._ks.revision

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        with self._ks.cond:
            if self._ks.live(key) is not None:
                raise KeyExists(f"key {key!r} exists", key)
            return self._ks.write(key, value, ttl)

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        with self._ks.cond:
            self._ks.expire()
            return self._ks.write(key, value, ttl)

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        with self._ks.cond:
            self._ks.check_revision(key, expected_revision)
            return self._ks.write(key, value, ttl)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        with self._ks.cond:
            self._ks.check_revision(key, expected_revision)
            self._ks.remove(key)

    def _do_delete(self, key: str) -> bool:
        with self._ks.cond:
            if self._ks.live(key) is None:
                return False
            self._ks.remove(key)
            return True

    def _do_refresh(self, key: str, ttl: float) -> None:
        with self._ks.cond:
            item = self._ks.live(key)
            if item is None:
                raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
            expires = time.monotonic() + ttl
            self._ks.data[key] = (item[0], item[1], expires)
            heapq.heappush(self._ks.expiries, (expires, key))

    def _do_add(self, key: str, delta: int) -> int:
        with self._ks.cond:
            item = self._ks.live(key)
            total = (0 if item is None else parse_counter(key, item[0])) + delta
            self._ks.write(key, str(total).encode("ascii"), None if item is None else _remaining(item[2]))
            return total

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        ks = self._ks
        with ks.cond:
            while True:
                ks.expire()
                if ks.history and after_revision < ks.history[0].revision - 1:
                    raise HistoryCompacted(
                        f"events after revision {after_revision} were compacted "
                        f"(oldest kept: {ks.history[0].revision})",
                        prefix,
                    )
                events = [e for e in _after(ks.history, after_revision) if e.key.startswith(prefix)]
                now = time.monotonic()
                if events or now >= deadline or self._closed:
                    return events
                wake = deadline if not ks.expiries else min(deadline, ks.expiries[0][0])
                ks.cond.wait(max(wake - now, 0.0))

    def _do_close(self) -> None:
        with self._ks.cond:
            self._ks.cond.notify_all()


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


def _open(url: RendezvousURL) -> MemoryBackend:
    if len(url.hosts) > 1:
        raise InvalidURLError("host", url.redacted(), "memory:// takes at most one keyspace name")
    return MemoryBackend(url.hosts[0][0] if url.hosts else "default")


#: Registers ``memory://`` through the ``rdzv`` entry point, like any plugin.
plugin = backend_plugin(
    BackendSpec(
        schemes=("memory",),
        open=_open,
        capabilities=MemoryBackend.capabilities,
        description="in-process keyspace shared by name (tests, simulations)",
    )
)
