"""Leader failure in a real three-member etcd cluster: the job goes on through the new leader.

A :class:`~conformance_tests.etcd_cluster.EtcdCluster` (three ``etcd`` processes on
loopback, v2 API enabled) serves both ``etcd-v3://`` and ``etcd-v2://``. Every
client gets the multi-endpoint URL ``SCHEME://LEADER,F1,F2/`` with the current
leader *first*, so the member the test kills -9 is the one every client talks to:
each client must fail over to another endpoint while the other two elect a new
leader. Agents are threads, each with its own client (as separate hosts would
have), with ``operation_timeout`` = :data:`OP_TIMEOUT` and ``keep_alive_ttl`` =
:data:`TTL`.

Expected:

* leader killed mid-rendezvous (two of three agents joined, ``min_nodes`` = 3
  not reached, then the third arrives): the three form one round of 3 within
  :func:`recovery_bound` seconds of the kill; nobody raises.
* leader killed while a final round runs: a c10d Store ``set``/``get``
  (:class:`~rdzv_core.torch_api.store.KVStore`) succeeds within ``operation_timeout`` of the
  kill; the round stays final -- same record, every keep-alive key present, no
  keep-alive found its key gone, ``num_nodes_waiting()`` 0 for both members --
  until ``TTL + ttl_resolution`` after the kill (a key not refreshed since would
  be gone by then; a watch sees no ``DELETE`` under the run); then the members
  re-rendezvous into a round with a higher version.
* a write sent at once after the kill (``put``; and ``create``, ``compare_and_swap``,
  ``add``, ``compare_and_delete`` together) succeeds within ``operation_timeout``, each
  applied exactly once, although its first attempt is held by a follower that still
  forwards to the dead leader.

Measured times are recorded as test properties (``record_property``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import shutil
import time
import uuid
from typing import Any, Callable, Iterator

import pytest

from conformance_tests.agents import quiet
from conformance_tests.etcd_cluster import EtcdCluster, EtcdMember
from conformance_tests.agents import Agent, crew_of, round_of
from conformance_tests.plugin import backends_opened
from rdzv_core import (
    EventType,
    KVBackend,
    list_backends,
)

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary on PATH")

SCHEMES = ["etcd-v3", "etcd-v2"]
OP_TIMEOUT = 3.0  #: operation_timeout (seconds): long enough to ride out one election (0.5-1 s here)
TTL = 3.0  #: keep_alive_ttl (seconds): a refresh every second; the keys outlive an election and a failover
LAST_CALL = 0.5  #: last_call_timeout (seconds)
OVERALL = 60.0  #: the agents' overall rendezvous timeout (seconds)
ELECTION = 1.5  #: an election after the leader's death: 500 ms election timeout, randomized up to 2x, plus a vote
MARGIN = 3.0  #: scheduling slack (seconds) on a loaded 2-core machine


def recovery_bound(scheme: str) -> float:
    """Seconds from the leader's death to a completed round: the election, one failed call
    (``operation_timeout``) and the rendezvous' backoff (1 s at most), a frozen round holding
    a ghost ticket lapsing (``TTL + ttl_resolution``: an agent whose wait failed takes a new
    ticket), the last call, and :data:`MARGIN`."""
    resolution = list_backends()[scheme].spec.capabilities.ttl_resolution
    return ELECTION + OP_TIMEOUT + 1.0 + TTL + resolution + LAST_CALL + MARGIN


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """Three etcd members for the module; stopped (data removed) at its end."""
    with EtcdCluster(3) as cluster:
        yield cluster


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """The cluster with every member running, before and after the test (a killed member is restarted)."""
    etcd_cluster.start()
    etcd_cluster.leader()
    yield etcd_cluster
    etcd_cluster.start()


@pytest.fixture(params=SCHEMES)
def scheme(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def leader(cluster: EtcdCluster) -> EtcdMember:
    """The current leader (clients list it first)."""
    return cluster.leader()


@pytest.fixture
def clients(cluster: EtcdCluster, leader: EtcdMember, scheme: str) -> Iterator[Callable[[], KVBackend]]:
    """``clients()`` -> a new client on ``SCHEME://LEADER,F1,F2/``; all closed after the test."""
    with backends_opened(lambda: cluster.url(scheme, first=leader, operation_timeout=OP_TIMEOUT)) as make:
        yield make


@pytest.fixture
def crew(clients: Callable[[], KVBackend]) -> Iterator[Callable[..., list[Agent]]]:
    """``crew(n, **params)`` -> n agents of one fresh run, each on its own client (not started)."""
    defaults = {"keep_alive_ttl": TTL, "last_call_timeout": LAST_CALL, "timeout": OVERALL}
    with crew_of(clients, "cluster", defaults) as make:
        yield make


