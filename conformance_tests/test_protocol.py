"""The ``protocol`` group: every operation of :class:`rdzv_core.kv.KVBackend`, as its docstrings say.

Backend-independent: revisions are compared only with each other (a shared
server advances them for other tests too), every test writes below its own
``key_prefix``, and optional abilities (value limits, compaction) become skips
with a reason. Waits are watches with deadlines, never bare sleeps.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

import pytest

from rdzv_core import (
    BackendClosed,
    CompareFailed,
    Entry,
    Event,
    EventType,
    HistoryCompacted,
    InvalidKeyError,
    KeyExists,
    KeyNotFound,
    KVBackend,
    KVError,
    ValueTooLarge,
    escape_segment,
    unescape_segment,
)

pytestmark = pytest.mark.protocol

PUT, DELETE = EventType.PUT, EventType.DELETE
#: Slack (seconds) on top of ``ttl_resolution`` for a loaded 2-core machine.
MARGIN = 1.0
#: Upper bound (seconds) for anything that should happen "promptly".
PATIENCE = 15.0
TTL = 0.4
THREADS = 8


# -- helpers -------------------------------------------------------------------
def collect(kv: KVBackend, prefix: str, after: int, count: int, timeout: float = PATIENCE) -> list[Event]:
    """Watch until ``count`` events arrived (or ``timeout``); check each batch's ordering rules."""
    deadline = time.monotonic() + timeout
    out: list[Event] = []
    while len(out) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        batch = kv.watch(prefix, after, remaining)
        for event in batch:
            assert event.revision > after, f"watch returned {event} at or below after_revision={after}"
            assert event.key.startswith(prefix), f"watch({prefix!r}) returned {event}"
            after = event.revision
        out += batch
    return out


def wait_deleted(kv: KVBackend, key: str, after: int, timeout: float) -> float | None:
    """Watch ``key``'s parent prefix until a ``DELETE`` of ``key``; the monotonic time seen, or ``None``."""
    prefix = key.rsplit("/", 1)[0] + "/"
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        for event in kv.watch(prefix, after, remaining):
            after = event.revision
            if event.key == key and event.type is DELETE:
                return time.monotonic()
    return None


def quiet(kv: KVBackend, prefix: str, after: int, timeout: float) -> list[Event]:
    """Every event under ``prefix`` after ``after`` during ``timeout`` seconds (expected: none)."""
    deadline = time.monotonic() + timeout
    seen: list[Event] = []
    while (remaining := deadline - time.monotonic()) > 0:
        batch = kv.watch(prefix, after, remaining)
        seen += batch
        if batch:
            after = batch[-1].revision
    return seen


def head(kv: KVBackend, prefix: str) -> int:
    """The keyspace revision now (read through ``list``)."""
    return kv.list(prefix)[1]


