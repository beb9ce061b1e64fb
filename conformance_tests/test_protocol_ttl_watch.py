"""The ``protocol`` group, TTLs and watches: keys that lapse, refresh, ``expire_tree``, ``ttl_remaining``, and
``watch`` (order, timeouts, history, prefixes, compaction, close), as :mod:`rdzv_core.kv`'s docstrings say.

Same rules as ``test_protocol.py``: revisions compared only with each other, every test below its own
``key_prefix``, waits are watches with deadlines, failure messages name the broken contract.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest

from rdzv_core import BackendClosedError, Event, HistoryCompactedError, KeyNotFoundError, KVBackend
from rdzv_core.errors import InvalidArgumentError

from .agents import quiet
from .protocol_checks import DELETE, MARGIN, PATIENCE, PUT, TTL, collect, head, raises, ttl_deadline, wait_deleted

pytestmark = pytest.mark.protocol


# -- TTL and refresh ------------------------------------------------------------------
def test_ttl_expiry_is_a_delete_event(kv_factory: Callable[[], KVBackend], key_prefix: str, capabilities: Any) -> None:
    kv, watcher = kv_factory(), kv_factory()
    key = key_prefix + "t/k"
    after = head(kv, key_prefix)
    started = time.monotonic()
    kv.create(key, b"v", ttl=TTL)
    assert kv.get(key) is not None, "a fresh key with a TTL must be readable"
    seen = wait_deleted(watcher, key, after, ttl_deadline(capabilities, TTL) + PATIENCE)
    assert seen is not None, "expiry never reached watch as a DELETE"
    assert seen - started >= TTL - 0.02, "the key expired before its TTL"
    assert seen - started <= ttl_deadline(capabilities, TTL), (
        f"expiry seen {seen - started - TTL:.3f}s late; ttl_resolution={capabilities.ttl_resolution}"
    )
    assert kv.get(key) is None and watcher.get(key) is None
    assert kv.list(key_prefix)[0] == []
    assert kv.delete(key) is False


def test_expired_key_counts_as_absent(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    a, b, c = (key_prefix + f"t/{n}" for n in "abc")
    after = head(kv, key_prefix)
    entry_b = kv.put(b, b"x", ttl=TTL)
    kv.put(a, b"x", ttl=TTL)
    kv.put(c, b"7", ttl=TTL)
    assert wait_deleted(kv, c, after, ttl_deadline(capabilities, TTL) + PATIENCE) is not None, (
        "expiry never reached watch as a DELETE"
    )
    with raises(KeyNotFoundError, "refresh of an expired key must raise KeyNotFoundError"):
        kv.refresh(a, 5.0)
    with raises(KeyNotFoundError, "compare_and_swap on an expired key must raise KeyNotFoundError"):
        kv.compare_and_swap(b, b"y", entry_b.revision)
    assert kv.add(c, 1) == 1, "add on an expired key counts from 0"
    assert kv.create(a, b"again").value == b"again", "create on an expired key must succeed"


def test_refresh_keeps_value_and_extends_life(
    kv: KVBackend, key_prefix: str, capabilities: Any
) -> None:
    key = key_prefix + "t/k"
    entry = kv.create(key, b"payload", ttl=TTL)
    kv.refresh(key, TTL + 2 * MARGIN + capabilities.ttl_resolution + 1.0)
    refreshed = kv.get(key)
    assert refreshed is not None and refreshed.value == b"payload", "refresh must keep the value"
    assert refreshed.revision >= entry.revision, "refresh must not move the revision back"
    # Past the original expiry (plus slack) the key must still be there, and refresh emitted no event.
    events = quiet(kv, key_prefix, refreshed.revision, ttl_deadline(capabilities, TTL))
    assert events == [], f"refresh must extend the TTL and emit no event; the refreshed key changed: {events}"
    assert kv.get(key) is not None and kv.get(key).value == b"payload", "refresh must extend the key's life"


def test_expire_tree_gives_every_key_under_the_prefix_a_ttl(
    kv_factory: Callable[[], KVBackend], key_prefix: str, capabilities: Any
) -> None:
    kv, watcher = kv_factory(), kv_factory()
    tree, ttl = key_prefix + "run/", 1.5
    kv.put(tree + "a", b"1")
    kv.put(tree + "d/b", b"2", ttl=600)
    kv.add(tree + "n", 3)
    kv.take_ticket(tree + "t")
    kv.take_ticket(tree + "t")
    outside = kv.put(key_prefix + "runner", b"x")
    after = head(kv, key_prefix)
    started = time.monotonic()
    assert kv.expire_tree(tree, ttl) >= 3, "expire_tree counts the keys it gave the TTL"
    values = {e.key: e.value for e in kv.list(tree)[0]}
    if time.monotonic() - started < ttl - 0.2:  # still within the TTL: values unchanged, nothing deleted yet
        assert (values[tree + "a"], values[tree + "d/b"], values[tree + "n"]) == (b"1", b"2", b"3")
    assert wait_deleted(watcher, tree + "a", after, ttl_deadline(capabilities, ttl) + PATIENCE) is not None, (
        "the expiry of a key given a TTL by expire_tree never reached watch as a DELETE")
    deadline = time.monotonic() + ttl_deadline(capabilities, ttl) + 1.0 + PATIENCE  # etcd v2: the directory 1 s later
    while (kv.list(tree)[0] or kv.tickets(tree + "t")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv.list(tree)[0] == [] and kv.tickets(tree + "t") == 0, "every key under the prefix must expire"
    assert time.monotonic() - started >= ttl - 0.05, "the keys expired before the TTL"
    assert kv.get(key_prefix + "runner") == outside, "a key outside the prefix keeps its life"


def test_expire_tree_takes_a_ttl(kv: KVBackend, key_prefix: str) -> None:
    for bad in (0, -1.0, None, float("nan")):
        with raises(InvalidArgumentError, "expire_tree without a positive TTL must raise InvalidArgumentError"):
            kv.expire_tree(key_prefix, bad)  # type: ignore[arg-type]


def test_refresh_absent_key(kv: KVBackend, key_prefix: str) -> None:
    with raises(KeyNotFoundError, "refresh of an absent key must raise KeyNotFoundError"):
        kv.refresh(key_prefix + "never", 1.0)


def test_ttl_remaining_reports_the_time_left(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    """Optional operation: ``ttl_remaining`` (``NotImplementedError`` = the backend cannot tell: skipped)."""
    plain, timed = key_prefix + "t/plain", key_prefix + "t/timed"
    kv.put(plain, b"x")
    kv.put(timed, b"x", ttl=30.0)
    try:
        left = kv.ttl_remaining(timed)
    except NotImplementedError:
        pytest.skip("the backend does not report remaining TTLs (optional)")
    slack = 1.0 + capabilities.ttl_resolution  # etcd counts whole seconds and may round up
    assert left is not None and 30.0 - 10.0 < left <= 30.0 + slack, f"30 s TTL just written, reported {left!r} s left"
    assert kv.ttl_remaining(plain) is None, "a key without TTL must report None"
    kv.refresh(timed, 120.0)
    after = kv.ttl_remaining(timed)
    assert after is not None and 120.0 - 10.0 < after <= 120.0 + slack, f"refreshed to 120 s, reported {after!r} s"
    kv.put(timed, b"y")
    assert kv.ttl_remaining(timed) is None, "writing with ttl=None must remove the TTL"
    with raises(KeyNotFoundError, "ttl_remaining of an absent key must raise KeyNotFoundError"):
        kv.ttl_remaining(key_prefix + "t/never")


def test_write_without_ttl_clears_ttl(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    by_put, by_cas = key_prefix + "t/put", key_prefix + "t/cas"
    kv.put(by_put, b"x", ttl=TTL)
    kv.put(by_put, b"y")
    old = kv.put(by_cas, b"x", ttl=TTL)
    settled = kv.compare_and_swap(by_cas, b"y", old.revision).revision
    events = quiet(kv, key_prefix, settled, ttl_deadline(capabilities, TTL))
    assert events == [], f"writing with ttl=None must remove the TTL; the key still expired: {events}"
    assert kv.get(by_put).value == b"y" and kv.get(by_cas).value == b"y", "writing with ttl=None must remove the TTL"


# -- watch ----------------------------------------------------------------------
def test_watch_sees_every_change_in_order(kv: KVBackend, key_prefix: str) -> None:
    p = key_prefix + "w/"
    start = head(kv, key_prefix)
    e1 = kv.create(p + "a", b"1")
    e2 = kv.put(p + "b", b"2")
    e3 = kv.compare_and_swap(p + "a", b"1b", e1.revision)
    kv.add(p + "n", 3)
    kv.put(key_prefix + "elsewhere", b"not watched")
    assert kv.delete(p + "b")
    kv.compare_and_delete(p + "a", e3.revision)
    events = collect(kv, p, start, 6)
    assert [(e.type, e.key, e.value) for e in events] == [
        (PUT, p + "a", b"1"),
        (PUT, p + "b", b"2"),
        (PUT, p + "a", b"1b"),
        (PUT, p + "n", b"3"),
        (DELETE, p + "b", None),
        (DELETE, p + "a", None),
    ], f"watch must return every change under the prefix (deletes too), in revision order; got {events}"
    revisions = [e.revision for e in events]
    assert revisions == sorted(set(revisions)), "watch events must be in strictly increasing revision order"
    assert revisions[:3] == [e1.revision, e2.revision, e3.revision], "an event's revision must be the write's"
    # Watching from any event's revision never returns it or an older one.
    for i, event in enumerate(events[:-1]):
        rest = collect(kv, p, event.revision, 1)
        assert rest and rest == events[i + 1 : i + 1 + len(rest)], (
            f"watch after revision {event.revision} must return the events after it, in order; got {rest}"
        )
    assert kv.watch(p, events[-1].revision, 0.2) == [], "watch after the last event must time out empty"


def test_watch_times_out_empty(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    for timeout in (0.0, 0.3):
        started = time.monotonic()
        assert kv.watch(key_prefix, after, timeout) == [], "watch with nothing new must return []"
        elapsed = time.monotonic() - started
        assert timeout * 0.8 <= elapsed <= timeout + 2.0, f"watch(timeout={timeout}) took {elapsed:.3f}s"


def test_watch_returns_history_immediately(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    entry = kv.put(key_prefix + "k", b"v")
    started = time.monotonic()
    events = kv.watch(key_prefix, after, 30.0)
    assert time.monotonic() - started < 5.0, "watch must return at once when events already exist"
    assert events == [Event(PUT, key_prefix + "k", entry.revision, b"v")], f"watch must return the put; got {events}"


def test_watch_wakes_on_another_clients_write(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    watcher, writer = kv_factory(), kv_factory()
    after = head(writer, key_prefix)
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(collect(watcher, key_prefix, after, 1, 30.0)))
    thread.start()
    started = time.monotonic()
    entry = writer.put(key_prefix + "k", b"v")
    thread.join(PATIENCE)
    assert not thread.is_alive() and time.monotonic() - started < PATIENCE, (
        "a blocked watch must wake promptly on another client's write"
    )
    assert result == [[Event(PUT, key_prefix + "k", entry.revision, b"v")]], f"watch returned {result}"


def test_watch_prefix_isolation(kv: KVBackend, key_prefix: str) -> None:
    p = key_prefix + "a/"
    after = head(kv, key_prefix)
    for name in ("a", "a0", "a-x", "ab/c", "b/a/x"):
        kv.put(key_prefix + name, b"noise")
    assert kv.watch(p, after, 0.3) == [], "watch saw keys outside its prefix"
    entry = kv.put(p + "x", b"mine")
    assert collect(kv, p, after, 1) == [Event(PUT, p + "x", entry.revision, b"mine")], "watch missed its key"
    deep = kv.put(p + "x/y", b"deeper")
    assert collect(kv, p, entry.revision, 1) == [Event(PUT, p + "x/y", deep.revision, b"deeper")], (
        "watch(prefix) must see keys at any depth below prefix"
    )


def test_watch_whole_keyspace(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    entry = kv.put(key_prefix + "k", b"v")
    events = collect(kv, "", after, 10_000, timeout=0.5)  # other clients may write too
    assert Event(PUT, key_prefix + "k", entry.revision, b"v") in events, "watch('') must see the whole keyspace"


def test_history_compacted_and_recovery(kv: KVBackend, key_prefix: str) -> None:
    """Write until the backend compacts (bounded by count and time), then recover as documented."""
    max_writes, budget, chunk = 12_000, 15.0, 500
    key = key_prefix + "h/k"
    start = head(kv, key_prefix)
    deadline = time.monotonic() + budget
    written = 0
    while True:
        try:
            kv.watch(key_prefix + "h/", start, 0)
        except HistoryCompactedError:
            break
        if written >= max_writes or time.monotonic() > deadline:
            pytest.skip(
                f"the backend did not compact its history within {written} writes and "
                f"{time.monotonic() - deadline + budget:.1f}s (HistoryCompactedError is optional; recovery not tested)"
            )
        for _ in range(chunk):
            kv.put(key, str(written).encode())
            written += 1
    # Recovery: re-read, then watch from the revision read.
    entries, revision = kv.list(key_prefix + "h/")
    assert [e.value for e in entries] == [str(written - 1).encode()], "list after compaction must return the last write"
    for event in kv.watch(key_prefix + "h/", revision, 0):
        assert event.revision > revision, f"watch returned {event} at or below after_revision={revision}"
    entry = kv.put(key, b"after")
    events = collect(kv, key_prefix + "h/", revision, 1)
    assert events == [Event(PUT, key, entry.revision, b"after")], (
        "after HistoryCompactedError, a watch from the revision re-read must work"
    )


def test_close_ends_a_blocked_watch(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    """Closing a client during a watch must not hang it or make it raise anything but BackendClosedError."""
    kv = kv_factory()
    after = head(kv, key_prefix)
    result: list[Any] = []

    def watch() -> None:
        try:
            result.append(kv.watch(key_prefix, after, 2.0))
        except BackendClosedError as exc:
            result.append(exc)

    thread = threading.Thread(target=watch)
    thread.start()
    kv.close()
    thread.join(2.0 + PATIENCE)
    assert not thread.is_alive() and len(result) == 1, "close must end a blocked watch promptly"
    assert result[0] == [] or isinstance(result[0], BackendClosedError), (
        f"a watch ended by close must return [] or raise BackendClosedError, not {result[0]!r}"
    )
