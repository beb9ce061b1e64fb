"""``redis+sentinel://`` against a real Sentinel group (a master, a replica, three sentinels:
``conformance_tests.redis_sentinel.SentinelGroup``): the URL, failover, and watches across a
failover that keeps or loses the last writes. The ``diverged`` check of the watch poll is shared
with ``redis://`` and tested on a plain server too.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, Iterator, TypeVar

import pytest
import redis

from conformance_tests.plugin import backends_opened
from conformance_tests.redis_sentinel import MASTER_NAME, SentinelGroup
from conformance_tests.servers import free_port
from rdzv_core import (
    BackendUnavailableError,
    CompareFailedError,
    EventType,
    HistoryCompactedError,
    InvalidURLError,
    KVBackend,
    list_backends,
    open_backend,
)

T = TypeVar("T")

#: Seconds from a master's death until the sentinels name the replica (down-after 1 s + election),
#: with room for a loaded machine.
FAILOVER = 30.0


@pytest.fixture
def group(rdzv_server_sentinel: SentinelGroup) -> Iterator[SentinelGroup]:
    """The session's Sentinel group; whatever the test did, every process runs again afterwards."""
    yield rdzv_server_sentinel
    rdzv_server_sentinel.start()


@pytest.fixture
def clients(group: SentinelGroup) -> Iterator[Callable[..., KVBackend]]:
    """``clients(**query)``: a new client of the group (operation_timeout 1 s unless given)."""
    with backends_opened(lambda **q: group.url("", **{"operation_timeout": "1", **q})) as open_:
        yield open_


@pytest.fixture
def prefix() -> str:
    return f"sentinel/t{uuid.uuid4().hex}/"


def _retry(fn: Callable[[], T], deadline: float) -> T:
    """``fn()``, retried every 50 ms while it raises BackendUnavailableError (what a failover looks like)."""
    while True:
        try:
            return fn()
        except BackendUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _replicated(group: SentinelGroup) -> None:
    """Wait until the replica acknowledged every write the master took (``WAIT 1``)."""
    master = group.master()
    with redis.Redis(master.host, master.port, socket_timeout=10) as client:
        assert client.execute_command("WAIT", 1, 10_000) == 1, "the replica did not catch up"


def _fail_over(group: SentinelGroup) -> None:
    """Kill the master and wait until the sentinels name and serve the replica as master."""
    old = group.master().address
    group.kill()
    group.wait_for_master(other_than=old, deadline=time.monotonic() + FAILOVER)


# -- the URL ----------------------------------------------------------------------------------
def test_registered_with_the_sentinel_default_port() -> None:
    info = list_backends()["redis+sentinel"]
    assert info.spec.default_port == 26379
    assert not info.spec.capabilities.tls


def test_master_name_is_required_and_named_in_the_error() -> None:
    started = time.monotonic()
    with pytest.raises(InvalidURLError) as err:
        open_backend(f"redis+sentinel://127.0.0.1:{free_port()}/run")  # nobody listens: no network needed
    assert err.value.field == "master_name"
    assert time.monotonic() - started < 1.0


def test_unknown_master_name_is_an_invalid_url(group: SentinelGroup) -> None:
    with pytest.raises(InvalidURLError) as err:
        open_backend(group.url("run").replace(f"master_name={MASTER_NAME}", "master_name=nosuch"))
    assert err.value.field == "master_name"
    assert err.value.value == "nosuch"
    assert MASTER_NAME in str(err.value), "the error lists the masters the sentinels know"


def test_tls_options_are_refused(group: SentinelGroup) -> None:
    with pytest.raises(InvalidURLError) as err:
        open_backend(group.url("run", cacert="/etc/ssl/certs/ca-certificates.crt"))
    assert err.value.field == "cacert"


def test_connects_to_the_master(group: SentinelGroup, clients: Callable[..., KVBackend], prefix: str) -> None:
    kv = clients()
    kv.put(prefix + "k", b"v")
    master = group.master()
    with redis.Redis(master.host, master.port) as direct:
        assert direct.hget(f"rdzv:k/{prefix}k", "v") == b"v", "the write did not land on the master"


# -- failover ---------------------------------------------------------------------------------
def test_calls_fail_unavailable_during_a_failover_then_work_on_the_new_master(
        group: SentinelGroup, clients: Callable[..., KVBackend], prefix: str) -> None:
    """Kill the master: calls raise BackendUnavailableError (never hang, never another error) until the
    replica is promoted; then get, put, compare_and_swap and add work, with the data replicated."""
    kv = clients()
    first = kv.put(prefix + "k", b"1")
    kv.add(prefix + "n", 5)
    _replicated(group)
    old = group.master().address
    group.kill()
    errors: list[BaseException] = []
    deadline = time.monotonic() + FAILOVER
    while True:
        started = time.monotonic()
        try:
            got = kv.get(prefix + "k")
            break
        except BackendUnavailableError as exc:
            assert time.monotonic() - started < 3.0, "a call during the failover took longer than ~operation_timeout"
            errors.append(exc)
            assert time.monotonic() < deadline, f"no new master within {FAILOVER} s: {exc}"
            time.sleep(0.05)
    assert errors, "no call failed although the master was killed"
    assert got is not None and got.value == b"1" and got.revision == first.revision
    assert group.master().address != old
    swapped = _retry(lambda: kv.compare_and_swap(prefix + "k", b"2", first.revision), deadline)
    assert swapped.revision > first.revision
    assert _retry(lambda: kv.add(prefix + "n", 1), deadline) == 6


