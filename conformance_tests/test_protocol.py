"""The ``protocol`` group: every operation of :class:`rdzv_core.kv.KVBackend` but TTLs and watches
(``test_protocol_ttl_watch.py``), as its docstrings say.

Backend-independent: revisions are compared only with each other (a shared
server advances them for other tests too), every test writes below its own
``key_prefix``, and optional abilities (value limits, compaction) become skips
with a reason. Waits are watches with deadlines, never bare sleeps. Every
failure message names the contract of :mod:`rdzv_core.kv` that was broken.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest

from rdzv_core import (
    BackendClosedError,
    CompareFailedError,
    Entry,
    Event,
    EventType,
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

from .agents import run_threads
from .protocol_checks import PUT, THREADS, collect, head, raises

pytestmark = pytest.mark.protocol


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
