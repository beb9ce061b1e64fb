"""The Redis backend beyond the shared suite: URL and TLS options, the Lua/stream log, expiry
bookkeeping, server restarts and faults, namespaces, ACL users — all against real ``redis-server``s.

Servers that a test kills or pauses are its own (function scope); the others are shared per module.
"""

from __future__ import annotations

import shlex
import statistics
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import pytest
import redis

from conformance_tests.redis_server import RedisServer, RedisTLSServer
from rdzv_backends.redis import CAPABILITIES, MAX_VALUE_BYTES, namespace_prefix
from conformance_tests.plugin import backends_opened
from tests.support.servers import serve
from rdzv_core import (
    BackendClosedError,
    BackendConnectionError,
    BackendTimeoutError,
    BackendUnavailableError,
    CompareFailedError,
    CorruptEntryError,
    Event,
    EventType,
    HistoryCompactedError,
    InvalidURLError,
    KeyNotFoundError,
    KVBackend,
    KVError,
    escape_segment,
    list_backends,
    open_backend,
    parse_backend_url,
)
from rdzv_core.kv import parse_counter

PUT, DELETE = EventType.PUT, EventType.DELETE
#: Generous bound (seconds) for anything that should happen "promptly" on a loaded 2-core host.
PATIENCE = 10.0


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A plain server shared by this module's tests that do not disturb it."""
    yield from serve(RedisServer())


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A plain server this test may kill, restart or pause."""
    yield from serve(RedisServer())


@pytest.fixture(scope="module")
def tls_server() -> Iterator[RedisTLSServer]:
    """A TLS-only server; client certificates optional."""
    yield from serve(RedisTLSServer(auth_clients="optional"))


@pytest.fixture(scope="module")
def mtls_server() -> Iterator[RedisTLSServer]:
    """A TLS-only server that requires a client certificate signed by its CA."""
    yield from serve(RedisTLSServer(auth_clients="yes"))


@pytest.fixture
def opened() -> Iterator[Callable[[str], KVBackend]]:
    """``open(url)`` that closes every backend it opened after the test."""
    with backends_opened(lambda url: url) as open_:
        yield open_


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}/"


def raw(server: RedisServer, *command: Any, db: int = 0) -> Any:
    """Run one command on ``server`` with a throw-away redis-py client (to inspect or set up)."""
    with redis.Redis(host=server.host, port=server.port, db=db, socket_timeout=PATIENCE) as client:
        return client.execute_command(*command)


def log_entries(server: RedisServer, namespace: str | None = None) -> list[tuple[int, dict[bytes, bytes]]]:
    """The namespace's event log as ``[(revision, fields)]``."""
    entries = raw(server, "XRANGE", namespace_prefix(namespace) + "#log", "-", "+")
    return [(int(i.split(b"-")[0]), fields) for i, fields in entries]


def watch_until(kv: KVBackend, prefix: str, after: int, done: Callable[[list[Event]], bool],
                timeout: float = PATIENCE) -> list[Event]:
    """Watch ``prefix`` from ``after`` until ``done(events so far)`` or ``timeout``; every event seen."""
    deadline = time.monotonic() + timeout
    seen: list[Event] = []
    while not done(seen) and (remaining := deadline - time.monotonic()) > 0:
        batch = kv.watch(prefix, after, remaining)
        for event in batch:
            assert event.revision > after
            after = event.revision
        seen += batch
    return seen


def deletes_of(events: list[Event]) -> list[Event]:
    return [e for e in events if e.type is DELETE]


# -- registration and URL ----------------------------------------------------------------------
def test_registered_with_declared_capabilities() -> None:
    backends = list_backends()
    assert backends["redis"].spec is backends["rediss"].spec
    caps = backends["redis"].spec.capabilities
    assert caps == CAPABILITIES
    assert (caps.multi_host, caps.server_side_ttl, caps.native_watch, caps.persistent, caps.tls, caps.auth) == (
        True, True, True, True, True, True)
    assert caps.max_value_bytes == MAX_VALUE_BYTES <= 512 * 1024 * 1024


def test_url_defaults_and_query_keys() -> None:
    _, url = parse_backend_url("redis://bob:pw@example.org/run1?db=3&namespace=team-a&operation_timeout=2.5"
                               "&max_connections=8")
    assert url.hosts == (("example.org", 6379),)
    assert url.params == {"db": 3, "namespace": "team-a", "operation_timeout": 2.5, "max_connections": 8}
    assert (url.username, url.password) == ("bob", "pw")


