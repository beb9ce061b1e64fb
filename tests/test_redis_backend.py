"""The Redis backend beyond the shared suite: URL and TLS options, the Lua/stream log, expiry
bookkeeping, server restarts and faults, namespaces, ACL users — all against real ``redis-server``s.

Servers that a test kills or pauses are its own (function scope); the others are shared per module.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import pytest
import redis

from conformance_tests.redis_server import RedisServer, RedisTLSServer
from rdzv_backends.redis_backend import CAPABILITIES, MAX_VALUE_BYTES, namespace_prefix
from rdzv_core import (
    BackendConnectionError,
    BackendTimeout,
    BackendUnavailable,
    CompareFailed,
    Event,
    EventType,
    HistoryCompacted,
    InvalidURLError,
    KeyNotFound,
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
def _serve(server: RedisServer) -> Iterator[RedisServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A plain server shared by this module's tests that do not disturb it."""
    yield from _serve(RedisServer())


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A plain server this test may kill, restart or pause."""
    yield from _serve(RedisServer())


@pytest.fixture(scope="module")
def tls_server() -> Iterator[RedisTLSServer]:
    """A TLS-only server; client certificates optional."""
    yield from _serve(RedisTLSServer(auth_clients="optional"))


@pytest.fixture(scope="module")
def mtls_server() -> Iterator[RedisTLSServer]:
    """A TLS-only server that requires a client certificate signed by its CA."""
    yield from _serve(RedisTLSServer(auth_clients="yes"))


@pytest.fixture
def opened() -> Iterator[Callable[[str], KVBackend]]:
    """``open(url)`` that closes every backend it opened after the test."""
    backends: list[KVBackend] = []

    def open_(url: str) -> KVBackend:
        kv = open_backend(url)
        backends.append(kv)
        return kv

    yield open_
    for kv in backends:
        kv.close()


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
    _, url = parse_backend_url("redis://bob:pw@example.org/run1?db=3&namespace=team-a&operation_timeout=2.5")
    assert url.hosts == (("example.org", 6379),)
    assert url.params == {"db": 3, "namespace": "team-a", "operation_timeout": 2.5}
    assert (url.username, url.password) == ("bob", "pw")


@pytest.mark.parametrize(
    "url, field",
    [
        ("redis://h1:1,h2:2/run", "host"),
        ("redis:///run", "host"),
        ("redis://h/run?db=-1", "db"),
        ("redis://h/run?db=x", "db"),
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
                                                     f"rdzv:{ns}:#ttl", f"rdzv:{ns}:#add", f"rdzv:{ns}:#epoch"}


def test_add_reads_decimal_values_like_parse_counter(server: RedisServer, opened: Callable[[str], KVBackend],
                                                     prefix: str) -> None:
    kv = opened(server.url())
    for raw in [b"7", b"-7", b"007", b"-0", b"-007", b"9223372036854775806"]:
        kv.put(prefix + "k", raw)
        assert kv.add(prefix + "k", 1) == parse_counter("k", raw) + 1
        assert kv.get(prefix + "k").value == str(parse_counter("k", raw) + 1).encode()
    for raw in [b"", b"1.5", b"0x10", b"+7", b" 7", b"1_0", b"--1", b"one", b"\xff", b"1" * 31]:
        kv.put(prefix + "k", raw)
        with pytest.raises(KVError):
            kv.add(prefix + "k", 1)
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
    """close() at any moment of a watch (polling, about to block, blocked) ends it within a second."""
    for i in range(20):
        kv = open_backend(server.url())
        _, after = kv.list("nothing/")
        ended: list[float] = []
        thread = threading.Thread(target=lambda: (kv.watch("nothing/", after, PATIENCE), ended.append(
            time.monotonic())))
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
    with pytest.raises(KeyNotFound):
        kv.refresh(prefix + "k", 1)


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
        except BackendUnavailable as exc:
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
            with pytest.raises(BackendTimeout):
                call()
            elapsed = time.monotonic() - started
            assert op_timeout * 0.9 <= elapsed < op_timeout + 1.0, elapsed
    finally:
        own_server.resume()
    assert kv.get(prefix + "k").value in (b"v", b"w")  # the timed-out put may have happened


def test_data_loss_never_reuses_revisions_and_watchers_notice(opened: Callable[[str], KVBackend],
                                                               prefix: str) -> None:
    """A server without AOF forgets everything on restart: new revisions still exceed every old one,
    a stale compare-and-swap cannot match, and watchers from the lost history get HistoryCompacted."""
    volatile = RedisServer(appendonly=False)
    volatile.start()
    try:
        kv = opened(volatile.url())
        for i in range(3):
            last = kv.put(prefix + "k", str(i).encode())
        volatile.kill()
        volatile.start()
        with pytest.raises(HistoryCompacted, match="lost data"):  # nothing written since the restart
            kv.watch(prefix, last.revision, 1.0)
        fresh = kv.create(prefix + "k", b"new")
        assert fresh.revision > last.revision
        with pytest.raises(CompareFailed):
            kv.compare_and_swap(prefix + "k", b"stale", last.revision)
        with pytest.raises(HistoryCompacted, match="lost"):  # the new history has moved past it
            kv.watch(prefix, last.revision, 1.0)
        entries, revision = kv.list(prefix)  # recovery as documented: re-read, watch from there
        assert entries == [fresh] and kv.watch(prefix, revision, 0) == []
        assert kv.watch(prefix, 0, 0) == [Event(PUT, prefix + "k", fresh.revision, b"new")]
    finally:
        volatile.stop()


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
    with pytest.raises(BackendUnavailable):  # the server demands a certificate we did not give
        opened(mtls_server.url(operation_timeout="2"))


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
    with pytest.raises(BackendUnavailable):  # plain client, TLS port
        open_backend(f"redis://{tls_server.address}/run?operation_timeout=2")
    with pytest.raises((BackendUnavailable, InvalidURLError)):  # TLS client, plain port
        open_backend(f"rediss://{server.address}/run?cacert={tls_server.ca_path}&operation_timeout=2")


# -- ACL users -----------------------------------------------------------------------------------
ACL_RULES = ("resetkeys ~rdzv:* resetchannels -@all +ping +evalsha +script|load +hmget +xread +time +get +set "
             "+incr +incrby +del +exists +hget +hset +persist +pexpireat +zadd +zrem +zscore +zrange +zrangebylex "
             "+zrangebyscore +xadd +xrange").split()


def test_acl_user_with_the_documented_rules(server: RedisServer, opened: Callable[[str], KVBackend],
                                            prefix: str) -> None:
    """The rules in the module docstring are enough for every operation, and nothing outside ``rdzv:``."""
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
    assert not isinstance(info.value, BackendUnavailable)
