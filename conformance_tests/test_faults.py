"""Faults (marker ``faults``): the server dies, restarts or stops answering; the stored state is corrupt.

Two families, each test's docstring stating what is expected:

* **Server faults** drive the backend's server controller (fixture
  ``rdzv_server``: ``kill()``, ``start()``, ``pause()``, ``resume()``) and are
  skipped, with the reason, for a URL without a ``{server:NAME}`` placeholder.
  The server is shared by the whole session, so every test leaves it running
  (restarted and resumed in a ``finally`` and again by the ``server`` fixture).
  Clients are opened with ``operation_timeout`` = :data:`OP_TIMEOUT`.
* **Bad input** needs no controller: corrupt round records and
  counters written straight into the backend, and values above the backend's
  ``max_value_bytes`` given to the c10d Store and to ``store_extra_data``.
  (``test_rendezvous.py::test_corrupt_round_record_is_a_state_error`` has the
  basic garbage values; this module adds the others.)
* Two state-machine cases run once, on ``memory://``, whatever the URL:
  a run whose keys were lost while agents waited, and a record with more
  participants than ``max_nodes``.

Agents are threads, each with its own client (as separate hosts would have).
Measured times are recorded as test properties (``record_property``), from
which ``conformance_tests/reliability_table.py`` renders ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from typing import Any, Callable, Iterator, TypeVar

import pytest

from rdzv_core import (
    BackendTimeoutError,
    BackendUnavailableError,
    KVBackend,
    Rendezvous,
    RendezvousParams,
    RendezvousStateError,
    ValueTooLargeError,
    open_backend,
)
from rdzv_core.rendezvous import RoundRecord, RunKeys, Status

from .plugin import backends_opened
from .agents import Agent, crew_of, round_of

pytestmark = pytest.mark.faults

T = TypeVar("T")

OP_TIMEOUT = 1.0  #: ``operation_timeout`` (seconds) of every client these tests open
#: How long one operation against a silent (paused) server may take: one attempt of
#: ``operation_timeout``, plus the client's own cut-off (the PostgreSQL example cuts a
#: call at ``2 * operation_timeout + 1``), plus 1 s of scheduling slack (a loaded 2-core
#: machine). A client that retried silently would take a multiple of ``operation_timeout``.
SILENT_LIMIT = 2 * OP_TIMEOUT + 1.0 + 1.0
TTL = 1.0  #: keep_alive_ttl of the rounds below (seconds)
LAST_CALL = 0.5  #: last_call_timeout (seconds)
OVERALL = 40.0  #: the agents' overall rendezvous timeout (seconds)
MARGIN = 3.0  #: scheduling slack (seconds) on top of the TTL-derived bounds


# -- fixtures and helpers -----------------------------------------------------------------
def _with_query(url: str, **query: Any) -> str:
    base, _, fixed = url.partition("?")
    pairs = ([fixed] if fixed else []) + [f"{k}={v}" for k, v in query.items()]
    return base + "?" + "&".join(pairs)


@pytest.fixture
def fast_kv(rdzv_base_url: str) -> Iterator[Callable[[], KVBackend]]:
    """Open clients with ``operation_timeout=1``; all are closed after the test."""
    with backends_opened(lambda: _with_query(rdzv_base_url, operation_timeout=OP_TIMEOUT)) as factory:
        yield factory


@pytest.fixture
def server(rdzv_server: Any) -> Iterator[Any]:
    """The controller; whatever the test did, the server is resumed and running afterwards."""
    yield rdzv_server
    rdzv_server.resume()
    rdzv_server.start()


@pytest.fixture
def crew(fast_kv: Callable[[], KVBackend]) -> Iterator[Callable[..., list[Agent]]]:
    """``crew(n, **params)`` -> n agents of one fresh run, each on its own fast client (not started)."""
    defaults = {"keep_alive_ttl": TTL, "last_call_timeout": LAST_CALL, "timeout": OVERALL}
    with crew_of(fast_kv, "faults", defaults, leave=True) as make:
        yield make


def _eventually(fn: Callable[[], T], deadline: float) -> T:
    """``fn()``, retried (jittered 50-100 ms) while it raises BackendUnavailableError, until ``deadline``."""
    while True:
        try:
            return fn()
        except BackendUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(random.uniform(0.05, 0.1))


def _resolution(capabilities: Any) -> float:
    return float(capabilities.ttl_resolution)


# -- server faults ------------------------------------------------------------------------
def test_server_restart_mid_rendezvous(server: Any, crew, fast_kv, record_property) -> None:
    """Kill -9 the server while two of three agents wait for the third; restart it; the round completes.

    The server comes back with its data (every shipped controller persists).
    Expected: once the third agent arrives, all three finish one round of 3
    within the overall timeout, raising nothing: the waiting agents retry
    ``BackendUnavailableError`` until their deadline. (A waiting agent that retries
    takes a new ticket in the same round; its old one is a ghost that makes the
    round freeze with a member who never confirms, so it can take one frozen-round
    TTL longer.) Losing the keys instead is
    ``test_round_recreated_after_state_loss_is_not_taken_for_the_old_one``.
    """
    a, b, c = crew(3, min_nodes=3, max_nodes=3)
    observer = fast_kv()
    watcher = Rendezvous(observer, a.rdzv.run_id, a.rdzv.params)
    a.start()
    b.start()
    deadline = time.monotonic() + 30
    while watcher.describe().get("joined", 0) < 2:
        assert time.monotonic() < deadline, f"two agents never joined: {watcher.describe()}"
        observer.watch(watcher.keys.tree, observer.list(watcher.keys.tree)[1], 0.5)
    killed = time.monotonic()
    server.kill()
    try:
        server.start()
        restarted = time.monotonic()
        c.start()
        results = round_of([a, b, c], OVERALL)
    finally:
        server.start()
    record_property("downtime_s", round(restarted - killed, 2))
    record_property("recovery_s", round(time.monotonic() - restarted, 2))
    assert results[0].version >= 1


def test_server_killed_mid_watch(server: Any, fast_kv, key_prefix: str, record_property) -> None:
    """Kill -9 the server while a watch (timeout 30 s) waits: it ends within ``SILENT_LIMIT`` s, never hangs.

    Expected: the watch returns ``[]`` or raises a ``BackendUnavailableError`` subclass
    within about ``operation_timeout`` of the kill (a watch retries a lost
    connection for ``operation_timeout`` at most). After the restart a new watch
    on the same client sees a new write.
    """
    kv, writer = fast_kv(), fast_kv()
    after = kv.put(key_prefix + "k", b"0").revision
    outcome: list[Any] = []
    entered = threading.Event()

    def watch() -> None:
        entered.set()
        try:
            outcome.append(kv.watch(key_prefix, after, 30.0))
        except BaseException as exc:  # judged below
            outcome.append(exc)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert entered.wait(10)
    killed = time.monotonic()
    server.kill()
    try:
        thread.join(SILENT_LIMIT + 5)
        ended = time.monotonic() - killed
        assert not thread.is_alive(), "the watch hung after the server was killed"
        server.start()
        up = time.monotonic()
        revision = _eventually(lambda: kv.list(key_prefix)[1], up + 15)
        put = _eventually(lambda: writer.put(key_prefix + "k", b"after"), up + 15)
        events = _eventually(lambda: kv.watch(key_prefix, revision, 10.0), up + 15)
    finally:
        server.start()
    record_property("watch_end_s", round(ended, 2))
    record_property("watch_outcome", "returned" if isinstance(outcome[0], list) else type(outcome[0]).__name__)
    assert outcome[0] == [] or isinstance(outcome[0], BackendUnavailableError), f"unexpected: {outcome[0]!r}"
    assert ended <= SILENT_LIMIT, f"the watch ended {ended:.2f} s after the kill (limit {SILENT_LIMIT} s)"
    assert any(e.key == key_prefix + "k" and e.value == b"after" and e.revision == put.revision for e in events)


def test_server_paused_longer_than_ttl(server: Any, crew, fast_kv, key_prefix: str, capabilities,
                                       record_property) -> None:
    """SIGSTOP the server for longer than the keep-alive TTL, then SIGCONT it.

    Expected during the pause: ``get``, ``put``, ``list``, ``add``, ``refresh`` and
    the c10d Store's ``get``/``set`` (Store timeout 1 s) each raise
    ``BackendTimeoutError`` within ``SILENT_LIMIT`` s (about ``operation_timeout``, not
    a multiple of it; the Store's calls c10d's ``DistStoreError`` caused by it),
    and a 1 s ``watch`` returns ``[]`` or raises
    ``BackendUnavailableError`` within 1 s more; the members' keep-alive threads keep running
    through the errors. After the resume each keep-alive key either survived (its
    thread goes on refreshing) or expired (its thread reports ``lapsed`` and
    ends): recorded as ``ttl_after_pause``. The members' next rendezvous then
    succeeds: a round of 2 with a higher version.
    """
    pytest.importorskip("torch")
    import datetime

    from rdzv_core.torch_api.store import KVStore

    members = crew(2, min_nodes=2, max_nodes=2)
    first = round_of([m.start() for m in members], 30)
    clients = {name: fast_kv() for name in ("get", "put", "list", "add", "refresh", "watch", "store")}
    clients["refresh"].put(key_prefix + "ttl", b"x", ttl=60)
    after = clients["watch"].put(key_prefix + "w", b"x").revision
    store = KVStore(clients["store"], key_prefix + "store/", datetime.timedelta(seconds=1))
    store.set("present", b"1")
    ops: dict[str, Callable[[], Any]] = {
        "get": lambda: clients["get"].get(key_prefix + "w"),
        "put": lambda: clients["put"].put(key_prefix + "p", b"1"),
        "list": lambda: clients["list"].list(key_prefix),
        "add": lambda: clients["add"].add(key_prefix + "n", 1),
        "refresh": lambda: clients["refresh"].refresh(key_prefix + "ttl", 60),
        "watch": lambda: clients["watch"].watch(key_prefix, after, OP_TIMEOUT),
        "store.get": lambda: store.get("present"),
        "store.set": lambda: store.set("k", b"v"),
    }
    outcomes: dict[str, tuple[float, Any]] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        try:
            result: Any = fn()
        except BaseException as exc:  # judged below
            result = exc
        outcomes[name] = (time.monotonic() - t0, result)

    keepalives = [m.rdzv._keepalive for m in members]
    server.pause()
    try:
        paused = time.monotonic()
        threads = [threading.Thread(target=run, args=item, daemon=True) for item in ops.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, paused + SILENT_LIMIT + OP_TIMEOUT + 5 - time.monotonic()))
        while time.monotonic() < paused + TTL + 1.0:  # make the pause outlast the TTL
            time.sleep(0.05)
        # A keep-alive ends only when its key is found gone (``lapsed``; a starved thread on a loaded
        # machine can let a 1 s TTL run out before the pause): errors alone must not end it.
        alive_in_pause = [k is not None and (k.is_alive() or k.lapsed.is_set()) for k in keepalives]
    finally:
        server.resume()
    resumed = time.monotonic()
    for k in keepalives:  # an expired key is found at the first refresh after the resume
        if k is not None:
            k.lapsed.wait(max(0.0, resumed + TTL + _resolution(capabilities) + 1.0 - time.monotonic()))
    fates = ["expired" if k is not None and k.lapsed.is_set() else "kept" for k in keepalives]
    record_property("ttl_after_pause", "/".join(sorted(set(fates))))
    for name, (elapsed, _) in outcomes.items():
        record_property(f"paused_{name}_s", round(elapsed, 2))

    problems = [f"{name}: no answer within {SILENT_LIMIT + OP_TIMEOUT + 5} s" for name in ops if name not in outcomes]
    for name, (elapsed, result) in sorted(outcomes.items()):
        limit = SILENT_LIMIT
        if name == "watch":  # it may first wait out its own timeout, as for a quiet server
            limit += OP_TIMEOUT
            if not (result == [] or isinstance(result, BackendUnavailableError)):
                problems.append(f"watch: returned {result!r}, expected [] or BackendUnavailableError")
        elif name.startswith("store."):  # c10d's error for a timeout, the backend's as its cause
            import torch.distributed as dist

            if not (isinstance(result, dist.DistStoreError) and isinstance(result.__cause__, BackendTimeoutError)):
                problems.append(f"{name}: {result!r}, expected DistStoreError from BackendTimeoutError")
        elif not isinstance(result, BackendTimeoutError):
            problems.append(f"{name}: {result!r}, expected BackendTimeoutError")
        if elapsed > limit:
            problems.append(f"{name}: took {elapsed:.2f} s (limit {limit} s)")
    assert not problems, "\n".join(problems)
    assert alive_in_pause == [True, True], "a keep-alive thread ended during the pause with its key still there"
    for k, fate in zip(keepalives, fates, strict=True):
        assert k is not None
        if fate == "kept":
            assert k.is_alive(), "a keep-alive stopped refreshing although its key was kept"

    second = round_of([m.start() for m in members], TTL + _resolution(capabilities) + LAST_CALL + MARGIN + 10)
    assert second[0].version > first[0].version


def test_final_round_across_a_short_restart(server: Any, crew, fast_kv, capabilities, record_property) -> None:
    """Kill -9 and restart the server while a final round's members keep refreshing (TTL 4 s).

    Expected: with a server that keeps its data and a restart shorter than the
    time the keep-alive keys had left (``2/3 * TTL`` after a refresh every
    ``TTL/3``, less the keep-alive's retry delay), the round survives: its record
    is unchanged and every keep-alive key is still there once any key that was not
    refreshed after the restart would have expired. Recorded: ``round_survived``.
    Either way the members then re-rendezvous and form a new round of 2 (after a
    memory-less restart that is how they recover).
    """
    ttl = 4.0
    members = crew(2, min_nodes=2, max_nodes=2, keep_alive_ttl=ttl)
    first = round_of([m.start() for m in members], 30)
    observer = fast_kv()
    watcher = Rendezvous(observer, members[0].rdzv.run_id, members[0].rdzv.params)
    before = watcher.describe()
    killed = time.monotonic()
    server.kill()
    try:
        server.start()
        downtime = time.monotonic() - killed
        settle = killed + ttl + _resolution(capabilities) + 0.5  # an unrefreshed key is gone by then
        while time.monotonic() < settle:
            try:
                revision = observer.list(watcher.keys.tree)[1]
                observer.watch(watcher.keys.tree, revision, max(0.0, settle - time.monotonic()))
            except BackendUnavailableError:
                time.sleep(0.05)
        after = _eventually(watcher.describe, time.monotonic() + 10)
    finally:
        server.start()
    survived = after.get("status") == "final" and after.get("version") == before["version"] and \
        sorted(m["rank"] for m in after.get("alive", [])) == [0, 1]
    record_property("downtime_s", round(downtime, 2))
    record_property("round_survived", "yes" if survived else "no")
    lapsed = [m.rdzv._keepalive is not None and m.rdzv._keepalive.lapsed.is_set() for m in members]
    if capabilities.persistent and downtime < ttl * 2 / 3 - 0.5:
        assert survived, f"the round did not survive a {downtime:.2f} s restart: {after} (keep-alive lapsed: {lapsed})"
        assert lapsed == [False, False]
    second = round_of([m.start() for m in members], ttl + _resolution(capabilities) + LAST_CALL + MARGIN + 10)
    assert second[0].version > first[0].version or not survived


def test_round_recreated_after_state_loss_is_not_taken_for_the_old_one(record_property) -> None:
    """Two agents wait in round 1 (min_nodes 3); the run's keys are lost and round 1 is created anew; a third comes.

    Run once, on ``memory://``: it is the state machine's behaviour. The loss is
    played so that the waiting agents see only the new round record (the race a
    restart without data ends in when another agent recreates round 1 before they
    look). Expected: they notice it is not their round, join it, and the three form
    a round of 3 — keys that were lost are recreated, not assumed.
    """
    run_id = f"lost{uuid.uuid4().hex[:8]}"
    keys = RunKeys("torchelastic/p2p", run_id)
    with open_backend("memory://faults/") as kv:
        params = RendezvousParams(min_nodes=3, max_nodes=3, keep_alive_ttl=5, last_call_timeout=LAST_CALL, timeout=4)
        a, b, c = (Agent(kv, run_id, params) for _ in range(3))
        a.start()
        b.start()
        deadline = time.monotonic() + 10
        while (record := kv.get(keys.round_record)) is None or b'"id"' not in record.value:
            assert time.monotonic() < deadline, "round 1 was never set up"
            kv.watch(keys.tree, kv.list(keys.tree)[1], 0.2)
        joined = keys.joined(1, json.loads(record.value)["id"])
        while kv.tickets(joined) != 2:
            assert time.monotonic() < deadline, "two agents never joined round 1"
            kv.watch(keys.tree, kv.list(keys.tree)[1], 0.2)
        for lost in (keys.version_counter, joined):  # lost with the rest of the keys...
            kv.delete(lost)
        kv.add(keys.version_counter, 1)  # ...and round 1 set up anew by the first agent to look
        kv.put(keys.round_record, RoundRecord(Status.JOINABLE, 1).encode())
        c.start()
        try:
            round_of([a, b, c], 15)
        finally:
            for agent in (a, b, c):
                agent.rdzv.leave()


def test_after_the_run_keys_are_lost_the_old_round_never_reaches_the_new_ones_keys(fast_kv, key_prefix) -> None:
    """A's round 1 is final; every key of the run is lost (a backend restarted without its data);
    B then forms round 1 again -- the version counter started over. A writes its key back (its
    keep-alive, or its round watch marking it re-joining) and A's round Store still writes: neither
    may land in B's round. Each round's keys carry its random id, so B's Store and B's keep-alive
    prefix hold only B's keys. Before: both rounds used ``v_1/`` and ``store/v_1/``, and A's
    recreated key took the place of B's rank 0."""
    pytest.importorskip("torch")
    import datetime

    from rdzv_core.torch_api.store import KVStore

    kv = fast_kv()
    params = RendezvousParams(min_nodes=1, max_nodes=1, keep_alive_ttl=TTL, last_call_timeout=LAST_CALL,
                              timeout=OVERALL, prefix=key_prefix.rstrip("/"))
    a, b = Rendezvous(kv, "lost", params), Rendezvous(fast_kv(), "lost", params)
    try:
        first = a.next_round()
        old_store = KVStore(kv, a.store_prefix(first.version), datetime.timedelta(seconds=5))
        old_store.set("MASTER_ADDR", b"old-host")
        for entry in kv.list(a.keys.tree)[0]:  # the loss
            kv.delete(entry.key)
        second = b.next_round()
        assert (second.version, second.rank, second.world_size) == (first.version, 0, 1)  # version 1 again
        new_store = KVStore(b.kv, b.store_prefix(second.version), datetime.timedelta(seconds=5))
        deadline = time.monotonic() + 10 * TTL
        # A writes its key back: its keep-alive finds it gone, or its round watch marks it re-joining...
        while kv.get(a._alive_key or "") is None:
            assert time.monotonic() < deadline, "A did not write its key again"
            time.sleep(0.05)
        old_store.set("late", b"from the old round")  # ...and A's round Store still writes
        assert not new_store.check(["MASTER_ADDR"]) and not new_store.check(["late"])
        alive = b.kv.list(b.keys.alive_dir(second.version, second.round_id))[0]
        assert [json.loads(e.value)["node"] for e in alive] == [b.node_id]
    finally:
        a.leave()
        b.leave()


# -- bad input: corrupt state ------------------------------------------------------------------
CORRUPT_RECORDS = {
    "status not a string": b'{"status": 5, "version": 1}',
    "unknown status": b'{"status": "bogus", "version": 1}',
    "version a string": b'{"status": "joinable", "version": "1"}',
    "version a bool": b'{"status": "joinable", "version": true}',
    "version a float": b'{"status": "final", "version": 1.5, "participants": 1}',
    "negative version (joinable)": b'{"status": "joinable", "version": -1}',
    "participants missing": b'{"status": "frozen", "version": 1}',
    "participants zero": b'{"status": "final", "version": 1, "participants": 0}',
    "10 MB of garbage": "huge",
}


def _reset(url: str) -> int:
    from rdzv_admin.cli import main

    return main(["reset", url, "--yes"])


@pytest.mark.parametrize("garbage", list(CORRUPT_RECORDS.values()), ids=list(CORRUPT_RECORDS))
def test_corrupt_round_record_names_the_key_and_reset_recovers(garbage: Any, kv: KVBackend, rdzv_url, capabilities,
                                                               record_property) -> None:
    """A corrupt round record gives ``RendezvousStateError`` naming the key, promptly and once.

    Expected: ``next_round`` (min_nodes = max_nodes = 2) raises at its first read
    (its timeout is 3 s: a retry loop would end in ``RendezvousTimeoutError`` instead,
    with no crash loop of errors), and leaves the record as it was
    (for the operator to inspect); ``rdzv reset URL --yes`` deletes the run's
    state and the next ``next_round`` forms a round. The 10 MB case writes
    ``min(10 MB, max_value_bytes)`` bytes.
    """
    if garbage == "huge":
        size = min(10 * 1024 * 1024, capabilities.max_value_bytes or 10 * 1024 * 1024)
        garbage = bytes(range(256)) * (size // 256)
    url = rdzv_url()
    run_id = url.split("?")[0].rsplit("/", 1)[1]
    key = RunKeys("torchelastic/p2p", run_id).round_record
    kv.put(key, garbage)
    _assert_state_error_then_reset(kv, url, key, garbage, record_property)


def _assert_state_error_then_reset(kv: KVBackend, url: str, key: str, garbage: bytes, record_property) -> None:
    run_id = url.split("?")[0].rsplit("/", 1)[1]
    rdzv = Rendezvous(kv, run_id, RendezvousParams(min_nodes=2, max_nodes=2, timeout=3, keep_alive_ttl=TTL))
    t0 = time.monotonic()
    with pytest.raises(RendezvousStateError) as info:  # a retry loop would end in RendezvousTimeoutError
        rdzv.next_round()
    record_property("raised_after_s", round(time.monotonic() - t0, 2))
    assert info.value.key == key
    assert kv.get(key).value == garbage, "the corrupt record was changed"
    assert _reset(url) == 0
    solo = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1, max_nodes=1, timeout=20, keep_alive_ttl=TTL))
    assert solo.next_round().world_size == 1
    solo.leave()