@pytest.mark.parametrize(
    "url, field",
    [
        ("redis://h1:1,h2:2/run", "host"),
        ("redis:///run", "host"),
        ("redis://h/run?db=-1", "db"),
        ("redis://h/run?db=x", "db"),
        ("redis://h/run?max_connections=0", "max_connections"),
        ("redis://h/run?max_connections=many", "max_connections"),
        ("redis://h/run?namespace=", "namespace"),
        ("redis://h/run?cacert=/tmp/ca.pem", "cacert"),
        ("redis://h/run?cert=/tmp/c.pem", "cert"),
        ("rediss://h/run?cacert=/nonexistent/ca.pem", "cacert"),
    ],
)
def test_bad_urls_name_the_field(url: str, field: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        open_backend(url)
    assert info.value.field == field


def test_multi_host_message_says_one_host() -> None:
    with pytest.raises(InvalidURLError, match="one host"):
        open_backend("redis://h1,h2/run")


def test_bad_database_number(server: RedisServer) -> None:
    with pytest.raises(InvalidURLError) as info:
        open_backend(server.url(db="999"))
    assert info.value.field == "db"


def test_database_number_separates_keyspaces(server: RedisServer, opened: Callable[[str], KVBackend],
                                             prefix: str) -> None:
    db0, db1 = opened(server.url()), opened(server.url(db="1"))
    db1.put(prefix + "k", b"in db 1")
    assert db0.get(prefix + "k") is None and db1.get(prefix + "k").value == b"in db 1"
    assert raw(server, "EXISTS", "rdzv:k/" + prefix + "k", db=1) == 1


# -- the stored layout and the log ---------------------------------------------------------------
def test_every_revision_is_logged_once_in_order(server: RedisServer, opened: Callable[[str], KVBackend],
                                                prefix: str) -> None:
    """Mixed writes, expiries and a key Redis deleted behind our back: every revision logged once, chained."""
    ns = "log-" + uuid.uuid4().hex[:8]
    kv = opened(server.url(namespace=ns))
    kv.put(prefix + "a", b"1")
    kv.create(prefix + "b", b"2", ttl=0.05)
    e = kv.put(prefix + "c", b"3")
    kv.compare_and_swap(prefix + "c", b"4", e.revision)
    kv.add(prefix + "n", 2)
    kv.refresh(prefix + "a", 30)  # no event
    kv.delete(prefix + "a")
    kv.put(prefix + "gone", b"x")
    raw(server, "DEL", namespace_prefix(ns) + "k/" + prefix + "gone")  # as eviction would
    listed = [e.key for e in kv.list(prefix)[0] if e.key != prefix + "b"]  # b may not have expired yet
    assert listed == [prefix + "c", prefix + "n"]  # and list recorded "gone" as deleted
    events = watch_until(kv, prefix, 0, lambda seen: len(deletes_of(seen)) >= 3)
    _, revision = kv.list("")
    log = log_entries(server, ns)
    revs = [rev for rev, _ in log]
    assert revs == sorted(set(revs)) and revs[-1] == revision
    assert [int(f[b"p"]) for _, f in log] == [0] + revs[:-1]  # each entry names its predecessor
    assert [e.revision for e in events] == revs
    assert sorted(e.key for e in deletes_of(events)) == [prefix + "a", prefix + "b", prefix + "gone"]
    stored = raw(server, "HGETALL", namespace_prefix(ns) + "k/" + prefix + "n")
    assert stored == {b"v": b"2", b"r": str(kv.get(prefix + "n").revision).encode()}


def test_all_redis_keys_stay_in_the_namespace(server: RedisServer, opened: Callable[[str], KVBackend]) -> None:
    ns = "scan-" + uuid.uuid4().hex[:8]
    kv = opened(server.url(namespace=ns))
    kv.put("a/b", b"1", ttl=60)
    kv.add("a/n", 1)
    kv.watch("", 0, 0)
    names = {k.decode() for k in raw(server, "KEYS", "*" + ns + "*")}
    assert names and all(n.startswith(f"rdzv:{ns}:") for n in names)
    assert {n for n in names if "k/" not in n} <= {f"rdzv:{ns}:#rev", f"rdzv:{ns}:#log", f"rdzv:{ns}:#keys",
                                                     f"rdzv:{ns}:#ttl", f"rdzv:{ns}:#add", f"rdzv:{ns}:#epoch",
                                                     f"rdzv:{ns}:#last"}


def test_add_reads_decimal_values_like_parse_counter(server: RedisServer, opened: Callable[[str], KVBackend],
                                                     prefix: str) -> None:
    kv = opened(server.url())
    for raw in [b"7", b"-7", b"007", b"-0", b"-007", b"9223372036854775806"]:
        kv.put(prefix + "k", raw)
        assert kv.add(prefix + "k", 1) == parse_counter("k", raw) + 1
        assert kv.get(prefix + "k").value == str(parse_counter("k", raw) + 1).encode()
    for raw in [b"", b"1.5", b"0x10", b"+7", b" 7", b"1_0", b"--1", b"one", b"\xff", b"1" * 31]:
        kv.put(prefix + "k", raw)
        with pytest.raises(CorruptEntryError) as info:
            kv.add(prefix + "k", 1)
        assert info.value.key == prefix + "k"
        assert kv.get(prefix + "k").value == raw  # untouched
    kv.put(prefix + "k", b"9223372036854775807")
    before = kv.get(prefix + "k")
    with pytest.raises(KVError, match="64-bit"):
        kv.add(prefix + "k", 1)
    with pytest.raises(KVError, match="64-bit"):
        kv.add(prefix + "k2", 2**63)
    assert kv.get(prefix + "k") == before and kv.get(prefix + "k2") is None


def test_add_keeps_the_ttl(server: RedisServer, opened: Callable[[str], KVBackend], prefix: str) -> None:
    kv = opened(server.url())
    kv.put(prefix + "n", b"1", ttl=30)
    assert kv.add(prefix + "n", 1) == 2
    assert 0 < raw(server, "PTTL", "rdzv:k/" + prefix + "n") <= 30_000


# -- watch ---------------------------------------------------------------------------------------
def test_watch_wakes_within_50ms_of_a_change(server: RedisServer, opened: Callable[[str], KVBackend],
                                             prefix: str) -> None:
    """Outcome, not benchmark: the median wake-up over 7 changes is under 50 ms, none over a second."""
    watcher, writer = opened(server.url()), opened(server.url())
    delays: list[float] = []
    for i in range(7):
        _, after = watcher.list(prefix)
        woke: list[float] = []
        ready = threading.Event()

        def watch() -> None:
            ready.set()
            if watcher.watch(prefix, after, PATIENCE):
                woke.append(time.monotonic())

        thread = threading.Thread(target=watch)
        thread.start()
        ready.wait(PATIENCE)
        time.sleep(0.05)  # let the watcher block in XREAD (a missed start only makes it faster)
        written = time.monotonic()
        writer.put(prefix + "k", str(i).encode())
        thread.join(PATIENCE)
        assert woke, "watch did not see the change"
        delays.append(woke[0] - written)
    assert statistics.median(delays) < 0.05, delays
    assert max(delays) < 1.0, delays


def test_close_ends_watches_promptly_whenever_it_comes(server: RedisServer) -> None:
    """close() at any moment of a watch (before it began, polling, about to block, blocked) ends it within a
    second, returning [] or raising BackendClosedError (the protocol's contract)."""
    for i in range(20):
        kv = open_backend(server.url())
        _, after = kv.list("nothing/")
        ended: list[float] = []

        def watch(kv: KVBackend = kv) -> None:
            try:
                kv.watch("nothing/", after, PATIENCE)
            except BackendClosedError:
                pass  # close() came before the watch began (a thread started late): later calls raise
            ended.append(time.monotonic())

        thread = threading.Thread(target=watch)
        thread.start()
        time.sleep(0.001 * i)
        closed = time.monotonic()
        kv.close()
        thread.join(PATIENCE)
        assert ended and ended[0] - closed < 1.0


def test_expiry_is_seen_promptly_and_never_early(server: RedisServer, opened: Callable[[str], KVBackend],
                                                 prefix: str) -> None:
    kv = opened(server.url())
    ttl = 0.3
    started = time.monotonic()
    entry = kv.put(prefix + "k", b"v", ttl=ttl)
    events = watch_until(kv, prefix, entry.revision, deletes_of)
    seen = time.monotonic()
    assert [(e.type, e.key) for e in events] == [(DELETE, prefix + "k")]
    assert seen - started >= ttl, "expired before its TTL"
    # 0.5 s of slack for a loaded machine on top of the declared resolution.
    assert seen - started - ttl < CAPABILITIES.ttl_resolution + 0.5


def test_each_expiry_recorded_once_with_many_watchers(server: RedisServer, opened: Callable[[str], KVBackend],
                                                      prefix: str) -> None:
    """Three clients watch (and so sweep) concurrently while 20 keys expire: one DELETE per key, same revision."""
    keys = [f"{prefix}k{i:02d}" for i in range(20)]
    watchers = [opened(server.url()) for _ in range(3)]
    writer = opened(server.url())
    _, after = writer.list(prefix)
    for i, key in enumerate(keys):
        writer.put(key, b"x", ttl=0.2 + 0.02 * i)
    results: list[list[Event]] = [[] for _ in watchers]

    def collect(i: int) -> None:
        results[i] = watch_until(watchers[i], prefix, after, lambda seen: len(deletes_of(seen)) >= len(keys))

    threads = [threading.Thread(target=collect, args=(i,)) for i in range(len(watchers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE * 2)
    for events in results:
        assert sorted(e.key for e in deletes_of(events)) == keys
    assert results[0] == results[1] == results[2]
    # The log agrees: exactly one 'd' per key, and nothing more arrives later.
    assert writer.watch(prefix, results[0][-1].revision, 0.3) == []
    d_keys = [f[b"k"].decode() for _, f in log_entries(server) if f[b"t"] == b"d" and f[b"k"].startswith(
        prefix.encode())]
    assert sorted(d_keys) == keys


def test_expiry_without_watchers_is_recorded_by_the_next_read(server: RedisServer,
                                                               opened: Callable[[str], KVBackend],
                                                               prefix: str) -> None:
    kv = opened(server.url())
    entry = kv.put(prefix + "k", b"v", ttl=0.1)
    deadline = time.monotonic() + PATIENCE
    while kv.get(prefix + "k") is not None:  # Redis hides it at its deadline; nobody has swept yet
        assert time.monotonic() < deadline
        time.sleep(0.02)
    entries, revision = kv.list(prefix)
    assert entries == []
    events = kv.watch(prefix, entry.revision, 0)
    assert [(e.type, e.key) for e in events] == [(DELETE, prefix + "k")]
    assert events[0].revision <= revision  # the revision list returned already counts the expiry


def test_write_after_expiry_records_the_delete_first(server: RedisServer, opened: Callable[[str], KVBackend],
                                                     prefix: str) -> None:
    kv = opened(server.url())
    first = kv.put(prefix + "k", b"old", ttl=0.05)
    deadline = time.monotonic() + PATIENCE
    while kv.get(prefix + "k") is not None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    second = kv.create(prefix + "k", b"new")
    events = kv.watch(prefix, first.revision, 0)
    assert [e.type for e in events] == [DELETE, PUT]
    assert first.revision < events[0].revision < events[1].revision == second.revision


def test_refresh_extends_server_ttl_without_event(server: RedisServer, opened: Callable[[str], KVBackend],
                                                  prefix: str) -> None:
    kv = opened(server.url())
    entry = kv.put(prefix + "k", b"v", ttl=1.0)
    kv.refresh(prefix + "k", 60)
    assert kv.get(prefix + "k") == entry
    assert 1_000 < raw(server, "PTTL", "rdzv:k/" + prefix + "k") <= 60_000
    assert kv.watch(prefix, entry.revision, 0) == []
    kv.delete(prefix + "k")
    with pytest.raises(KeyNotFoundError):
        kv.refresh(prefix + "k", 1)


# -- corrupt storage: data another tool wrote --------------------------------------------------
@pytest.fixture
def fresh(server: RedisServer, opened: Callable[[str], KVBackend]) -> tuple[KVBackend, str]:
    """A backend on a namespace of its own (corrupting it disturbs no other test), and that namespace's prefix."""
    ns = "bad-" + uuid.uuid4().hex[:8]
    return opened(server.url(namespace=ns, operation_timeout="5")), namespace_prefix(ns)


#: What another tool may leave at a store key's Redis key (``NSk/KEY``): redis-cli commands after the key.
DATA_PLANTS = {
    "list": ("LPUSH", "x"),
    "set": ("SADD", "x"),
    "string": ("SET", "x"),
    "zset": ("ZADD", "1", "x"),
    "stream": ("XADD", "*", "f", "x"),
    "hash-foreign": ("HSET", "foo", "bar"),
    "hash-without-revision": ("HSET", "v", "x"),
    "hash-non-decimal-revision": ("HSET", "v", "x", "r", "12ab"),
}


def key_ops(kv: KVBackend, key: str) -> dict[str, Callable[[], Any]]:
    """Every operation on one key."""
    return {
        "get": lambda: kv.get(key),
        "create": lambda: kv.create(key, b"v"),
        "put": lambda: kv.put(key, b"v"),
        "put-ttl": lambda: kv.put(key, b"v", ttl=30),
        "compare_and_swap": lambda: kv.compare_and_swap(key, b"v", 1),
        "compare_and_delete": lambda: kv.compare_and_delete(key, 1),
        "refresh": lambda: kv.refresh(key, 30),
        "add": lambda: kv.add(key, 1),
    }


def snapshot(server: RedisServer, ns: str) -> dict[str, Any]:
    """Every Redis key of namespace ``ns`` with its type and content (to show that nothing was written)."""
    out: dict[str, Any] = {}
    for name in sorted(raw(server, "KEYS", ns.replace("[", "\\[") + "*")):
        kind = raw(server, "TYPE", name)
        dump = {b"string": ("GET",), b"list": ("LRANGE", 0, -1), b"set": ("SMEMBERS",), b"hash": ("HGETALL",),
                b"zset": ("ZRANGE", 0, -1, "WITHSCORES"), b"stream": ("XRANGE", "-", "+")}[kind]
        out[name.decode()] = (kind, raw(server, dump[0], name, *dump[1:]))
    return out


@pytest.mark.parametrize("indexed", [False, True], ids=["unindexed", "indexed"])
@pytest.mark.parametrize("plant", sorted(DATA_PLANTS))
def test_wrong_data_at_a_key_is_corrupt_entry_and_delete_recovers(server: RedisServer, fresh: tuple[KVBackend, str],
                                                                   plant: str, indexed: bool) -> None:
    """Every operation meeting it raises CorruptEntryError naming the key and writes nothing; delete clears it."""
    kv, ns = fresh
    key = "run/state/round"
    if indexed:  # a key this backend wrote, then overwritten by another tool
        kv.put(key, b"ours")
        raw(server, "DEL", ns + "k/" + key)
    raw(server, DATA_PLANTS[plant][0], ns + "k/" + key, *DATA_PLANTS[plant][1:])
    before = snapshot(server, ns)
    for name, op in key_ops(kv, key).items():
        with pytest.raises(CorruptEntryError) as info:
            op()
        assert info.value.key == key, name
        assert snapshot(server, ns) == before, f"{name} wrote something"
    if indexed:  # list meets it too (unindexed, list does not see it at all)
        with pytest.raises(CorruptEntryError) as info:
            kv.list("run/")
        assert info.value.key == key
    else:
        assert kv.list("run/")[0] == []
    _, revision = kv.list("nothing/")
    assert kv.delete(key) is True
    assert kv.get(key) is None and kv.list("run/")[0] == []
    entry = kv.put(key, b"fresh")
    assert kv.get(key) == entry and kv.list("run/")[0] == [entry] and kv.add("run/n", 2) == 2
    assert [e.type for e in kv.watch("run/", revision, 0) if e.key == key] == [DELETE, PUT]


def test_reset_style_cleanup_deletes_every_corrupt_key(server: RedisServer, fresh: tuple[KVBackend, str]) -> None:
    """``list`` names one corrupt key at a time; deleting each (as ``rdzv reset`` does) empties the prefix."""
    kv, ns = fresh
    keys = [f"run/k{i}" for i in range(4)]
    for key in keys:
        kv.put(key, b"ours")
    for key, plant in zip(keys[:3], ("list", "string", "hash-without-revision"), strict=True):
        raw(server, "DEL", ns + "k/" + key)
        raw(server, DATA_PLANTS[plant][0], ns + "k/" + key, *DATA_PLANTS[plant][1:])
    named = []
    while True:
        try:
            entries, _ = kv.list("run/")
            break
        except CorruptEntryError as exc:
            assert exc.key not in named and exc.key is not None
            named.append(exc.key)
            assert kv.delete(exc.key)
    assert sorted(named) == keys[:3] and [e.key for e in entries] == [keys[3]]


def run_advice(server: RedisServer, exc: CorruptEntryError) -> None:
    """Run the ``redis-cli`` command that ends the message of a bookkeeping CorruptEntryError
    (``redis-cli ... --scan --pattern P | xargs redis-cli ... DEL`` for ``#keys``: the namespace goes)."""
    text = str(exc)
    if "--scan --pattern" in text:
        argv = shlex.split(text[text.index("redis-cli "):text.index(" | xargs")])
        assert argv[:7] == ["redis-cli", "-h", server.host, "-p", str(server.port), "-n", "0"], argv
        for name in raw(server, "KEYS", argv[9]):
            raw(server, "DEL", name)
        return
    argv = shlex.split(text[text.rindex("redis-cli "):])
    assert argv[:7] == ["redis-cli", "-h", server.host, "-p", str(server.port), "-n", "0"], argv
    raw(server, *argv[7:])


#: Corrupt bookkeeping: (redis-cli commands, with NS for the namespace; the operations that meet it).
WRITES = ("put", "create", "add", "delete-present")
BOOK_PLANTS: dict[str, tuple[list[tuple[str, ...]], tuple[str, ...]]] = {
    "rev-list": ([("DEL", "NS#rev"), ("LPUSH", "NS#rev", "7")], WRITES + ("list", "watch")),
    "rev-not-decimal": ([("SET", "NS#rev", "12ab")], WRITES + ("list", "watch")),
    "rev-too-big": ([("SET", "NS#rev", "9" * 40)], WRITES + ("list", "watch")),
    "epoch-not-decimal": ([("SET", "NS#epoch", "x")], ("watch",)),
    "log-string": ([("DEL", "NS#log"), ("SET", "NS#log", "x")], WRITES + ("watch",)),
    # (Without #last, as a log written before it existed: a watch reads the log to its end.)
    "log-foreign-entry": ([("DEL", "NS#last"), ("XADD", "NS#log", "*", "foo", "bar")], ("watch",)),
    "last-string": ([("DEL", "NS#last"), ("SET", "NS#last", "x")], WRITES + ("watch",)),
    "log-ahead": ([("XADD", "NS#log", "99999999999999999-0", "t", "p", "k", "a", "p", "0", "v", "x")], WRITES),
    "keys-string": ([("DEL", "NS#keys"), ("SET", "NS#keys", "x")], WRITES + ("list", "watch", "delete-absent")),
    "keys-stray-member": ([("ZADD", "NS#keys", "0", "not a key")], ("list",)),
    "keys-binary-member": ([("ZADD", "NS#keys", "0", "\x00\xff")], ("list",)),
    "keys-score": ([("ZADD", "NS#keys", "5", "run/a")], ("list",)),
    "ttl-list": ([("DEL", "NS#ttl"), ("LPUSH", "NS#ttl", "x")], WRITES + ("list", "watch", "delete-absent")),
    "ttl-stray-member": ([("ZADD", "NS#ttl", "0", "not a key")], WRITES + ("list", "watch", "delete-absent")),
}


@pytest.mark.parametrize("plant", sorted(BOOK_PLANTS))
def test_corrupt_bookkeeping_names_the_redis_key_and_its_removal_recovers(
        server: RedisServer, fresh: tuple[KVBackend, str], plant: str) -> None:
    """Each operation meeting it raises CorruptEntryError(key=None) at once, writing nothing; running the
    redis-cli command at the end of the message (DEL or ZREM) makes every operation work again."""
    kv, ns = fresh
    kv.put("run/a", b"1")
    kv.put("run/b", b"2", ttl=60)
    commands, meeting = BOOK_PLANTS[plant]
    for command in commands:
        raw(server, *(part.replace("NS", ns) for part in command))
    ops: dict[str, Callable[[], Any]] = {
        "put": lambda: kv.put("run/c", b"3"),
        "create": lambda: kv.create("run/d", b"4"),
        "add": lambda: kv.add("run/n", 1),
        "delete-present": lambda: kv.delete("run/a"),
        "delete-absent": lambda: kv.delete("run/none"),
        "list": lambda: kv.list(""),
        "watch": lambda: kv.watch("run/", 0, PATIENCE),
    }
    before = snapshot(server, ns)
    error: CorruptEntryError | None = None
    for name in meeting:
        started = time.monotonic()
        with pytest.raises(CorruptEntryError) as info:
            ops[name]()
        assert time.monotonic() - started < 2.0, f"{name} took long"
        assert info.value.key is None, name
        assert snapshot(server, ns) == before, f"{name} wrote something"
        error = info.value
    assert error is not None
    run_advice(server, error)
    entries, revision = kv.list("")
    assert kv.put("run/c", b"3").value == b"3" and kv.add("run/n", 5) == 5
    assert kv.get("run/c").value == b"3" and {e.key for e in kv.list("run/")[0]} >= {"run/c", "run/n"}
    assert [e.key for e in kv.watch("run/", revision, PATIENCE)] == ["run/c", "run/n"]


def test_corrupt_bookkeeping_fails_a_waiting_watch_instead_of_hanging(server: RedisServer,
                                                                      fresh: tuple[KVBackend, str]) -> None:
    """The listener sweeps at TTL deadlines; if it meets corrupt bookkeeping there, the watch gets it."""
    kv, ns = fresh
    _, revision = kv.list("")
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(_catch(lambda: kv.watch("quiet/", revision, PATIENCE))))
    thread.start()
    kv.put("other/k", b"v", ttl=0.3)  # the listener will sweep at its deadline...
    raw(server, "ZADD", ns + "#ttl", "0", "not a key")  # ...and meet this first
    thread.join(PATIENCE + 5)
    assert len(outcome) == 1 and isinstance(outcome[0], CorruptEntryError) and outcome[0].key is None


def _catch(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # the outcome under test
        return exc


# -- watch wake-ups and the connection pool ------------------------------------------------------
def evalsha_calls(server: RedisServer) -> int:
    """Scripts the server ran so far (all clients; not counting NOSCRIPT answers, which make redis-py load one)."""
    with redis.Redis(host=server.host, port=server.port, socket_timeout=PATIENCE) as client:
        stats = client.info("commandstats")["cmdstat_evalsha"]
    return int(stats["calls"]) - int(stats.get("failed_calls", 0)) - int(stats.get("rejected_calls", 0))


def test_a_watch_sleeps_through_events_under_other_prefixes(server: RedisServer, fresh: tuple[KVBackend, str]) -> None:
    """200 writes elsewhere do not wake a waiting watch (the server runs no poll for it), one under its prefix does."""
    kv, _ = fresh
    writer = open_backend(server.url(namespace=kv.namespace))
    try:
        _, revision = kv.list("")
        before = evalsha_calls(server)
        woke: list[list[Event]] = []
        thread = threading.Thread(target=lambda: woke.append(kv.watch("mine/", revision, PATIENCE * 3)))
        thread.start()
        for i in range(200):
            writer.put(f"other/k{i % 10}", b"x")
        # The writer's 200 scripts; the watcher's poll, a second poll after subscribing, one sweep
        # (and slack). Woken by every event, it would run about 200 more.
        assert evalsha_calls(server) - before <= 200 + 5
        assert not woke
        entry = writer.put("mine/k", b"y")
        thread.join(PATIENCE)
        assert woke == [[Event(PUT, "mine/k", entry.revision, b"y")]]
    finally:
        writer.close()


def command_calls(server: RedisServer, command: str) -> int:
    """How often the server ran ``command`` so far (scripts' calls included)."""
    with redis.Redis(host=server.host, port=server.port, socket_timeout=PATIENCE) as client:
        return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_woken_watch_does_not_rescan_other_prefixes(server: RedisServer, fresh: tuple[KVBackend, str]) -> None:
    """After 2,000 events elsewhere, the event under its prefix costs the waiting watch one short scan
    of the log (XRANGE), not the eight that reading past the 2,000 would take."""
    kv, ns = fresh
    writer = open_backend(server.url(namespace=kv.namespace))
    try:
        _, revision = kv.list("")
        woke: list[list[Event]] = []
        thread = threading.Thread(target=lambda: woke.append(kv.watch("mine/", revision, PATIENCE * 3)))
        thread.start()
        deadline = time.monotonic() + PATIENCE
        while raw(server, "PUBSUB", "NUMSUB", ns + "#w:mine/")[1] == 0:  # subscribed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for i in range(2000):
            writer.put(f"other/k{i % 10}", b"x")
        before = command_calls(server, "xrange")
        entry = writer.put("mine/k", b"y")
        thread.join(PATIENCE)
        assert woke == [[Event(PUT, "mine/k", entry.revision, b"y")]]
        assert command_calls(server, "xrange") - before <= 2
    finally:
        writer.close()


def test_a_watch_on_an_announced_prefix_starts_where_its_events_are(server: RedisServer,
                                                                    fresh: tuple[KVBackend, str]) -> None:
    """Once a prefix's channel has announced every event after a revision, a new watch from there
    neither misses an event written before it began nor scans the 2,000 events of other prefixes."""
    kv, _ = fresh
    writer = open_backend(server.url(namespace=kv.namespace))
    try:
        _, start = kv.list("")
        assert kv.watch("mine/", start, 0.3) == []  # subscribes; its polls read the log after that
        for i in range(2000):
            writer.put(f"other/k{i % 10}", b"x")
        before = command_calls(server, "xrange")
        first = writer.put("mine/a", b"1")  # announced before the next watch begins, or while it waits
        assert kv.watch("mine/", start, PATIENCE) == [Event(PUT, "mine/a", first.revision, b"1")]
        assert command_calls(server, "xrange") - before <= 1
        second = writer.put("mine/b", b"2")
        assert kv.watch("mine/", start, PATIENCE) == [Event(PUT, "mine/a", first.revision, b"1"),
                                                      Event(PUT, "mine/b", second.revision, b"2")]
        assert kv.watch("mine/", second.revision, 0.2) == []
    finally:
        writer.close()


def test_a_first_watch_of_a_quiet_prefix_does_not_scan_the_log(server: RedisServer,
                                                                fresh: tuple[KVBackend, str]) -> None:
    """A watch of a prefix nobody watched yet, from before 2,000 events elsewhere, reads none of them:
    the server knows each prefix's latest event (else, at 1,024 agents, every agent's watch of the
    round record read every join of the round)."""
    kv, _ = fresh
    writer = open_backend(server.url(namespace=kv.namespace))
    try:
        _, start = kv.list("")
        for i in range(2000):
            writer.put(f"other/k{i % 10}", b"x")
        before = command_calls(server, "xrange")
        assert kv.watch("mine/", start, 0.2) == []
        assert command_calls(server, "xrange") - before == 0
        entry = writer.put("mine/k", b"y")
        for i in range(300):
            writer.put(f"other/k{i % 10}", b"x")
        assert kv.watch("mine/", start, 0) == [Event(PUT, "mine/k", entry.revision, b"y")]
        before = command_calls(server, "xrange")
        assert kv.watch("mine/", entry.revision, 0) == []  # nothing since, though 300 events came
        assert command_calls(server, "xrange") - before == 0
    finally:
        writer.close()


def test_woken_watches_return_exactly_the_events_the_messages_carry(server: RedisServer,
                                                                   fresh: tuple[KVBackend, str]) -> None:
    """Messages carry small events whole (binary values, spaces, empty), a large value only by its
    revision (the watch polls for it), deletes and expiries: what waiting watches return is exact."""
    kv, _ = fresh
    writer = open_backend(server.url(namespace=kv.namespace))
    try:
        _, start = kv.list("")
        assert kv.watch("w/", start, 0.3) == []  # subscribed; later watches are covered
        writes: list[Callable[[], Event]] = [
            lambda: _put_event(writer.put("w/a", b" two  spaces \n\x00\xff ")),
            lambda: _put_event(writer.put("w/b/c", b"")),
            lambda: _put_event(writer.put("w/big", b"x" * 5000)),
            lambda: Event(DELETE, "w/a", _delete_revision(writer, "w/a")),
            lambda: _put_event(writer.put("w/n", b"1", ttl=0.2)),
        ]
        after = start
        for write in writes:
            woke: list[list[Event]] = []
            thread = threading.Thread(target=lambda a=after: woke.append(kv.watch("w/", a, PATIENCE * 3)))
            thread.start()
            expected = write()
            thread.join(PATIENCE * 3)
            assert woke and woke[0][0] == expected, (woke, expected)
            after = woke[0][-1].revision
        expired = watch_until(kv, "w/", after, lambda seen: any(e.type is DELETE for e in seen))
        assert [(e.type, e.key) for e in expired] == [(DELETE, "w/n")]
    finally:
        writer.close()


def _put_event(entry: Any) -> Event:
    return Event(PUT, entry.key, entry.revision, entry.value)


def _delete_revision(kv: KVBackend, key: str) -> int:
    """Delete ``key`` (nothing else writes meanwhile) and return the revision of that delete."""
    assert kv.delete(key)
    return kv.list("")[1]


def test_many_prefixes_are_pruned_from_the_index_and_watches_stay_exact(server: RedisServer,
                                                                        fresh: tuple[KVBackend, str]) -> None:
    """Beyond 1,024 prefixes the index forgets those whose events the log no longer holds; watches
    from any revision still return exactly the events under their prefix."""
    kv, ns = fresh
    _, start = kv.list("")
    first = kv.put("p0/k", b"0")
    for i in range(1, 1100):
        kv.put(f"p{i}/k", b"x")
    assert int(raw(server, "ZCARD", ns + "#last")) > 1024  # nothing trimmed: nothing to forget
    last = kv.put("p0/k", b"1")
    assert kv.watch("p0/", start, 0) == [Event(PUT, "p0/k", first.revision, b"0")]  # (a first batch)
    assert kv.watch("p0/", first.revision, 0) == [Event(PUT, "p0/k", last.revision, b"1")]
    assert kv.watch("p5/", last.revision, 0) == []
    raw(server, "XTRIM", ns + "#log", "MAXLEN", "100")  # as the log cap does, then one more write prunes
    kv.put("p1099/k", b"x")
    assert int(raw(server, "ZCARD", ns + "#last")) <= 110
    assert kv.watch("p0/", last.revision, 0) == []
    with pytest.raises(HistoryCompactedError):
        kv.watch("p0/", start, 0)
    assert [e.key for e in kv.watch("p1099/", last.revision, 0)] == ["p1099/k"]


def test_many_waiting_watches_share_a_small_pool(server: RedisServer, opened: Callable[[str], KVBackend]) -> None:
    """60 threads wait on one backend object with max_connections=2: none fails, each wakes for its own prefix."""
    ns = "pool-" + uuid.uuid4().hex[:8]
    clients_before = len(raw(server, "CLIENT", "LIST").splitlines())
    kv = opened(server.url(namespace=ns, max_connections="2"))
    _, revision = kv.list("")
    results: dict[int, Any] = {}
    ready = threading.Barrier(61)

    def watch(i: int) -> None:
        ready.wait(PATIENCE)
        results[i] = _catch(lambda: watch_until(kv, f"p{i % 3}/", revision, bool))

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(60)]
    for t in threads:
        t.start()
    ready.wait(PATIENCE)
    written = {p: kv.put(f"p{p}/k", str(p).encode()) for p in range(3)}
    for t in threads:
        t.join(PATIENCE * 2)
    assert len(results) == 60
    for i, events in results.items():
        assert events == [Event(PUT, f"p{i % 3}/k", written[i % 3].revision, str(i % 3).encode())], (i, events)
    # The pool, the listener and its connection for sweeps.
    assert len(raw(server, "CLIENT", "LIST").splitlines()) <= clients_before + 2 + 1 + 1


def test_backends_share_one_listener_and_a_forgotten_one_is_collectable(server: RedisServer,
                                                                         prefix: str) -> None:
    """Backends with the same URL share one listener connection; closing one ends its own watches only;
    a backend never closed can still be garbage-collected (the shared listener holds no reference)."""
    import gc
    import weakref

    ns = "share-" + uuid.uuid4().hex[:8]
    url, channel = server.url(namespace=ns), namespace_prefix(ns) + "#w:" + prefix
    one, two = open_backend(url), open_backend(url)
    try:
        _, revision = one.list("")
        outcome: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda name=name, kv=kv: outcome.update(
            {name: _catch(lambda: kv.watch(prefix, revision, PATIENCE))})) for name, kv in (("one", one), ("two", two))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + PATIENCE
        while raw(server, "PUBSUB", "NUMSUB", channel)[1] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert raw(server, "PUBSUB", "NUMSUB", channel)[1] == 1  # one subscriber for both
        closed = time.monotonic()
        one.close()
        threads[0].join(PATIENCE)
        assert outcome == {"one": []} and time.monotonic() - closed < 1.0  # two still waits
        entry = open_backend(url)
        try:
            written = entry.put(prefix + "k", b"v")
        finally:
            entry.close()
        threads[1].join(PATIENCE)
        assert outcome["two"] == [Event(PUT, prefix + "k", written.revision, b"v")]
    finally:
        one.close()
        two.close()
    forgotten = open_backend(url)
    assert forgotten.watch(prefix, 0, 0.1)  # the events above; it used the listener
    ref = weakref.ref(forgotten)
    del forgotten
    gc.collect()
    assert ref() is None


def test_refresh_to_an_earlier_deadline_is_seen_by_a_waiting_watch(server: RedisServer,
                                                                    opened: Callable[[str], KVBackend],
                                                                    prefix: str) -> None:
    """The listener sleeps until the earliest TTL deadline; a refresh that moves it earlier wakes it (NS#t)."""
    watcher, writer = opened(server.url()), opened(server.url())
    entry = writer.put(prefix + "k", b"v", ttl=60)
    seen: list[list[Event]] = []
    thread = threading.Thread(target=lambda: seen.append(watch_until(watcher, prefix, entry.revision, deletes_of)))
    thread.start()
    # Until the watcher waits: subscribed, and its polls done (else a poll, not NS#t, reports the deadline;
    # the outcome is the same, only the path differs).
    channel, deadline = namespace_prefix(None) + "#w:" + prefix, time.monotonic() + PATIENCE
    while raw(server, "PUBSUB", "NUMSUB", channel)[1] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    calls = -1
    while calls != (calls := evalsha_calls(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    refreshed = time.monotonic()
    writer.refresh(prefix + "k", 0.2)
    thread.join(PATIENCE * 2)
    assert seen and [(e.type, e.key) for e in seen[0]] == [(DELETE, prefix + "k")]
    assert time.monotonic() - refreshed < 0.2 + CAPABILITIES.ttl_resolution + 1.0


def test_a_new_earliest_deadline_is_announced(server: RedisServer, fresh: tuple[KVBackend, str]) -> None:
    """NS#t gets a message when a write or refresh makes its key's deadline the earliest, and only then."""
    kv, ns = fresh
    with redis.Redis(host=server.host, port=server.port, socket_timeout=PATIENCE) as client:
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(ns + "#t")
        assert pubsub.get_message(timeout=PATIENCE) is None  # (reads the subscription)

        def announced() -> bool:
            kv.list("")  # a round trip after the write: its message, if any, has been sent
            return pubsub.get_message(timeout=0.5) is not None

        kv.put("a", b"1", ttl=30)
        assert announced()  # the first deadline
        kv.put("b", b"1", ttl=60)
        assert not announced()  # later than a's
        kv.put("c", b"1")
        kv.refresh("c", 10)
        assert announced()  # earlier than a's
        kv.refresh("b", 40)
        assert not announced()
        kv.put("b", b"2", ttl=1)
        assert announced()
        pubsub.close()


# -- namespaces and hostile keys ---------------------------------------------------------------
@pytest.mark.parametrize("names", [(None, "a"), ("a", "b"), ("k", None), ("a:b", "a"), ("x/#k", "x"),
                                   ("%41", "A"), ("k/", None)])
def test_namespaces_cannot_see_each_other(server: RedisServer, opened: Callable[[str], KVBackend],
                                          names: tuple[str | None, str | None]) -> None:
    urls = [server.url() if n is None else server.url(namespace=_quote(n)) for n in names]
    one, two = opened(urls[0]), opened(urls[1])
    _, rev_two = two.list("")
    mine = f"iso{uuid.uuid4().hex[:8]}/"
    one.put(mine + "k", b"one")
    one.put(mine + "t", b"one", ttl=0.05)
    assert two.get(mine + "k") is None
    assert two.list(mine)[0] == []
    assert all(not e.key.startswith(mine) for e in two.watch("", rev_two, 0.2))
    two.put(mine + "k", b"two")
    assert one.get(mine + "k").value == b"one" and two.get(mine + "k").value == b"two"


def _quote(name: str) -> str:
    import urllib.parse

    return urllib.parse.quote(name, safe="")


def test_run_ids_and_hostile_keys_stay_apart(server: RedisServer, opened: Callable[[str], KVBackend]) -> None:
    """Run ids become escaped key segments: no run's keys fall under another's prefix, whatever the id."""
    kv = opened(server.url("anyrun", namespace="runs-" + uuid.uuid4().hex[:6]))
    runs = ["run", "run:1", "run.", "=run", "run@x", "~", "run%2F", "r" * 128]
    for run in runs:
        kv.put(f"torchelastic/{escape_segment(run)}/state", run.encode())
    for run in runs:
        entries, _ = kv.list(f"torchelastic/{escape_segment(run)}/")
        assert [e.value for e in entries] == [run.encode()]


# -- restarts and faults -------------------------------------------------------------------------
def test_restart_reloads_scripts_and_keeps_data(own_server: RedisServer,
                                                opened: Callable[[str], KVBackend], prefix: str) -> None:
    kv = opened(own_server.url(operation_timeout="5"))
    before = kv.put(prefix + "k", b"v")
    raw(own_server, "SCRIPT", "FLUSH")
    middle = kv.put(prefix + "k", b"w")  # NOSCRIPT -> reloaded
    acked = [kv.put(f"{prefix}many/{i}", b"x") for i in range(200)]
    own_server.kill()
    own_server.start()
    assert kv.get(prefix + "k") == middle  # AOF kept it; the pooled connection was replaced
    assert kv.list(prefix + "many/")[0] == sorted(acked, key=lambda e: e.key)  # every acknowledged write
    after = kv.put(prefix + "k", b"x")
    assert before.revision < middle.revision < after.revision
    assert [e for e in kv.watch(prefix, before.revision, 0) if e.key == prefix + "k"] == [
        Event(PUT, prefix + "k", middle.revision, b"w"), Event(PUT, prefix + "k", after.revision, b"x")]


def test_killed_server_raises_connection_error_within_timeout(own_server: RedisServer,
                                                              opened: Callable[[str], KVBackend],
                                                              prefix: str) -> None:
    op_timeout = 2.0
    kv = opened(own_server.url(operation_timeout=str(op_timeout)))
    entry = kv.put(prefix + "k", b"v")
    own_server.kill()
    calls: list[Callable[[], Any]] = [
        lambda: kv.get(prefix + "k"),
        lambda: kv.put(prefix + "k", b"w"),
        lambda: kv.list(prefix),
        lambda: kv.watch(prefix, entry.revision, 5.0),
        lambda: kv.refresh(prefix + "k", 1.0),
        lambda: kv.add(prefix + "n", 1),
        lambda: open_backend(own_server.url(operation_timeout=str(op_timeout))),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(BackendConnectionError):
            call()
        assert time.monotonic() - started < op_timeout
    own_server.start()
    assert kv.get(prefix + "k") == entry


def test_server_killed_during_a_watch(own_server: RedisServer, opened: Callable[[str], KVBackend],
                                      prefix: str) -> None:
    kv = opened(own_server.url(operation_timeout="2"))
    _, after = kv.list(prefix)
    outcome: list[Any] = []

    def watch() -> None:
        try:
            outcome.append(kv.watch(prefix, after, PATIENCE))
        except BackendUnavailableError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=watch)
    thread.start()
    time.sleep(0.1)  # let it block (if it has not yet, it meets the dead server instead: same outcome)
    own_server.kill()
    thread.join(PATIENCE)
    assert len(outcome) == 1 and isinstance(outcome[0], BackendConnectionError)


def test_paused_server_raises_timeout_within_operation_timeout(own_server: RedisServer,
                                                               opened: Callable[[str], KVBackend],
                                                               prefix: str) -> None:
    op_timeout = 0.5
    kv = opened(own_server.url(operation_timeout=str(op_timeout)))
    kv.put(prefix + "k", b"v")
    own_server.pause()
    try:
        for call in (lambda: kv.get(prefix + "k"), lambda: kv.put(prefix + "k", b"w"),
                     lambda: kv.watch(prefix, 0, 5.0),
                     lambda: open_backend(own_server.url(operation_timeout=str(op_timeout)))):
            started = time.monotonic()
            with pytest.raises(BackendTimeoutError):
                call()
            elapsed = time.monotonic() - started
            assert op_timeout * 0.9 <= elapsed < op_timeout + 1.0, elapsed
    finally:
        own_server.resume()
    assert kv.get(prefix + "k").value in (b"v", b"w")  # the timed-out put may have happened


def test_data_loss_never_reuses_revisions_and_watchers_notice(opened: Callable[[str], KVBackend],
                                                               prefix: str) -> None:
    """A server without AOF forgets everything on restart: new revisions still exceed every old one,
    a stale compare-and-swap cannot match, and watchers from the lost history get HistoryCompactedError."""
    volatile = RedisServer(appendonly=False)
    volatile.start()
    try:
        kv = opened(volatile.url())
        for i in range(3):
            last = kv.put(prefix + "k", str(i).encode())
        volatile.kill()
        volatile.start()
        with pytest.raises(HistoryCompactedError, match="lost data"):  # nothing written since the restart
            kv.watch(prefix, last.revision, 1.0)
        fresh = kv.create(prefix + "k", b"new")
        assert fresh.revision > last.revision
        with pytest.raises(CompareFailedError):
            kv.compare_and_swap(prefix + "k", b"stale", last.revision)
        with pytest.raises(HistoryCompactedError, match="lost"):  # the new history has moved past it
            kv.watch(prefix, last.revision, 1.0)
        entries, revision = kv.list(prefix)  # recovery as documented: re-read, watch from there
        assert entries == [fresh] and kv.watch(prefix, revision, 0) == []
        assert kv.watch(prefix, 0, 0) == [Event(PUT, prefix + "k", fresh.revision, b"new")]
    finally:
        volatile.stop()


def test_data_loss_under_a_subscribed_prefix_is_still_noticed(own_server: RedisServer,
                                                               opened: Callable[[str], KVBackend],
                                                               prefix: str) -> None:
    """FLUSHDB keeps the listener's connection: a watch from the lost history, though its prefix's
    channel announced everything since, still gets HistoryCompactedError (at its timeout when nothing came)."""
    kv, writer = opened(own_server.url()), opened(own_server.url())
    old = writer.put(prefix + "k", b"old")
    assert kv.watch(prefix, old.revision, 0.3) == []  # subscribed, and its polls covered the log
    raw(own_server, "FLUSHDB")
    started = time.monotonic()
    with pytest.raises(HistoryCompactedError):
        kv.watch(prefix, old.revision, 0.5)
    assert time.monotonic() - started < 0.5 + PATIENCE / 2
    writer.put(prefix + "k", b"new")
    with pytest.raises(HistoryCompactedError):
        kv.watch(prefix, old.revision, PATIENCE)
    entries, revision = kv.list(prefix)
    assert [e.value for e in entries] == [b"new"] and kv.watch(prefix, revision, 0.2) == []


def test_watch_from_any_number_below_a_revision(server: RedisServer, opened: Callable[[str], KVBackend],
                                                prefix: str) -> None:
    """Revisions are not consecutive; ``watch(after=entry.revision - 1)`` still returns that entry."""
    kv = opened(server.url())
    kv.put(prefix + "a", b"1")
    entry = kv.put(prefix + "b", b"2")
    assert kv.watch(prefix, entry.revision - 1, 0) == [Event(PUT, prefix + "b", entry.revision, b"2")]


# -- TLS ---------------------------------------------------------------------------------------
def test_tls_with_ca(tls_server: RedisTLSServer, opened: Callable[[str], KVBackend], prefix: str) -> None:
    kv = opened(tls_server.url())
    assert kv.capabilities.tls
    entry = kv.put(prefix + "k", b"over tls", ttl=0.2)
    events = watch_until(kv, prefix, entry.revision, deletes_of)
    assert [e.type for e in events] == [DELETE]


def test_mutual_tls_with_client_certificate(mtls_server: RedisTLSServer, opened: Callable[[str], KVBackend],
                                            prefix: str) -> None:
    kv = opened(mtls_server.url(cert=mtls_server.client_cert_path, key=mtls_server.client_key_path))
    assert kv.put(prefix + "k", b"v").value == b"v"
    with pytest.raises(InvalidURLError) as info:  # the server demands a certificate we did not give
        opened(mtls_server.url())
    assert info.value.field == "cert" and "demands a client certificate" in str(info.value)


def test_tls_wrong_ca_names_cacert(tls_server: RedisTLSServer, tmp_path: Any) -> None:
    import trustme

    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    with pytest.raises(InvalidURLError) as info:
        open_backend(f"rediss://{tls_server.address}/run?cacert={other}")
    assert info.value.field == "cacert" and "verif" in str(info.value)


def test_tls_certificate_for_another_name_names_host(tmp_path: Any) -> None:
    misnamed = RedisTLSServer(server_names=("redis.example.org",))
    misnamed.start()
    try:
        with pytest.raises(InvalidURLError) as info:
            open_backend(misnamed.url())
        assert info.value.field == "host"
    finally:
        misnamed.stop()


def test_tls_without_cacert_uses_system_cas_and_fails_closed(tls_server: RedisTLSServer) -> None:
    with pytest.raises(InvalidURLError) as info:
        open_backend(f"rediss://{tls_server.address}/run")
    assert info.value.field == "cacert"


@pytest.mark.parametrize("case, field", [("cert-without-key", "key"), ("key-without-cert", "cert"),
                                          ("missing-key-file", "key"), ("garbage-cacert", "cacert"),
                                          ("mismatched-key", "key"), ("cert-not-pem", "cert")])
def test_tls_bad_files_fail_fast_naming_the_option(tls_server: RedisTLSServer, tmp_path: Any, case: str,
                                                   field: str) -> None:
    import trustme

    s = tls_server
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    stranger = tmp_path / "stranger.key"
    trustme.CA().issue_cert("x").private_key_pem.write_to_path(str(stranger))
    query = {
        "cert-without-key": f"cert={s.client_cert_path}",
        "key-without-cert": f"key={s.client_key_path}",
        "missing-key-file": f"cert={s.client_cert_path}&key={tmp_path}/nope.key",
        "garbage-cacert": "",
        "mismatched-key": f"cert={s.client_cert_path}&key={stranger}",
        "cert-not-pem": f"cert={garbage}&key={s.client_key_path}",
    }[case]
    cacert = garbage if case == "garbage-cacert" else s.ca_path
    started = time.monotonic()
    with pytest.raises(InvalidURLError) as info:
        open_backend(f"rediss://{s.address}/run?cacert={cacert}" + (f"&{query}" if query else ""))
    assert info.value.field == field
    assert time.monotonic() - started < 1.0


def test_no_plain_text_fallback(tls_server: RedisTLSServer, server: RedisServer) -> None:
    with pytest.raises(BackendUnavailableError):  # plain client, TLS port
        open_backend(f"redis://{tls_server.address}/run?operation_timeout=2")
    with pytest.raises((BackendUnavailableError, InvalidURLError)):  # TLS client, plain port
        open_backend(f"rediss://{server.address}/run?cacert={tls_server.ca_path}&operation_timeout=2")


# -- ACL users -----------------------------------------------------------------------------------
ACL_RULES = ("resetkeys ~rdzv:* resetchannels &rdzv:* -@all +ping +info +evalsha +script|load +hgetall +time +get +set "
             "+incrby +del +exists +type +hmget +hset +persist +pexpireat +zadd +zrem +zscore +zmscore +zcard +zrange "
             "+zrangebylex +zrangebyscore +zremrangebyscore +zcount +xadd +xrange +xrevrange +publish +subscribe "
             "+unsubscribe").split()


def test_acl_user_with_the_documented_rules(server: RedisServer, opened: Callable[[str], KVBackend],
                                            prefix: str) -> None:
    """The rules in docs/backends/redis.md are enough for every operation, and nothing outside ``rdzv:``."""
    user = "agent" + uuid.uuid4().hex[:6]
    raw(server, "ACL", "SETUSER", user, "on", ">s3cret-pw", *ACL_RULES)
    kv = opened(f"redis://{user}:s3cret-pw@{server.address}/run?namespace=acl")
    entry = kv.create(prefix + "k", b"v", ttl=0.2)
    kv.refresh(prefix + "k", 0.2)
    assert kv.add(prefix + "n", 5) == 5
    e2 = kv.compare_and_swap(prefix + "n", b"7", kv.get(prefix + "n").revision)
    kv.compare_and_delete(prefix + "n", e2.revision)
    events = watch_until(kv, prefix, entry.revision, lambda seen: any(e.key == prefix + "k" for e in
                                                                      deletes_of(seen)))
    assert [e.key for e in deletes_of(events)] == [prefix + "n", prefix + "k"]
    assert kv.list(prefix)[0] == []
    assert "s3cret-pw" not in repr(kv)


def test_acl_user_without_password(server: RedisServer, opened: Callable[[str], KVBackend], prefix: str) -> None:
    user = "nopass" + uuid.uuid4().hex[:6]
    raw(server, "ACL", "SETUSER", user, "on", "nopass", *ACL_RULES)
    kv = opened(f"redis://{user}@{server.address}/run")
    assert kv.put(prefix + "k", b"v").value == b"v"


def test_wrong_password_names_the_field_not_the_secret(server: RedisServer) -> None:
    user = "agent" + uuid.uuid4().hex[:6]
    raw(server, "ACL", "SETUSER", user, "on", ">right-pw", "~rdzv:*", "+@all")
    with pytest.raises(InvalidURLError) as info:
        open_backend(f"redis://{user}:wrong-pw@{server.address}/run")
    assert info.value.field == "password"
    assert "wrong-pw" not in str(info.value) and "right-pw" not in str(info.value)


def test_acl_user_without_rights_gets_a_clear_error(server: RedisServer, opened: Callable[[str], KVBackend],
                                                   prefix: str) -> None:
    user = "reader" + uuid.uuid4().hex[:6]
    raw(server, "ACL", "SETUSER", user, "on", ">pw", "~other:*", "+@all")
    kv = opened(f"redis://{user}:pw@{server.address}/run")
    with pytest.raises(KVError) as info:
        kv.put(prefix + "k", b"v")
    assert not isinstance(info.value, BackendUnavailableError)