def test_a_watch_survives_a_failover(group: SentinelGroup, clients: Callable[..., KVBackend], prefix: str) -> None:
    """A watch waiting when the master dies ends with BackendUnavailableError (or []); watched again from
    the same revision on the new master it sees the next write, in the same history."""
    kv, writer = clients(), clients()
    after = kv.put(prefix + "k", b"0").revision
    _replicated(group)
    outcome: list[Any] = []
    waiting = threading.Event()

    def watch() -> None:
        waiting.set()
        try:
            outcome.append(kv.watch(prefix, after, 60.0))
        except BaseException as exc:  # judged below
            outcome.append(exc)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert waiting.wait(10)
    _fail_over(group)
    thread.join(15)
    assert not thread.is_alive(), "the watch hung when the master died"
    assert outcome[0] == [] or isinstance(outcome[0], BackendUnavailableError), f"unexpected: {outcome[0]!r}"
    deadline = time.monotonic() + FAILOVER
    put = _retry(lambda: writer.put(prefix + "k", b"1"), deadline)
    events = _retry(lambda: kv.watch(prefix, after, 10.0), deadline)
    assert [(e.type, e.key, e.value, e.revision) for e in events] == [
        (EventType.PUT, prefix + "k", b"1", put.revision)]


def _cut_replication(group: SentinelGroup) -> None:
    """Point the replica at a port where nobody listens: it keeps its data and takes no more of the
    master's writes (the sentinels correct that only after their failover timeout)."""
    replica = group.replica()
    with redis.Redis(replica.host, replica.port, socket_timeout=5) as client:
        client.execute_command("REPLICAOF", "127.0.0.1", free_port())


def test_a_failover_that_loses_writes_ends_watches_with_history_compacted(
        group: SentinelGroup, clients: Callable[..., KVBackend], prefix: str) -> None:
    """The master acknowledges a write the replica never got, dies, and the replica is promoted.

    Expected: a watch from the lost write's revision -- one waiting through the failover, and one
    begun after it, before and after the new master's next write -- ends with HistoryCompactedError
    (never a hang, never events as if nothing was lost); get shows the surviving value;
    compare_and_swap against the lost revision fails, against the surviving one succeeds."""
    kv, watcher = clients(), clients()
    kept = kv.put(prefix + "k", b"kept")
    _replicated(group)
    _cut_replication(group)
    lost = kv.put(prefix + "k", b"lost")
    outcome: list[Any] = []

    def watch_until_answer() -> None:  # as a rendezvous waits: retry while the backend is away
        deadline = time.monotonic() + FAILOVER + 30
        try:
            while time.monotonic() < deadline:
                try:
                    if events := watcher.watch(prefix, lost.revision, 5.0):
                        outcome.append(events)
                        return
                except BackendUnavailableError:
                    time.sleep(0.05)
            outcome.append("timed out")
        except BaseException as exc:  # judged below
            outcome.append(exc)

    thread = threading.Thread(target=watch_until_answer, daemon=True)
    thread.start()
    _fail_over(group)
    thread.join(FAILOVER + 40)
    assert not thread.is_alive()
    assert isinstance(outcome[0], HistoryCompactedError), f"the waiting watch ended with {outcome[0]!r}"

    deadline = time.monotonic() + FAILOVER
    got = _retry(lambda: kv.get(prefix + "k"), deadline)
    assert got is not None and (got.value, got.revision) == (b"kept", kept.revision), "the lost write survived?"
    with pytest.raises(HistoryCompactedError):  # the new master is behind the lost revision
        _retry(lambda: kv.watch(prefix, lost.revision, 1.0), deadline)
    with pytest.raises(CompareFailedError) as stale:
        _retry(lambda: kv.compare_and_swap(prefix + "k", b"x", lost.revision), deadline)
    assert stale.value.actual_revision == kept.revision
    new = _retry(lambda: kv.compare_and_swap(prefix + "k", b"new", kept.revision), deadline)
    assert new.revision > lost.revision, "new revisions start at the server's clock: past the lost ones"
    with pytest.raises(HistoryCompactedError):  # now ahead of the lost revision: a history that never held it
        kv.watch(prefix, lost.revision, 1.0)
    assert [e.revision for e in kv.watch(prefix, kept.revision, 1.0)] == [new.revision]


# -- the shared check, on one server ----------------------------------------------------------
def test_a_watch_from_a_revision_the_server_never_issued_is_history_compacted(rdzv_server_redis: Any) -> None:
    """``redis://`` too: a revision between two consecutive ones of the server's history (what a
    client holds after the server lost writes it saw) is HistoryCompactedError; one just below an event
    still returns that event."""
    with backends_opened(lambda: f"redis://{rdzv_server_redis.address}/") as open_:
        kv = open_()
        prefix = f"diverged/t{uuid.uuid4().hex}/"
        a = kv.put(prefix + "a", b"1")
        b = kv.put(prefix + "b", b"2")
        assert b.revision - a.revision > 2, "revisions follow the server's clock in microseconds"
        with pytest.raises(HistoryCompactedError):
            kv.watch(prefix, a.revision + 1, 0)
        assert [e.revision for e in kv.watch(prefix, b.revision - 1, 0)] == [b.revision]
        assert [e.revision for e in kv.watch(prefix, a.revision, 0)] == [b.revision]