# -- tests ------------------------------------------------------------------------------------
def test_leader_killed_mid_rendezvous(scheme: str, cluster: EtcdCluster, leader: EtcdMember, crew, clients,
                                      record_property) -> None:
    """Kill -9 the leader while two of three agents wait (min_nodes 3); the third arrives; a round of 3 forms."""
    a, b, c = crew(3, min_nodes=3, max_nodes=3)
    observer = clients()
    root = a.rdzv.root
    a.start()
    b.start()
    deadline = time.monotonic() + 30
    while a.rdzv.describe().get("joined", 0) < 2:
        assert time.monotonic() < deadline, f"two agents never joined: {a.rdzv.describe()}"
        assert not (a.done.is_set() or b.done.is_set()), f"an agent ended early: {a.error!r} {b.error!r}"
        observer.watch(root + "/", observer.list(root + "/")[1], 0.5)
    killed = time.monotonic()
    leader.kill()
    c.start()
    bound = recovery_bound(scheme)
    results = round_of([a, b, c], bound)
    recovered = time.monotonic() - killed
    new_leader = cluster.leader(exclude=leader)
    record_property("recovery_s", round(recovered, 2))
    assert recovered <= bound, f"the round formed {recovered:.2f} s after the kill (bound {bound:.1f} s)"
    assert new_leader is not leader
    assert results[0].version >= 1


def test_leader_killed_during_a_final_round(scheme: str, cluster: EtcdCluster, leader: EtcdMember, crew, clients,
                                            record_property) -> None:
    """Kill -9 the leader while a final round of 2 trains: the round stays final, its Store keeps working.

    Judged over ``TTL + ttl_resolution`` after the kill (a watch under the run: no ``DELETE``),
    then: the round record is unchanged, both keep-alive keys are there, no keep-alive found its
    key gone, ``num_nodes_waiting()`` is 0 for both members, and a c10d Store ``set``/``get`` works
    at once. Finally the members re-rendezvous into a round with a higher version.

    On etcd-v2 a keep-alive refresh is a write, so this also checks that a write sent just
    after the leader's death is retried in time (see
    ``test_write_right_after_leader_death_is_not_held_for_the_whole_deadline``).
    """
    pytest.importorskip("torch")
    from rdzv_core.torch_api.store import KVStore

    members = crew(2, min_nodes=2, max_nodes=2)
    first = round_of([m.start() for m in members], 30)
    version = first[0].version
    observer = clients()
    rdzv = members[0].rdzv
    state_key = rdzv.keys.round_record
    record = observer.get(state_key)
    assert record is not None
    stores = [KVStore(m.kv, m.rdzv.store_prefix(version), datetime.timedelta(seconds=OP_TIMEOUT)) for m in members]
    stores[0].set("before", b"1")
    after = observer.list(rdzv.keys.tree)[1]

    killed = time.monotonic()
    leader.kill()
    gone = _deletes_under(observer, rdzv.keys.tree, after, until=killed + TTL + _resolution(scheme))
    record_after = observer.get(state_key)
    alive = observer.list(rdzv.keys.alive_dir(version, rdzv.current.round_id or None))[0]
    waiting = [m.rdzv.num_nodes_waiting() for m in members]
    keepalives = [m.rdzv._keepalive for m in members]
    t0 = time.monotonic()
    stores[1].set("after", b"2")
    got = (stores[0].get("after"), stores[1].get("before"))
    store_s = time.monotonic() - t0
    lapsed = [k is not None and k.lapsed.is_set() for k in keepalives]
    record_property("store_s", round(store_s, 2))
    record_property("keepalive_lapsed", lapsed)

    assert got == (b"2", b"1")
    assert store_s <= MARGIN, f"the Store took {store_s:.2f} s with the new leader in place"
    assert record_after is not None and record_after.value == record.value, (record.value, record_after)
    assert sorted(e.key.rsplit("/", 1)[1] for e in alive) == ["rank_0", "rank_1"], alive
    assert waiting == [0, 0], "a member was told to re-rendezvous"
    assert all(k is not None and k.is_alive() for k in keepalives), "a keep-alive thread ended"
    second = round_of([m.start() for m in members], recovery_bound(scheme))
    assert second[0].version > version
    assert not gone and not any(lapsed), f"keep-alive keys expired after the kill: {gone} (lapsed: {lapsed})"


