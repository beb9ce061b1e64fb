"""``memory://`` specifics: watches woken by prefix, the timekeeper of expiries, the key index.

The shared protocol suite (``conformance_tests``) covers the KV contract; this
module covers how the in-process backend waits: an event wakes only the watches
whose prefix selects its key, one waiting watch (the timekeeper) turns expiries
into ``DELETE`` events and hands that role on when it leaves, and ``close()``
ends only the closed backend's watches.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest

from rdzv_backends.memory import MemoryBackend
from rdzv_core import BackendClosedError, Event, EventType

PATIENCE = 30.0
TTL_SLACK = MemoryBackend.capabilities.ttl_resolution + 1.0  # scheduling on a loaded 2-core machine


@pytest.fixture
def name() -> str:
    """A fresh keyspace name, so tests never share keys."""
    return f"t{uuid.uuid4().hex}"


def registered(kv: MemoryBackend) -> int:
    with kv._ks.lock:
        return len(kv._ks.waiters)


def wait_registered(kv: MemoryBackend, count: int) -> None:
    """Block until ``count`` watches wait on ``kv``'s keyspace (or fail after PATIENCE)."""
    deadline = time.monotonic() + PATIENCE
    while registered(kv) < count:
        assert time.monotonic() < deadline, f"fewer than {count} watches are waiting"
        time.sleep(0.002)


class Watcher(threading.Thread):
    """A thread running one ``watch``; ``result`` is its return value or exception, ``returned`` when."""

    def __init__(self, kv: MemoryBackend, prefix: str, after: int, timeout: float = PATIENCE) -> None:
        super().__init__(daemon=True)
        self.kv, self.prefix, self.after, self.timeout = kv, prefix, after, timeout
        self.result: object = None
        self.returned = 0.0
        self.start()

    def run(self) -> None:
        try:
            self.result = self.kv.watch(self.prefix, self.after, self.timeout)
        except BaseException as exc:  # reported by the test
            self.result = exc
        self.returned = time.monotonic()


def test_an_event_wakes_only_the_watches_its_key_is_under(name: str) -> None:
    kv = MemoryBackend(name)
    start = kv.put("start", b"").revision
    watchers = {p: Watcher(kv, p, start) for p in ("a/", "a/b/", "a/b/c/", "a/x/", "b/", "")}
    wait_registered(kv, len(watchers))
    entry = kv.put("a/b/k", b"v")
    woken = {"a/", "a/b/", ""}
    for prefix in woken:
        watchers[prefix].join(PATIENCE)
        assert watchers[prefix].result == [Event(EventType.PUT, "a/b/k", entry.revision, b"v")], prefix
    assert all(watchers[p].is_alive() for p in set(watchers) - woken), "a watch outside the key's prefixes woke"
    assert registered(kv) == len(watchers) - len(woken)
    closed_at = time.monotonic()
    kv.close()
    for prefix in set(watchers) - woken:
        watchers[prefix].join(PATIENCE)
        assert watchers[prefix].result == [] and watchers[prefix].returned >= closed_at, prefix
    assert registered(kv) == 0


def test_close_ends_only_its_own_watches(name: str) -> None:
    mine, other = MemoryBackend(name), MemoryBackend(name)
    start = mine.put("start", b"").revision
    w_mine, w_other = Watcher(mine, "c/", start), Watcher(other, "c/", start)
    wait_registered(mine, 2)
    mine.close()
    w_mine.join(PATIENCE)
    assert w_mine.result == [] or isinstance(w_mine.result, BackendClosedError)
    assert w_other.is_alive()
    entry = other.put("c/k", b"v")
    w_other.join(PATIENCE)
    assert w_other.result == [Event(EventType.PUT, "c/k", entry.revision, b"v")]
    other.close()


def test_expiry_is_delivered_after_the_timekeeper_left(name: str) -> None:
    """The first waiting watch keeps time; it leaves (its backend is closed) before the key
    expires, and the remaining watch, on another prefix, must take over and see the expiry."""
    kv, keeper_kv = MemoryBackend(name), MemoryBackend(name)
    start = kv.put("start", b"").revision
    keeper = Watcher(keeper_kv, "other/", start)
    wait_registered(kv, 1)
    ttl = 0.5
    written = time.monotonic()
    entry = kv.put("ttl/k", b"v", ttl=ttl)
    watcher = Watcher(kv, "ttl/", entry.revision)
    wait_registered(kv, 2)
    assert kv._ks.timekeeper is not None and kv._ks.timekeeper.owner is keeper_kv
    keeper_kv.close()
    keeper.join(PATIENCE)
    assert keeper.result == []
    watcher.join(PATIENCE)
    assert watcher.result == [Event(EventType.DELETE, "ttl/k", entry.revision + 1)]
    assert ttl <= watcher.returned - written <= ttl + TTL_SLACK
    kv.close()


