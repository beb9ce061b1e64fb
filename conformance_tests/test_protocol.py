"""The ``protocol`` group: every operation of :class:`rdzv_core.kv.KVBackend`, as its docstrings say.

Backend-independent: revisions are compared only with each other (a shared
server advances them for other tests too), every test writes below its own
``key_prefix``, and optional abilities (value limits, compaction) become skips
with a reason. Waits are watches with deadlines, never bare sleeps. Every
failure message names the contract of :mod:`rdzv_core.kv` that was broken.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from rdzv_core import (
    BackendClosedError,
    CompareFailedError,
    Entry,
    Event,
    EventType,
    HistoryCompactedError,
    InvalidKeyError,
    KeyExistsError,
    KeyNotFoundError,
    KVBackend,
    KVError,
    ValueTooLargeError,
    escape_segment,
    unescape_segment,
)
from rdzv_core.errors import InvalidArgumentError

from .agents import quiet, run_threads

pytestmark = pytest.mark.protocol

PUT, DELETE = EventType.PUT, EventType.DELETE
#: Slack (seconds) on top of ``ttl_resolution`` for a loaded 2-core machine.
MARGIN = 1.0
#: Upper bound (seconds) for anything that should happen "promptly".
PATIENCE = 15.0
TTL = 0.4
THREADS = 8


# -- helpers -------------------------------------------------------------------
@contextlib.contextmanager
def raises(expected: type[BaseException], contract: str) -> Iterator[Any]:
    """``pytest.raises(expected)`` whose failure names the broken ``contract`` (str)."""
    try:
        with pytest.raises(expected) as info:
            yield info
        return
    except pytest.fail.Exception:  # pytest's "DID NOT RAISE"
        pass
    except Exception as other:
        raise AssertionError(f"{contract} (raised {type(other).__name__}: {other})") from other
    pytest.fail(f"{contract} (nothing was raised)")


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


def head(kv: KVBackend, prefix: str) -> int:
    """The keyspace revision now (read through ``list``)."""
    return kv.list(prefix)[1]


def ttl_deadline(capabilities: Any, ttl: float) -> float:
    """Latest acceptable time (seconds after the write began) to observe an expiry."""
    return ttl + capabilities.ttl_resolution + MARGIN


# -- get / put / list ------------------------------------------------------------
def test_get_absent_is_none(kv: KVBackend, key_prefix: str) -> None:
    assert kv.get(key_prefix + "nothing") is None, "get of an absent key must return None"


def test_put_get_roundtrip(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    writer, reader = kv_factory(), kv_factory()
    entry = writer.put(key_prefix + "k", b"v1")
    assert entry == Entry(key_prefix + "k", b"v1", entry.revision), "put must return the entry it wrote"
    assert isinstance(entry.revision, int) and entry.revision > 0, "revisions are positive ints"
    assert writer.get(key_prefix + "k") == entry, "get must return what put wrote"
    assert reader.get(key_prefix + "k") == entry, "a second client must read the first one's write"


def test_put_overwrites_and_advances_revision(kv: KVBackend, key_prefix: str) -> None:
    first = kv.put(key_prefix + "k", b"one")
    second = kv.put(key_prefix + "k", b"two")
    assert second.revision > first.revision, "every write must advance the revision"
    assert kv.get(key_prefix + "k") == Entry(key_prefix + "k", b"two", second.revision), "get must return the last put"


def test_revisions_increase_across_keys(kv: KVBackend, key_prefix: str) -> None:
    revisions = [kv.put(f"{key_prefix}k{i}", b"x").revision for i in range(5)]
    assert revisions == sorted(set(revisions)), "revisions must increase strictly with every write, across keys"


def test_list_sorted_with_revision_at_read_time(kv: KVBackend, key_prefix: str) -> None:
    names = ["b", "a", "A", "0", "_", "~", "a.b", "a-b", "a=b", "a%2F", "a+b", "a:b", "a@b", "Z9", "a/x", "a/x/y"]
    random.Random(7).shuffle(names)
    written = [kv.put(key_prefix + n, n.encode()) for n in names]
    entries, revision = kv.list(key_prefix)
    assert [e.key for e in entries] == sorted(key_prefix + n for n in names), "list must return every key, sorted"
    assert {e.key: e for e in entries} == {e.key: e for e in written}, "list must return each entry as last written"
    assert revision >= max(e.revision for e in written), "list's revision predates writes it returned"
    later = kv.put(key_prefix + "later", b"x")
    assert kv.list(key_prefix)[1] >= later.revision, "list's revision predates a write made before it"


def test_list_prefix_boundaries(kv: KVBackend, key_prefix: str) -> None:
    inside = ["a/b", "a/b/c", "a/~", "a/0"]
    outside = ["a", "a-b", "a.b", "a0", "a~", "ab/c", "b/a/b"]
    for name in inside + outside:
        kv.put(key_prefix + name, b"x")
    assert [e.key for e in kv.list(key_prefix + "a/")[0]] == sorted(key_prefix + n for n in inside), (
        "list(prefix) must return exactly the keys that start with prefix"
    )
    assert kv.list(key_prefix + "zzz/")[0] == [], "list of an empty prefix must be []"


def test_list_empty_prefix_is_whole_keyspace(kv: KVBackend, key_prefix: str) -> None:
    mine = {kv.put(key_prefix + n, b"x").key for n in ("y", "x")}
    entries, revision = kv.list("")
    keys = [e.key for e in entries]
    assert keys == sorted(keys), "list('') must be sorted by key"
    assert mine <= set(keys), "list('') must return the whole keyspace"
    assert revision > 0, "list's revision must be positive once something was written"


def test_list_excludes_deleted(kv: KVBackend, key_prefix: str) -> None:
    kv.put(key_prefix + "a", b"1")
    kv.put(key_prefix + "b", b"2")
    kv.delete(key_prefix + "a")
    assert [e.key for e in kv.list(key_prefix)[0]] == [key_prefix + "b"], "list must not return deleted keys"


# -- create ---------------------------------------------------------------------
def test_create_only_if_absent(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    entry = kv.create(key, b"first")
    assert entry == Entry(key, b"first", entry.revision), "create must return the entry it wrote"
    with raises(KeyExistsError, "create on a present key must raise KeyExistsError"):
        kv.create(key, b"second")
    assert kv.get(key) == entry, "a failed create must not change the key"


def test_create_after_delete(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    first = kv.create(key, b"1")
    assert kv.delete(key), "delete of a present key must return True"
    second = kv.create(key, b"2")
    assert second.revision > first.revision and kv.get(key) == second, "create after delete must write anew"


# -- compare-and-swap / compare-and-delete ------------------------------------------
def test_cas_success_advances_revision(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    old = kv.put(key, b"old")
    new = kv.compare_and_swap(key, b"new", old.revision)
    assert new.key == key and new.value == b"new" and new.revision > old.revision, (
        "compare_and_swap with the current revision must write, with a larger revision"
    )
    assert kv.get(key) == new, "get must return what compare_and_swap wrote"


def test_cas_stale_revision_fails(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    old = kv.put(key, b"old")
    current = kv.put(key, b"current")
    with raises(CompareFailedError, "compare_and_swap with a stale revision must raise CompareFailedError") as info:
        kv.compare_and_swap(key, b"lost", old.revision)
    assert info.value.actual_revision in (None, current.revision), "CompareFailedError.actual_revision is wrong"
    assert kv.get(key) == current, "a failed CAS must not change the key"


def test_cas_absent_key(kv: KVBackend, key_prefix: str) -> None:
    other = kv.put(key_prefix + "other", b"x")
    with raises(KeyNotFoundError, "compare_and_swap on a never-written key must raise KeyNotFoundError"):
        kv.compare_and_swap(key_prefix + "never", b"x", other.revision)
    gone = kv.put(key_prefix + "gone", b"x")
    kv.delete(key_prefix + "gone")
    with raises(KeyNotFoundError, "compare_and_swap on a deleted key must raise KeyNotFoundError"):
        kv.compare_and_swap(key_prefix + "gone", b"x", gone.revision)
    assert kv.get(key_prefix + "never") is None and kv.get(key_prefix + "gone") is None, (
        "a failed compare_and_swap must not create the key"
    )


def test_compare_and_delete(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    old = kv.put(key, b"old")
    current = kv.put(key, b"current")
    with raises(CompareFailedError, "compare_and_delete with a stale revision must raise CompareFailedError"):
        kv.compare_and_delete(key, old.revision)
    assert kv.get(key) == current, "a failed compare_and_delete must not change the key"
    kv.compare_and_delete(key, current.revision)
    assert kv.get(key) is None, "compare_and_delete with the current revision must delete"
    with raises(KeyNotFoundError, "compare_and_delete on an absent key must raise KeyNotFoundError"):
        kv.compare_and_delete(key, current.revision)


# -- delete ---------------------------------------------------------------------
def test_delete_reports_existence(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "k"
    kv.put(key, b"x")
    assert kv.delete(key) is True, "delete of a present key must return True"
    assert kv.get(key) is None, "a deleted key must read as None"
    assert kv.delete(key) is False, "delete of an absent key must return False"


def test_delete_is_not_recursive(kv: KVBackend, key_prefix: str) -> None:
    kv.put(key_prefix + "a", b"1")
    kv.put(key_prefix + "a/b", b"2")
    assert kv.delete(key_prefix + "a"), "delete of a present key must return True"
    assert kv.get(key_prefix + "a/b") is not None, "delete must not be recursive"


# -- add ------------------------------------------------------------------------
def test_add_counts_from_zero_and_stores_ascii(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "n"
    assert kv.add(key, 5) == 5, "add on an absent key must count from 0"
    assert kv.get(key).value == b"5", "add must store ASCII decimal"
    assert kv.add(key, -7) == -2, "add must return the sum"
    assert kv.get(key).value == b"-2", "add must store ASCII decimal"
    assert kv.add(key, 0) == -2, "add(0) must return the current value"
    assert kv.add(key, 2**40) == 2**40 - 2, "add must not overflow below 64 bits"
    assert kv.get(key).value == str(2**40 - 2).encode("ascii"), "add must store ASCII decimal"


def test_add_on_put_decimal_and_revision(kv: KVBackend, key_prefix: str) -> None:
    key = key_prefix + "n"
    before = kv.put(key, b"41")
    assert kv.add(key, 1) == 42, "add must read a decimal value written by put"
    after = kv.get(key)
    assert after.value == b"42" and after.revision > before.revision, "add is a write: it must advance the revision"


@pytest.mark.parametrize("bad", [b"abc", b"", b"1.5", b"\xff\x00", b"x1"])
def test_add_on_non_integer_fails(kv: KVBackend, key_prefix: str, bad: bytes) -> None:
    key = key_prefix + "n"
    entry = kv.put(key, bad)
    with raises(KVError, f"add on the non-decimal value {bad!r} must raise KVError"):
        kv.add(key, 1)
    assert kv.get(key) == entry, "a failed add must not change the key"


# -- tickets ----------------------------------------------------------------------------
def test_tickets_count_from_one_and_restart_after_delete(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    key = key_prefix + "t"
    assert kv.tickets(key) == 0, "no ticket was taken at an absent key"
    assert [kv.take_ticket(key) for _ in range(3)] == [1, 2, 3], "tickets must count 1, 2, 3, ..."
    assert kv.tickets(key) == 3, "tickets() must count the tickets taken"
    if capabilities.tickets_in_value:
        assert kv.get(key).value == b"3", "tickets_in_value: the key holds the count as an add counter"
    assert [e.key for e in kv.list(key_prefix)[0]] == [key], "a ticket key is one key in a listing"
    assert kv.delete(key) is True, "delete must remove a ticket key"
    assert kv.tickets(key) == 0 and kv.take_ticket(key) == 1, "after delete, tickets must start again at 1"


def test_taking_a_ticket_is_a_change_a_watch_sees(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    kv, watcher = kv_factory(), kv_factory()
    key = key_prefix + "w/t"
    after = head(kv, key_prefix)
    kv.take_ticket(key)
    events = watcher.watch(key_prefix, after, 10)
    assert [(e.type, e.key) for e in events][:1] == [(EventType.PUT, key)], f"a ticket must be a PUT event: {events}"
    second = watcher.list(key_prefix)[1]
    kv.take_ticket(key)
    assert watcher.watch(key_prefix, second, 10), "every ticket taken must be a change a watch sees"


def test_concurrent_tickets_are_each_taken_once(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    per_thread = 25
    clients = [kv_factory() for _ in range(THREADS)]
    key = key_prefix + "tickets"
    results = run_threads(THREADS, lambda i: [clients[i].take_ticket(key) for _ in range(per_thread)])
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"concurrent take_ticket raised: {errors}"
    taken = sorted(t for r in results for t in r)
    assert taken == list(range(1, THREADS * per_thread + 1)), "each ticket must be handed out exactly once"
    assert clients[0].tickets(key) == THREADS * per_thread, "tickets() must count every ticket taken"


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


# -- values and keys ----------------------------------------------------------------
def test_binary_and_empty_values(kv: KVBackend, key_prefix: str) -> None:
    after = head(kv, key_prefix)
    blob = bytes(range(256)) * 4
    kv.put(key_prefix + "bin", blob)
    kv.put(key_prefix + "empty", b"")
    kv.create(key_prefix + "nul", b"\x00")
    assert kv.get(key_prefix + "bin").value == blob, "values are bytes: every byte must round-trip"
    empty = kv.get(key_prefix + "empty")
    assert empty is not None and empty.value == b"", "an empty value is a present key"
    assert kv.get(key_prefix + "nul").value == b"\x00", "values are bytes: NUL must round-trip"
    assert [e.value for e in kv.list(key_prefix)[0]] == [blob, b"", b"\x00"], "list must return values unchanged"
    assert [e.value for e in collect(kv, key_prefix, after, 3)] == [blob, b"", b"\x00"], (
        "watch must return values unchanged"
    )


def test_value_accepts_bytearray_and_memoryview(kv: KVBackend, key_prefix: str) -> None:
    assert kv.put(key_prefix + "a", bytearray(b"ba")).value == b"ba", "values may be given as bytearray"
    assert kv.put(key_prefix + "m", memoryview(b"mv")).value == b"mv", "values may be given as memoryview"
    assert kv.get(key_prefix + "a").value == b"ba", "a bytearray value must be stored as bytes"
    with raises(InvalidArgumentError, "a str value must raise InvalidArgumentError"):
        kv.put(key_prefix + "s", "text")  # type: ignore[arg-type]


def test_one_mebibyte_value(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    size = 1 << 20
    if capabilities.max_value_bytes is not None and capabilities.max_value_bytes < size:
        pytest.skip(f"backend declares max_value_bytes={capabilities.max_value_bytes} < 1 MiB")
    blob = random.Random(1).randbytes(size)
    entry = kv.put(key_prefix + "big", blob)
    assert kv.get(key_prefix + "big") == entry and entry.value == blob, "a 1 MiB value must round-trip"
    assert collect(kv, key_prefix, entry.revision - 1, 1)[0].value == blob, "watch must carry a 1 MiB value"


def test_value_too_large_writes_nothing(kv: KVBackend, key_prefix: str, capabilities: Any) -> None:
    limit = capabilities.max_value_bytes
    if limit is None:
        pytest.skip("backend declares no max_value_bytes (unlimited values): nothing to reject")
    if limit > 256 * 1024 * 1024:
        pytest.skip(f"backend declares max_value_bytes={limit}: too large to allocate in a test")
    key = key_prefix + "k"
    existing = kv.put(key, b"small")
    after = existing.revision
    too_big = b"\0" * (limit + 1)
    for call in (
        lambda: kv.put(key, too_big),
        lambda: kv.create(key_prefix + "new", too_big),
        lambda: kv.compare_and_swap(key, too_big, existing.revision),
    ):
        with raises(ValueTooLargeError, f"a value above max_value_bytes={limit} must raise ValueTooLargeError"):
            call()
    assert kv.get(key) == existing and kv.get(key_prefix + "new") is None, "ValueTooLargeError must write nothing"
    assert kv.watch(key_prefix, after, 0.2) == [], "ValueTooLargeError must write nothing"


HOSTILE = [b"", b"\x00", b"/", b"//", b".", b"..", b"../x", b"\xff\xfe", "ü/ß".encode(), b"%", b"%25", b"_",
           b"*", b"?", b"a b", b"=", b"=61", b"a", b"A", b"\\", b"'", b'"; DROP TABLE kv; --', b"\n"]


def test_hostile_segments_round_trip_without_collisions(kv: KVBackend, key_prefix: str) -> None:
    keys = {raw: key_prefix + "u/" + escape_segment(raw) + "/v" for raw in HOSTILE}
    assert len(set(keys.values())) == len(HOSTILE), "escape_segment must not map two inputs to one segment"
    for raw, key in keys.items():
        kv.create(key, raw)
    entries, _ = kv.list(key_prefix + "u/")
    assert len(entries) == len(HOSTILE), "escaped keys collided in the backend"
    assert {unescape_segment(e.key.split("/")[-2]): e.value for e in entries} == {r: r for r in HOSTILE}, (
        "escaped keys must round-trip through the backend"
    )
    for raw, key in keys.items():
        assert kv.get(key).value == raw, f"get of the escaped key for {raw!r} returned another value"
    assert escape_segment("ü/ß") == escape_segment("ü/ß".encode()), "escape_segment(str) must equal its UTF-8 bytes"


def test_sql_and_glob_wildcards_in_prefixes_are_literal(kv: KVBackend, key_prefix: str) -> None:
    seg = escape_segment(b"a_%")  # "=a_%25": '_' and '%' are LIKE wildcards
    p = key_prefix + seg + "/"
    after = head(kv, key_prefix)
    decoys = [key_prefix + "=aX%25/k", key_prefix + "=a_zz25/k", key_prefix + "=a_%25x/k", key_prefix + "=a_%25"]
    for d in decoys:
        kv.put(d, b"decoy")
    mine = kv.put(p + "k", b"mine")
    assert kv.list(p)[0] == [mine], "list(prefix) must treat SQL/glob wildcards in the prefix literally"
    assert collect(kv, p, after, 1) == [Event(PUT, p + "k", mine.revision, b"mine")], (
        "watch(prefix) must treat SQL/glob wildcards in the prefix literally"
    )


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
            with raises(InvalidKeyError, f"the invalid key {bad!r} must raise InvalidKeyError"):
                call()
    assert kv.watch(key_prefix, revision, 0) == [], "a rejected call wrote something"


def test_invalid_prefixes_rejected(kv: KVBackend, key_prefix: str) -> None:
    for bad in BAD_PREFIXES:
        with raises(InvalidKeyError, f"list of the invalid prefix {bad!r} must raise InvalidKeyError"):
            kv.list(bad)
        with raises(InvalidKeyError, f"watch of the invalid prefix {bad!r} must raise InvalidKeyError"):
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
    with raises(InvalidArgumentError, "an invalid TTL, revision, delta or timeout must raise InvalidArgumentError"):
        call(kv, key)
    assert kv.get(key) is None, "a rejected call must write nothing"


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
        with raises(BackendClosedError, "every call on a closed backend must raise BackendClosedError"):
            call()
    assert other.get(k) == entry, "closing one client must not affect another"
    with kv_factory() as scoped:
        scoped.get(k)
    with raises(BackendClosedError, "leaving a backend's with-block must close it"):
        scoped.get(k)


# -- concurrency ----------------------------------------------------------------------
def test_concurrent_add_loses_nothing(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    per_thread = 25
    clients = [kv_factory() for _ in range(THREADS)]
    key = key_prefix + "counter"
    results = run_threads(THREADS, lambda i: [clients[i].add(key, 1) for _ in range(per_thread)])
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"concurrent add raised: {errors}"
    totals = sorted(t for r in results for t in r)
    assert totals == list(range(1, THREADS * per_thread + 1)), "add must be atomic: two adds returned the same total"
    assert clients[0].get(key).value == str(THREADS * per_thread).encode(), "add must be atomic: an add was lost"


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
        assert len(winners) == 1, (
            f"compare_and_swap must be atomic: exactly one of {THREADS} CAS on one revision may win; got {results}"
        )
        assert all(isinstance(r, CompareFailedError) for r in losers), \
            f"the losing CAS must raise CompareFailedError: {losers}"
        assert clients[0].get(key) == winners[0], "the key must hold the winning CAS"


def test_concurrent_create_has_one_winner(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    clients = [kv_factory() for _ in range(THREADS)]
    for round_ in range(5):
        key = f"{key_prefix}create{round_}"
        results = run_threads(THREADS, lambda i: clients[i].create(key, str(i).encode()))
        winners = [r for r in results if isinstance(r, Entry)]
        assert len(winners) == 1, f"create must be atomic: exactly one of {THREADS} creates may win; got {results}"
        assert all(isinstance(r, KeyExistsError) for r in results if r is not winners[0]), (
            f"the losing creates must raise KeyExistsError: {results}"
        )
        assert clients[0].get(key) == winners[0], "the key must hold the winning create"


def test_concurrent_compare_and_delete_has_one_winner(
    kv_factory: Callable[[], KVBackend], key_prefix: str
) -> None:
    clients = [kv_factory() for _ in range(THREADS)]
    key = key_prefix + "cad"
    for _ in range(5):
        entry = clients[0].put(key, b"x")
        results = run_threads(THREADS, lambda i: clients[i].compare_and_delete(key, entry.revision))
        assert results.count(None) == 1, (
            f"compare_and_delete must be atomic: exactly one of {THREADS} may win; got {results}"
        )
        assert all(isinstance(r, (KeyNotFoundError, CompareFailedError)) for r in results if r is not None), (
            f"the losing compare_and_deletes must raise KeyNotFoundError or CompareFailedError: {results}"
        )
        assert clients[0].get(key) is None, "compare_and_delete must delete"