def test_write_right_after_leader_death_is_not_held_for_the_whole_deadline(
        scheme: str, cluster: EtcdCluster, leader: EtcdMember, clients, record_property) -> None:
    """``put`` sent at once after the leader's kill -9 succeeds within ``operation_timeout``.

    The first attempt goes to a follower that still forwards to the dead leader, and etcd
    would hold it for its own request timeout (5 s + 2 x election timeout); the backend
    gives one attempt at most ``max(0.5, operation_timeout / 3)`` s and sends the write
    again (``put`` may be repeated), by when the other two have elected a leader.
    """
    kv = clients()
    kv.put("cluster/probe", b"0")
    leader.kill()
    t0 = time.monotonic()
    try:
        kv.put("cluster/probe", b"1")
    finally:
        record_property("put_s", round(time.monotonic() - t0, 2))
    assert kv.get("cluster/probe").value == b"1"


def test_compare_guarded_writes_right_after_leader_death(
        scheme: str, cluster: EtcdCluster, leader: EtcdMember, clients, record_property) -> None:
    """``create`` (with and without TTL), ``compare_and_swap``, ``add`` and ``compare_and_delete``,
    sent together at once after the leader's kill -9, each take effect exactly once within
    ``operation_timeout``: their first attempts are held and lost like the ``put`` above, and
    the retries must neither fail on an earlier attempt's result nor apply twice."""
    kv = clients()
    base = f"guarded{uuid.uuid4().hex[:8]}/"
    cas = kv.put(base + "cas", b"old")
    doomed = kv.put(base + "doomed", b"x")
    assert kv.add(base + "n", 5) == 5
    calls: dict[str, Callable[[], Any]] = {
        "create": lambda: kv.create(base + "new", b"mine"),
        "create_ttl": lambda: kv.create(base + "lease", b"mine", ttl=30),
        "cas": lambda: kv.compare_and_swap(base + "cas", b"new", cas.revision),
        "add": lambda: kv.add(base + "n", 1),
        "cad": lambda: kv.compare_and_delete(base + "doomed", doomed.revision),
    }
    leader.kill()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        results = {name: future.result() for name, future in futures.items()}  # raises a call's error
    record_property("guarded_s", round(time.monotonic() - t0, 2))
    observer = clients()
    assert observer.get(base + "new") == results["create"]
    assert observer.get(base + "lease") == results["create_ttl"]
    assert observer.get(base + "cas") == results["cas"] and results["cas"].value == b"new"
    assert results["add"] == 6 and observer.get(base + "n").value == b"6"
    assert observer.get(base + "doomed") is None


# -- helpers ----------------------------------------------------------------------------------
def _resolution(scheme: str) -> float:
    return float(list_backends()[scheme].spec.capabilities.ttl_resolution)


def _deletes_under(kv: KVBackend, prefix: str, after: int, until: float) -> list[Any]:
    """``DELETE`` events under ``prefix`` after revision ``after``, watched until ``until`` (monotonic)."""
    return [e for e in quiet(kv, prefix, after, until - time.monotonic()) if e.type is EventType.DELETE]


def test_a_member_left_alone_gives_no_stale_read(scheme: str, cluster: EtcdCluster, leader: EtcdMember) -> None:
    """A follower misses a write (paused), then resumes while the other two are paused: it holds an old value
    and no quorum. A client of that member alone must not be answered from its copy: the read fails with
    ``BackendUnavailableError`` (a linearizable read needs a quorum). Before the fix, etcd v2 answered the old value
    (a GET without ``quorum=true`` is served from the member's own store): an agent read a round from before
    a partition as the current one and restarted a training job for nothing (multi-host scenario 4)."""
    from rdzv_core import BackendUnavailableError, open_backend

    follower = next(m for m in cluster.members if m is not leader)
    others = [m for m in cluster.members if m is not follower]
    key = f"stale/{uuid.uuid4().hex}"
    with backends_opened(lambda: cluster.url(scheme, first=leader, operation_timeout=OP_TIMEOUT)) as make:
        writer = make()
        writer.put(key, b"1")
        alone = open_backend(f"{scheme}://{follower.address}/?operation_timeout=2")
        try:
            deadline = time.monotonic() + 10
            while (entry := alone.get(key)) is None or entry.value != b"1":  # the follower has the first value
                assert time.monotonic() < deadline, "the follower never saw the first write"
                time.sleep(0.05)
            follower.pause()
            try:
                writer.put(key, b"2")  # the leader and the other follower: a quorum
            finally:
                for member in others:
                    member.pause()
                follower.resume()
            try:
                with pytest.raises(BackendUnavailableError):
                    got = alone.get(key)
                    pytest.fail(f"read {got!r} from a member without a quorum (the current value is b'2')")
            finally:
                for member in others:
                    member.resume()
        finally:
            alone.close()
