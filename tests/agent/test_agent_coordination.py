"""``rdzv_agent.coordination``: torch's rank assignment and exit barrier over a round's store (memory backend)."""

from __future__ import annotations

import datetime
import threading
import time
import uuid

import pytest

pytest.importorskip("torch")

from rdzv_agent import coordination  # noqa: E402
from rdzv_core import open_backend  # noqa: E402
from rdzv_core.torch_api.store import KVStore  # noqa: E402
from conformance_tests.agents import run_threads  # noqa: E402


@pytest.fixture
def store():
    kv = open_backend(f"memory://coord{uuid.uuid4().hex[:8]}/")
    yield KVStore(kv, "round/", datetime.timedelta(seconds=10))
    kv.close()


def test_ranks_follow_group_rank_then_local_rank_with_mixed_sizes_and_roles(store) -> None:
    """torch's ``_assign_worker_ranks``: bases are cumulative local world sizes; role ranks count per role."""
    nodes = [("trainer", 2), ("trainer", 1), ("evaluator", 3), ("trainer", 4)]  # group ranks 0..3
    deadline = time.monotonic() + 20
    results = run_threads(len(nodes), lambda g: coordination.assign_ranks(
        store, nodes[g][0], g, len(nodes), nodes[g][1], deadline, 0.05, lambda: False))
    assert results == [(0, 10, 0, 7), (2, 10, 2, 7), (3, 10, 0, 3), (6, 10, 3, 7)]


def test_a_missing_agent_ends_the_wait_when_the_round_is_gone(store) -> None:
    """Group rank 0 waits for a member that never publishes; the round ends (a lost member): RoundGone at once."""
    gone = threading.Event()
    threading.Timer(0.3, gone.set).start()
    t0 = time.monotonic()
    with pytest.raises(coordination.RoundGone):
        coordination.assign_ranks(store, "trainer", 0, 2, 1, time.monotonic() + 60, 0.05, gone.is_set)
    assert time.monotonic() - t0 < 10
    with pytest.raises(coordination.SetupTimeout):
        coordination.assign_ranks(store, "trainer", 0, 3, 1, time.monotonic() + 0.3, 0.05, lambda: False)


def test_exit_barrier_completes_when_every_agent_arrives(store) -> None:
    results = run_threads(3, lambda r: coordination.exit_barrier(store, r, 3, 20, 0.05, lambda: False))
    assert results == [coordination.COMPLETE] * 3


def test_exit_barrier_ends_when_the_round_ends_or_times_out(store) -> None:
    gone = threading.Event()
    threading.Timer(0.3, gone.set).start()
    t0 = time.monotonic()
    assert coordination.exit_barrier(store, 0, 2, 60, 0.05, gone.is_set) == coordination.LEFT
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    other = KVStore(store._kv, "other-round/", datetime.timedelta(seconds=10))
    assert coordination.exit_barrier(other, 1, 2, 0.5, 0.05, lambda: False) == coordination.TIMED_OUT
    assert 0.5 <= time.monotonic() - t0 < 10
    assert coordination.exit_barrier(other, 0, 1, 0.5, 0.05, lambda: False) == coordination.COMPLETE


def test_exit_barrier_outlasts_a_backend_restart() -> None:
    """The backend restarts while the agents wait at the barrier (and while the last one arrives): it completes."""
    pytest.importorskip("redis")
    from conformance_tests.redis_server import RedisServer

    server = RedisServer(appendonly=True)
    server.start()
    kv = open_backend(f"redis://{server.address}/?operation_timeout=0.5")
    try:
        store = KVStore(kv, "round/", datetime.timedelta(seconds=10))
        first: list = []
        waiting = threading.Thread(
            target=lambda: first.append(coordination.exit_barrier(store, 0, 2, 60, 0.1, lambda: False)))
        waiting.start()
        deadline = time.monotonic() + 10
        while not store.check([f"{coordination.BARRIER_PREFIX}/arrived/0"]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.kill()
        threading.Timer(1.5, server.start).start()
        assert coordination.exit_barrier(store, 1, 2, 60, 0.1, lambda: False) == coordination.COMPLETE
        waiting.join(30)
        assert first == [coordination.COMPLETE]
    finally:
        kv.close()
        server.stop()


def test_exit_barrier_says_unreachable_when_the_backend_never_answers() -> None:
    """The backend is gone for the whole barrier window: the outcome says so (not that the others did not finish)."""
    pytest.importorskip("redis")
    from conformance_tests.redis_server import RedisServer

    server = RedisServer()
    server.start()
    kv = open_backend(f"redis://{server.address}/?operation_timeout=0.3")
    try:
        store = KVStore(kv, "round/", datetime.timedelta(seconds=1))
        server.kill()
        assert coordination.exit_barrier(store, 0, 2, 1.5, 0.1, lambda: False) == coordination.UNREACHABLE
    finally:
        kv.close()
        server.stop()


def test_exit_barrier_outlasts_a_backend_that_lost_its_keys(monkeypatch, store) -> None:
    """The backend loses every key while an agent waits at the barrier (a server restarted without its data):
    the waiting agent writes its arrival again, and the barrier completes when the other one arrives."""
    monkeypatch.setattr(coordination, "BARRIER_REASSERT", 0.3)
    kv = store._kv
    first: list = []
    waiting = threading.Thread(
        target=lambda: first.append(coordination.exit_barrier(store, 0, 2, 30, 0.05, lambda: False)))
    waiting.start()
    deadline = time.monotonic() + 10
    while not store.check([f"{coordination.BARRIER_PREFIX}/arrived/0"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for entry in kv.list("")[0]:
        kv.delete(entry.key)
    assert not store.check([f"{coordination.BARRIER_PREFIX}/arrived/0"])
    assert coordination.exit_barrier(store, 1, 2, 30, 0.05, lambda: False) == coordination.COMPLETE
    waiting.join(30)
    assert first == [coordination.COMPLETE]