@pytest.mark.parametrize("status", ["final", "frozen"])
def test_participants_above_max_is_a_state_error(status: str, record_property) -> None:
    """A round record with more participants than ``max_nodes`` gives ``RendezvousStateError`` naming the key.

    Run once, on ``memory://`` (it is the state machine's check, not the backend's).
    Expected: as for every corrupt record — raised at the first read, record left
    as it was, ``rdzv reset`` recovers.
    """
    run_id = f"above{uuid.uuid4().hex[:8]}"
    url = f"memory://faults/{run_id}"
    key = RunKeys("torchelastic/p2p", run_id).round_record
    garbage = b'{"status": "%s", "version": 1, "participants": 5}' % status.encode()
    with open_backend("memory://faults/") as kv:
        kv.put(key, garbage)
        _assert_state_error_then_reset(kv, url, key, garbage, record_property)


@pytest.mark.parametrize("counter", ["counter/version", "v_1/joined"])
def test_corrupt_counter_is_a_state_error(counter: str, kv: KVBackend, rdzv_url, capabilities: Any) -> None:
    """A counter that is not decimal gives ``RendezvousStateError`` naming it; ``rdzv reset`` recovers."""
    if counter == "v_1/joined" and not capabilities.tickets_in_value:
        pytest.skip("the backend's tickets are no stored value (tickets_in_value=False): no data there is corrupt")
    url = rdzv_url()
    run_id = url.split("?")[0].rsplit("/", 1)[1]
    keys = RunKeys("torchelastic/p2p", run_id)
    if counter == "v_1/joined":  # of a round 1 without id
        kv.put(keys.round_record, RoundRecord(Status.JOINABLE, 1).encode())
        key = keys.joined(1, None)
    else:
        key = keys.version_counter
    kv.put(key, b"not a number")
    rdzv = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1, max_nodes=1, timeout=20, keep_alive_ttl=TTL))
    try:
        with pytest.raises(RendezvousStateError) as info:
            rdzv.next_round()
        assert info.value.key == key
    finally:
        assert _reset(url) == 0
    assert rdzv.next_round().world_size == 1
    rdzv.leave()