def test_an_earlier_expiry_wakes_the_timekeeper(name: str) -> None:
    """The timekeeper sleeps until the next expiry (60 s away); a key written with a shorter
    TTL must shorten that sleep."""
    kv = MemoryBackend(name)
    kv.put("late/k", b"v", ttl=60)
    start = kv.put("start", b"").revision
    watcher = Watcher(kv, "soon/", start)
    wait_registered(kv, 1)
    written = time.monotonic()
    entry = kv.put("soon/k", b"v", ttl=0.3)
    watcher.join(PATIENCE)
    assert watcher.result == [Event(EventType.PUT, "soon/k", entry.revision, b"v")]
    watcher = Watcher(kv, "soon/", entry.revision)
    watcher.join(PATIENCE)
    assert watcher.result == [Event(EventType.DELETE, "soon/k", entry.revision + 1)]
    assert watcher.returned - written <= 0.3 + TTL_SLACK
    kv.close()


def test_refreshed_keys_do_not_expire_early(name: str) -> None:
    """A refresh leaves a stale expiry behind in the heap; it must not delete the key."""
    kv = MemoryBackend(name)
    entry = kv.put("r/k", b"v", ttl=0.3)
    kv.refresh("r/k", 30.0)
    watcher = Watcher(kv, "r/", entry.revision, timeout=0.8)
    watcher.join(PATIENCE)
    assert watcher.result == [] and kv.get("r/k") == entry
    kv.close()


def test_get_of_an_expired_key_records_the_delete(name: str) -> None:
    kv = MemoryBackend(name)
    entry = kv.put("g/k", b"v", ttl=0.05)
    deadline = time.monotonic() + PATIENCE
    while kv.get("g/k") is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert kv.watch("g/", entry.revision, 0) == [Event(EventType.DELETE, "g/k", entry.revision + 1)]
    kv.close()


def test_list_prefix_boundaries_with_the_key_index(name: str) -> None:
    """``/`` (0x2F) sorts just below ``0``: the index range for ``a/`` must stop before ``a0``."""
    kv = MemoryBackend(name)
    for key in ("a", "a.b", "a/b", "a/b/c", "a0", "a/~", "b/a", "a/-"):
        kv.put(key, key.encode())
    assert [e.key for e in kv.list("a/")[0]] == ["a/-", "a/b", "a/b/c", "a/~"]
    kv.delete("a/b")
    assert [e.key for e in kv.list("a/")[0]] == ["a/-", "a/b/c", "a/~"]
    assert [e.key for e in kv.list("")[0]] == sorted(["a", "a.b", "a/b/c", "a0", "a/~", "b/a", "a/-"])
    kv.close()


def test_many_watches_one_event_each(name: str) -> None:
    """500 watches on distinct prefixes; 500 writes, one per prefix: each watch gets exactly its own."""
    kv = MemoryBackend(name)
    start = kv.put("start", b"").revision
    watchers = [Watcher(kv, f"m/{i}/", start) for i in range(500)]
    wait_registered(kv, len(watchers))
    for i in range(500):
        kv.put(f"m/{i}/k", str(i).encode())
    for i, watcher in enumerate(watchers):
        watcher.join(PATIENCE)
        assert isinstance(watcher.result, list) and [(e.key, e.value) for e in watcher.result] == [
            (f"m/{i}/k", str(i).encode())
        ]
    assert registered(kv) == 0 and kv._ks.timekeeper is None
    kv.close()


def test_one_event_reaches_every_watch_of_its_prefix(name: str) -> None:
    """300 watches on one prefix are woken by one write through the relay (WAKE_TOKENS at a time):
    each must return it long before its own deadline (a stalled relay would leave them there)."""
    kv = MemoryBackend(name)
    start = kv.put("start", b"").revision
    watchers = [Watcher(kv, "same/", start, timeout=10 * PATIENCE) for _ in range(300)]
    wait_registered(kv, len(watchers))
    entry = kv.put("same/k", b"v")
    deadline = time.monotonic() + PATIENCE
    for watcher in watchers:
        watcher.join(max(deadline - time.monotonic(), 0.0))
        assert watcher.result == [Event(EventType.PUT, "same/k", entry.revision, b"v")], watcher.result
    kv.close()


def test_opening_memory_imports_no_other_backend() -> None:
    """``memory://`` imports its own implementation only: no client library, no implementation
    module of another built-in backend (their packages' ``__init__`` and ``_settings`` are the registration)."""
    code = (
        "import sys, rdzv_core; rdzv_core.open_backend('memory://x/').close(); "
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "rdzv_backends.memory.backend" in loaded
    assert {"rdzv_backends.etcd_v2", "rdzv_backends.etcd_v3", "rdzv_backends.redis"} <= loaded  # registered
    clients = {"redis", "sqlite3", "_sqlite3", "etcd", "etcd3", "grpc", "urllib3"}
    assert not loaded & clients, loaded & clients
    others = [m for m in loaded if m.startswith(("rdzv_backends.file.", "rdzv_backends.redis.", "redis.",
                                                 "rdzv_backends.etcd_v2.", "rdzv_backends.etcd_v3."))
              and not m.endswith("._settings")]
    assert others == [], others