def run_threads(n: int, target: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``target(i)`` in ``n`` threads started together; return results (or exceptions) by index."""
    results: list[Any] = [None] * n
    barrier = threading.Barrier(n)

    def main(i: int) -> None:
        try:
            barrier.wait(timeout)
            results[i] = target(i)
        except BaseException as exc:  # collected and judged by the test
            results[i] = exc

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s"
    return results


def ttl_deadline(capabilities: Any, ttl: float) -> float:
    """Latest acceptable time (seconds after the write began) to observe an expiry."""
    return ttl + capabilities.ttl_resolution + MARGIN


# -- get / put / list ------------------------------------------------------------
def test_get_absent_is_none(kv: KVBackend, key_prefix: str) -> None:
    assert kv.get(key_prefix + "nothing") is None


def test_put_get_roundtrip(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    writer, reader = kv_factory(), kv_factory()
    entry = writer.put(key_prefix + "k", b"v1")
    assert entry == Entry(key_prefix + "k", b"v1", entry.revision)
    assert isinstance(entry.revision, int) and entry.revision > 0
    assert writer.get(key_prefix + "k") == entry
    assert reader.get(key_prefix + "k") == entry, "a second client must read the first one's write"


def test_put_overwrites_and_advances_revision(kv: KVBackend, key_prefix: str) -> None:
    first = kv.put(key_prefix + "k", b"one")
    second = kv.put(key_prefix + "k", b"two")
    assert second.revision > first.revision
    assert kv.get(key_prefix + "k") == Entry(key_prefix + "k", b"two", second.revision)


def test_revisions_increase_across_keys(kv: KVBackend, key_prefix: str) -> None:
    revisions = [kv.put(f"{key_prefix}k{i}", b"x").revision for i in range(5)]
    assert revisions == sorted(set(revisions))


def test_list_sorted_with_revision_at_read_time(kv: KVBackend, key_prefix: str) -> None:
    names = ["b", "a", "A", "0", "_", "~", "a.b", "a-b", "a=b", "a%2F", "a+b", "a:b", "a@b", "Z9", "a/x", "a/x/y"]
    random.Random(7).shuffle(names)
    written = [kv.put(key_prefix + n, n.encode()) for n in names]
    entries, revision = kv.list(key_prefix)
    assert [e.key for e in entries] == sorted(key_prefix + n for n in names)
    assert {e.key: e for e in entries} == {e.key: e for e in written}
    assert revision >= max(e.revision for e in written), "list's revision predates writes it returned"
    later = kv.put(key_prefix + "later", b"x")
    assert kv.list(key_prefix)[1] >= later.revision


def test_list_prefix_boundaries(kv: KVBackend, key_prefix: str) -> None:
    inside = ["a/b", "a/b/c", "a/~", "a/0"]
    outside = ["a", "a-b", "a.b", "a0", "a~", "ab/c", "b/a/b"]
    for name in inside + outside:
        kv.put(key_prefix + name, b"x")
    assert [e.key for e in kv.list(key_prefix + "a/")[0]] == sorted(key_prefix + n for n in inside)
    assert kv.list(key_prefix + "zzz/")[0] == []


def test_list_empty_prefix_is_whole_keyspace(kv: KVBackend, key_prefix: str) -> None:
    mine = {kv.put(key_prefix + n, b"x").key for n in ("y", "x")}
    entries, revision = kv.list("")
    keys = [e.key for e in entries]
    assert keys == sorted(keys)
    assert mine <= set(keys)
    assert revision > 0


def test_list_excludes_deleted(kv: KVBackend, key_prefix: str) -> None:
    kv.put(key_prefix + "a", b"1")
    kv.put(key_prefix + "b", b"2")
    kv.delete(key_prefix + "a")
    assert [e.key for e in kv.list(key_prefix)[0]] == [key_prefix + "b"]


# -- create ---------------------------------------------------------------------
def test_create_only_if_absent(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    entry = kv.create(key, b"first")
    assert entry == Entry(key, b"first", entry.revision)
    with pytest.raises(KeyExists):
        kv.create(key, b"second")
    assert kv.get(key) == entry, "a failed create must not change the key"


def test_create_after_delete(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    first = kv.create(key, b"1")
    assert kv.delete(key)
    second = kv.create(key, b"2")
    assert second.revision > first.revision and kv.get(key) == second


# -- compare-and-swap / compare-and-delete ------------------------------------------
def test_cas_success_advances_revision(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    old = kv.put(key, b"old")
    new = kv.compare_and_swap(key, b"new", old.revision)
    assert new.key == key and new.value == b"new" and new.revision > old.revision
    assert kv.get(key) == new


def test_cas_stale_revision_fails(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    old = kv.put(key, b"old")
    current = kv.put(key, b"current")
    with pytest.raises(CompareFailed) as info:
        kv.compare_and_swap(key, b"lost", old.revision)
    assert info.value.actual_revision in (None, current.revision)
    assert kv.get(key) == current, "a failed CAS must not change the key"


def test_cas_absent_key(kv: KVBackend, key_prefix: str) -> None:
    other = kv.put(key_prefix + "other", b"x")
    with pytest.raises(KeyNotFound):
        kv.compare_and_swap(key_prefix + "never", b"x", other.revision)
    gone = kv.put(key_prefix + "gone", b"x")
    kv.delete(key_prefix + "gone")
    with pytest.raises(KeyNotFound):
        kv.compare_and_swap(key_prefix + "gone", b"x", gone.revision)
    assert kv.get(key_prefix + "never") is None and kv.get(key_prefix + "gone") is None


def test_compare_and_delete(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    old = kv.put(key, b"old")
    current = kv.put(key, b"current")
    with pytest.raises(CompareFailed):
        kv.compare_and_delete(key, old.revision)
    assert kv.get(key) == current
    kv.compare_and_delete(key, current.revision)
    assert kv.get(key) is None
    with pytest.raises(KeyNotFound):
        kv.compare_and_delete(key, current.revision)


# -- delete ---------------------------------------------------------------------
def test_delete_reports_existence(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    kv.put(key, b"x")
    assert kv.delete(key) is True
    assert kv.get(key) is None
    assert kv.delete(key) is False


def test_delete_is_not_recursive(kv: KVBackend, key_prefix: str) -> None:
    kv.put(key_prefix + "a", b"1")
    kv.put(key_prefix + "a/b", b"2")
    assert kv.delete(key_prefix + "a")
    assert kv.get(key_prefix + "a/b") is not None


# -- add ------------------------------------------------------------------------
def test_add_counts_from_zero_and_stores_ascii(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "n"
    assert kv.add(key, 5) == 5
    assert kv.get(key).value == b"5"
    assert kv.add(key, -7) == -2
    assert kv.get(key).value == b"-2"
    assert kv.add(key, 0) == -2
    assert kv.add(key, 2**40) == 2**40 - 2
    assert kv.get(key).value == str(2**40 - 2).encode("ascii")


def test_add_on_put_decimal_and_revision(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "n"
    before = kv.put(key, b"41")
    assert kv.add(key, 1) == 42
    after = kv.get(key)
    assert after.value == b"42" and after.revision > before.revision


@pytest.mark.parametrize("bad", [b"abc", b"", b"1.5", b"\xff\x00", b"x1"])
def test_add_on_non_integer_fails(kv: KVBackend, key_prefix: str, bad: bytes) -> None:
    key = key_prefix + "n"
    entry = kv.put(key, bad)
    with pytest.raises(KVError):
        kv.add(key, 1)
    assert kv.get(key) == entry, "a failed add must not change the key"


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
    assert wait_deleted(kv, c, after, ttl_deadline(capabilities, TTL) + PATIENCE) is not None
    with pytest.raises(KeyNotFound):
        kv.refresh(a, 5.0)
    with pytest.raises(KeyNotFound):
        kv.compare_and_swap(b, b"y", entry_b.revision)
    assert kv.add(c, 1) == 1, "add on an expired key counts from 0"
    assert kv.create(a, b"again").value == b"again"


def test_refresh_keeps_value_and_extends_life(
    kv: KVBackend, key_prefix: str, capabilities: Any
) -> None:
    key = key_prefix + "t/k"
    entry = kv.create(key, b"payload", ttl=TTL)
    kv.refresh(key, TTL + 2 * MARGIN + capabilities.ttl_resolution + 1.0)
    refreshed = kv.get(key)
    assert refreshed is not None and refreshed.value == b"payload"
    assert refreshed.revision >= entry.revision
    # Past the original expiry (plus slack) the key must still be there, and refresh emitted no event.
    events = quiet(kv, key_prefix, refreshed.revision, ttl_deadline(capabilities, TTL))
    assert events == [], f"refreshed key changed: {events}"
    assert kv.get(key) is not None and kv.get(key).value == b"payload"


def test_refresh_absent_key(kv: KVBackend, key_prefix: str) -> None:
    with pytest.raises(KeyNotFound):
        kv.refresh(key_prefix + "never", 1.0)


def test_write_without_ttl_clears_ttl(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    by_put, by_cas = key_prefix + "t/put", key_prefix + "t/cas"
    kv.put(by_put, b"x", ttl=TTL)
    kv.put(by_put, b"y")
    old = kv.put(by_cas, b"x", ttl=TTL)
    settled = kv.compare_and_swap(by_cas, b"y", old.revision).revision
    events = quiet(kv, key_prefix, settled, ttl_deadline(capabilities, TTL))
    assert events == [], f"a key rewritten with ttl=None still expired: {events}"
    assert kv.get(by_put).value == b"y" and kv.get(by_cas).value == b"y"


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
    ]
    revisions = [e.revision for e in events]
    assert revisions == sorted(set(revisions))
    assert revisions[:3] == [e1.revision, e2.revision, e3.revision]
    # Watching from any event's revision never returns it or an older one.
    for i, event in enumerate(events[:-1]):
        rest = collect(kv, p, event.revision, 1)
        assert rest and rest == events[i + 1 : i + 1 + len(rest)]
    assert kv.watch(p, events[-1].revision, 0.2) == []


def test_watch_times_out_empty(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    for timeout in (0.0, 0.3):
        started = time.monotonic()
        assert kv.watch(key_prefix, after, timeout) == []
        elapsed = time.monotonic() - started
        assert timeout * 0.8 <= elapsed <= timeout + 2.0, f"watch(timeout={timeout}) took {elapsed:.3f}s"


def test_watch_returns_history_immediately(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    entry = kv.put(key_prefix + "k", b"v")
    started = time.monotonic()
    events = kv.watch(key_prefix, after, 30.0)
    assert time.monotonic() - started < 5.0
    assert events == [Event(PUT, key_prefix + "k", entry.revision, b"v")]


def test_watch_wakes_on_another_clients_write(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    watcher, writer = kv_factory(), kv_factory()
    after = head(writer, key_prefix)
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(collect(watcher, key_prefix, after, 1, 30.0)))
    thread.start()
    started = time.monotonic()
    entry = writer.put(key_prefix + "k", b"v")
    thread.join(PATIENCE)
    assert not thread.is_alive() and time.monotonic() - started < PATIENCE
    assert result == [[Event(PUT, key_prefix + "k", entry.revision, b"v")]]


def test_watch_prefix_isolation(kv: KVBackend, key_prefix: str) -> None:
    p = key_prefix + "a/"
    after = head(kv, key_prefix)
    for name in ("a", "a0", "a-x", "ab/c", "b/a/x"):
        kv.put(key_prefix + name, b"noise")
    assert kv.watch(p, after, 0.3) == [], "watch saw keys outside its prefix"
    entry = kv.put(p + "x", b"mine")
    assert collect(kv, p, after, 1) == [Event(PUT, p + "x", entry.revision, b"mine")]
    deep = kv.put(p + "x/y", b"deeper")
    assert collect(kv, p, entry.revision, 1) == [Event(PUT, p + "x/y", deep.revision, b"deeper")]


def test_watch_whole_keyspace(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    entry = kv.put(key_prefix + "k", b"v")
    events = collect(kv, "", after, 10_000, timeout=0.5)  # other clients may write too
    assert Event(PUT, key_prefix + "k", entry.revision, b"v") in events


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
        except HistoryCompacted:
            break
        if written >= max_writes or time.monotonic() > deadline:
            pytest.skip(f"history after {written} writes ({time.monotonic() - deadline + budget:.1f}s) not compacted")
        for _ in range(chunk):
            kv.put(key, str(written).encode())
            written += 1
    # Recovery: re-read, then watch from the revision read.
    entries, revision = kv.list(key_prefix + "h/")
    assert [e.value for e in entries] == [str(written - 1).encode()]
    for event in kv.watch(key_prefix + "h/", revision, 0):
        assert event.revision > revision
    entry = kv.put(key, b"after")
    events = collect(kv, key_prefix + "h/", revision, 1)
    assert events == [Event(PUT, key, entry.revision, b"after")]


def test_close_ends_a_blocked_watch(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    """Closing a client during a watch must not hang it or make it raise anything but BackendClosed."""
    kv = kv_factory()
    after = head(kv, key_prefix)
    result: list[Any] = []

    def watch() -> None:
        try:
            result.append(kv.watch(key_prefix, after, 2.0))
        except BackendClosed as exc:
            result.append(exc)

    thread = threading.Thread(target=watch)
    thread.start()
    kv.close()
    thread.join(2.0 + PATIENCE)
    assert not thread.is_alive() and len(result) == 1
    assert result[0] == [] or isinstance(result[0], BackendClosed)


# -- values and keys ----------------------------------------------------------------
def test_binary_and_empty_values(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    blob = bytes(range(256)) * 4
    kv.put(key_prefix + "bin", blob)
    kv.put(key_prefix + "empty", b"")
    kv.create(key_prefix + "nul", b"\x00")
    assert kv.get(key_prefix + "bin").value == blob
    empty = kv.get(key_prefix + "empty")
    assert empty is not None and empty.value == b""
    assert kv.get(key_prefix + "nul").value == b"\x00"
    assert [e.value for e in kv.list(key_prefix)[0]] == [blob, b"", b"\x00"]
    assert [e.value for e in collect(kv, key_prefix, after, 3)] == [blob, b"", b"\x00"]


def test_value_accepts_bytearray_and_memoryview(kv: KVBackend, key_prefix: str) -> None:
    assert kv.put(key_prefix + "a", bytearray(b"ba")).value == b"ba"
    assert kv.put(key_prefix + "m", memoryview(b"mv")).value == b"mv"
    assert kv.get(key_prefix + "a").value == b"ba"
    with pytest.raises(InvalidKeyError):
        kv.put(key_prefix + "s", "text")  # type: ignore[arg-type]


def test_one_mebibyte_value(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    size = 1 << 20
    if capabilities.max_value_bytes is not None and capabilities.max_value_bytes < size:
        pytest.skip(f"max_value_bytes={capabilities.max_value_bytes} < 1 MiB")
    blob = random.Random(1).randbytes(size)
    entry = kv.put(key_prefix + "big", blob)
    assert kv.get(key_prefix + "big") == entry and entry.value == blob
    assert collect(kv, key_prefix, entry.revision - 1, 1)[0].value == blob


def test_value_too_large_writes_nothing(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    limit = capabilities.max_value_bytes
    if limit is None:
        pytest.skip("backend declares no max_value_bytes")
    if limit > 256 * 1024 * 1024:
        pytest.skip(f"max_value_bytes={limit} is too large to allocate in a test")
    key = key_prefix + "k"
    existing = kv.put(key, b"small")
    after = existing.revision
    too_big = b"\0" * (limit + 1)
    for call in (
        lambda: kv.put(key, too_big),
        lambda: kv.create(key_prefix + "new", too_big),
        lambda: kv.compare_and_swap(key, too_big, existing.revision),
    ):
        with pytest.raises(ValueTooLarge):
            call()
    assert kv.get(key) == existing and kv.get(key_prefix + "new") is None
    assert kv.watch(key_prefix, after, 0.2) == []


HOSTILE = [b"", b"\x00", b"/", b"//", b".", b"..", b"../x", b"\xff\xfe", "ü/ß".encode(), b"%", b"%25", b"_",
           b"*", b"?", b"a b", b"=", b"=61", b"a", b"A", b"\\", b"'", b'"; DROP TABLE kv; --', b"\n"]


def test_hostile_segments_round_trip_without_collisions(kv: KVBackend, key_prefix: str) -> None:
    keys = {raw: key_prefix + "u/" + escape_segment(raw) + "/v" for raw in HOSTILE}
    assert len(set(keys.values())) == len(HOSTILE)
    for raw, key in keys.items():
        kv.create(key, raw)
    entries, _ = kv.list(key_prefix + "u/")
    assert len(entries) == len(HOSTILE)
    assert {unescape_segment(e.key.split("/")[-2]): e.value for e in entries} == {r: r for r in HOSTILE}
    for raw, key in keys.items():
        assert kv.get(key).value == raw
    assert escape_segment("ü/ß") == escape_segment("ü/ß".encode())


def test_sql_and_glob_wildcards_in_prefixes_are_literal(kv: KVBackend, key_prefix: str) -> None:
    seg = escape_segment(b"a_%")  # "=a_%25": '_' and '%' are LIKE wildcards
    p = key_prefix + seg + "/"
    after = head(kv, key_prefix)
    decoys = [key_prefix + "=aX%25/k", key_prefix + "=a_zz25/k", key_prefix + "=a_%25x/k", key_prefix + "=a_%25"]
    for d in decoys:
        kv.put(d, b"decoy")
    mine = kv.put(p + "k", b"mine")
    assert kv.list(p)[0] == [mine]
    assert collect(kv, p, after, 1) == [Event(PUT, p + "k", mine.revision, b"mine")]


BAD_KEYS: list[Any] = ["", "/a", "a/", "a//b", ".", "..", "a/../b", "a/./b", "a b", "a\x00b", "ü", "a*", "a?b",
                       "x" * 256, "/".join(["abcdefgh"] * 120), b"a", None, 7]
BAD_PREFIXES: list[Any] = ["a", "/", "a//", "../", " /", "/a/", "a/b", None, b"a/"]


def test_invalid_keys_rejected(kv: KVBackend, key_prefix: str) -> None:
    revision = kv.put(key_prefix + "ok", b"1").revision
    for bad in BAD_KEYS:
        for call in (
            lambda: kv.get(bad),
            lambda: kv.put(bad, b"x"),
            lambda: kv.create(bad, b"x"),
            lambda: kv.compare_and_swap(bad, b"x", revision),
            lambda: kv.compare_and_delete(bad, revision),
            lambda: kv.delete(bad),
            lambda: kv.refresh(bad, 1.0),
            lambda: kv.add(bad, 1),
        ):
            with pytest.raises(InvalidKeyError):
                call()
    assert kv.watch(key_prefix, revision, 0) == [], "a rejected call wrote something"


def test_invalid_prefixes_rejected(kv: KVBackend, key_prefix: str) -> None:
    for bad in BAD_PREFIXES:
        with pytest.raises(InvalidKeyError):
            kv.list(bad)
        with pytest.raises(InvalidKeyError):
            kv.watch(bad, 0, 0)


@pytest.mark.parametrize(
    "call",
    [
        lambda kv, k: kv.put(k, b"x", ttl=0),
        lambda kv, k: kv.put(k, b"x", ttl=-1.0),
        lambda kv, k: kv.create(k, b"x", ttl=float("nan")),
        lambda kv, k: kv.create(k, b"x", ttl=float("inf")),
        lambda kv, k: kv.put(k, b"x", ttl=True),
        lambda kv, k: kv.refresh(k, None),
        lambda kv, k: kv.compare_and_swap(k, b"x", 0),
        lambda kv, k: kv.compare_and_swap(k, b"x", 1.0),
        lambda kv, k: kv.compare_and_delete(k, -1),
        lambda kv, k: kv.add(k, 1.0),
        lambda kv, k: kv.add(k, True),
        lambda kv, k: kv.watch("", -1, 0),
        lambda kv, k: kv.watch("", 0, -1.0),
    ],
    ids=["ttl0", "ttl-neg", "ttl-nan", "ttl-inf", "ttl-bool", "refresh-none", "cas-rev0", "cas-float",
         "cad-neg", "add-float", "add-bool", "watch-rev-neg", "watch-timeout-neg"],
)
def test_invalid_arguments_rejected(kv: KVBackend, key_prefix: str, call: Callable[..., Any]) -> None:
    key = key_prefix + "k"
    with pytest.raises(InvalidKeyError):
        call(kv, key)
    assert kv.get(key) is None


def test_closed_backend_raises(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    kv, other = kv_factory(), kv_factory()
    entry = kv.put(key_prefix + "k", b"x")
    kv.close()
    kv.close()  # idempotent
    k = key_prefix + "k"
    for call in (
        lambda: kv.get(k),
        lambda: kv.list(key_prefix),
        lambda: kv.put(k, b"y"),
        lambda: kv.create(key_prefix + "n", b"y"),
        lambda: kv.compare_and_swap(k, b"y", entry.revision),
        lambda: kv.compare_and_delete(k, entry.revision),
        lambda: kv.delete(k),
        lambda: kv.refresh(k, 1.0),
        lambda: kv.add(key_prefix + "c", 1),
        lambda: kv.watch(key_prefix, 0, 0),
    ):
        with pytest.raises(BackendClosed):
            call()
    assert other.get(k) == entry, "closing one client must not affect another"
    with kv_factory() as scoped:
        scoped.get(k)
    with pytest.raises(BackendClosed):
        scoped.get(k)


# -- concurrency ----------------------------------------------------------------------
def test_concurrent_add_loses_nothing(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    per_thread = 25
    clients = [kv_factory() for _ in range(THREADS)]
    key = key_prefix + "counter"
    results = run_threads(THREADS, lambda i: [clients[i].add(key, 1) for _ in range(per_thread)])
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    totals = sorted(t for r in results for t in r)
    assert totals == list(range(1, THREADS * per_thread + 1)), "two adds returned the same total"
    assert clients[0].get(key).value == str(THREADS * per_thread).encode()


def test_concurrent_cas_has_one_winner(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    clients = [kv_factory() for _ in range(THREADS)]
    key = key_prefix + "cas"
    for round_ in range(5):
        base = clients[0].put(key, f"base{round_}".encode())
        results = run_threads(
            THREADS, lambda i: clients[i].compare_and_swap(key, f"{round_}:{i}".encode(), base.revision)
        )
        winners = [r for r in results if isinstance(r, Entry)]
        losers = [r for r in results if not isinstance(r, Entry)]
        assert len(winners) == 1, results
        assert all(isinstance(r, CompareFailed) for r in losers), losers
        assert clients[0].get(key) == winners[0]


def test_concurrent_create_has_one_winner(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    clients = [kv_factory() for _ in range(THREADS)]
    for round_ in range(5):
        key = f"{key_prefix}create{round_}"
        results = run_threads(THREADS, lambda i: clients[i].create(key, str(i).encode()))
        winners = [r for r in results if isinstance(r, Entry)]
        assert len(winners) == 1, results
        assert all(isinstance(r, KeyExists) for r in results if r is not winners[0]), results
        assert clients[0].get(key) == winners[0]


def test_concurrent_compare_and_delete_has_one_winner(
    kv_factory: Callable[[], KVBackend], key_prefix: str
) -> None:
    clients = [kv_factory() for _ in range(THREADS)]
    key = key_prefix + "cad"
    for _ in range(5):
        entry = clients[0].put(key, b"x")
        results = run_threads(THREADS, lambda i: clients[i].compare_and_delete(key, entry.revision))
        assert results.count(None) == 1, results
        assert all(isinstance(r, (KeyNotFound, CompareFailed)) for r in results if r is not None), results
        assert clients[0].get(key) is None