# -- bad input: sizes ------------------------------------------------------------------------------

def _limit(capabilities: Any) -> int:
    limit = capabilities.max_value_bytes
    if limit is None:
        pytest.skip("backend declares no max_value_bytes (unlimited values): nothing to reject")
    if limit > 256 * 1024 * 1024:
        pytest.skip(f"backend declares max_value_bytes={limit}: too large to allocate in a test")
    return int(limit)


@pytest.mark.parametrize("operation", ["set", "compare_set", "append", "extra_data"])
def test_value_above_the_limit_fails_at_once(operation: str, kv: KVBackend, key_prefix: str, capabilities) -> None:
    """Store values above ``max_value_bytes`` raise ``ValueTooLargeError`` at once, having written nothing.

    Through the c10d Store (``set``, ``compare_set``, ``append``) and
    ``Rendezvous.store_extra_data``. "At once": the size is checked before any
    write (``append`` and ``compare_set`` read the key first), so nothing is seen
    changing under the prefix afterwards and the existing value is intact.
    """
    limit = _limit(capabilities)
    pytest.importorskip("torch")
    from rdzv_core.torch_api.store import KVStore

    too_big = b"\0" * (limit + 1)
    store = KVStore(kv, key_prefix + "store/")
    rdzv = Rendezvous(kv, "sizes", RendezvousParams(min_nodes=1, prefix=key_prefix.rstrip("/")))
    store.set("existing", b"small")
    after = kv.list(key_prefix)[1]
    calls = {
        "set": lambda: store.set("k", too_big),
        "compare_set": lambda: store.compare_set("existing", b"small", too_big),
        "append": lambda: store.append("existing", too_big),
        "extra_data": lambda: rdzv.store_extra_data(1, "blob", too_big),
    }
    with pytest.raises(ValueTooLargeError):
        calls[operation]()
    assert store.get("existing") == b"small"
    assert kv.watch(key_prefix, after, 0.2) == [], f"{operation} wrote something before raising ValueTooLargeError"


def test_multi_set_with_one_value_above_the_limit_writes_nothing(kv: KVBackend, key_prefix: str,
                                                                 capabilities) -> None:
    """``multi_set`` with one value above ``max_value_bytes`` raises ``ValueTooLargeError`` and writes no key."""
    limit = _limit(capabilities)
    pytest.importorskip("torch")
    from rdzv_core.torch_api.store import KVStore

    store = KVStore(kv, key_prefix + "store/")
    after = kv.put(key_prefix + "marker", b"").revision
    with pytest.raises(ValueTooLargeError):
        store.multi_set(["small", "big"], [b"1", b"\0" * (limit + 1)])
    assert kv.watch(key_prefix, after, 0.2) == [], "multi_set wrote a key before raising ValueTooLargeError"

