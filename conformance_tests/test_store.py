"""The c10d Store contract over every backend (marker ``store``), and gloo through it."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Callable

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from rdzv_core import KVBackend  # noqa: E402
from rdzv_core.torch_api.store import KVStore  # noqa: E402

pytestmark = pytest.mark.store


@pytest.fixture
def later():
    """``later(delay_s, fn)``: run ``fn`` on a timer thread; every timer is joined before teardown
    closes the clients it uses."""
    timers: list[threading.Timer] = []

    def start(delay: float, fn: Callable[[], object]) -> None:
        timer = threading.Timer(delay, fn)
        timers.append(timer)
        timer.start()

    yield start
    for timer in timers:
        timer.join(30)


@pytest.fixture
def make_store(kv_factory: Callable[[], KVBackend], key_prefix: str):
    """``make_store(timeout_s=5.0, prefix=None)`` -> a KVStore on a fresh client, shared prefix by default."""

    def make(timeout_s: float = 5.0, prefix: str | None = None) -> KVStore:
        return KVStore(kv_factory(), prefix or key_prefix + "store/", datetime.timedelta(seconds=timeout_s))

    return make


def test_set_get_binary_keys_and_values(make_store) -> None:
    a, b = make_store(), make_store()
    hostile = [b"", b"\x00", b"a/b", b"..", b"/../x", bytes(range(256)), "ключ".encode(), b"\xff\xfe"]
    for i, key in enumerate(hostile):
        a.set(key, bytes([i]) * (i + 1))
    for i, key in enumerate(hostile):
        assert b.get(key) == bytes([i]) * (i + 1)
    a.set("s", "text")
    assert b.get("s") == b"text"
    assert b.num_keys() == len(hostile) + 1


def test_get_waits_for_a_later_set(make_store, later) -> None:
    a, b = make_store(), make_store(timeout_s=10)
    later(0.3, lambda: a.set("late", b"v"))
    t0 = time.monotonic()
    assert b.get("late") == b"v"
    assert time.monotonic() - t0 < 8


def test_get_times_out_with_a_store_error(make_store) -> None:
    """A key never set: ``DistStoreError`` after the timeout, naming the key -- also on a backend whose
    watch request is what the deadline cuts (Redis said the backend had not answered in time)."""
    store = make_store(timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError) as caught:
        store.get("never")
    assert 0.9 <= time.monotonic() - t0 <= 3.0
    assert "'never'" in str(caught.value) and "timeout" in str(caught.value)  # torch's stores say "timeout"


def test_wait_and_check(make_store, later) -> None:
    a, b = make_store(), make_store()
    assert not b.check(["x", "y"])
    with pytest.raises(dist.DistStoreError):
        b.wait(["x"], datetime.timedelta(seconds=0.3))
    a.set("x", b"1")
    later(0.2, lambda: a.set("y", b"2"))
    b.wait(["x", "y"], datetime.timedelta(seconds=10))
    assert b.check(["x", "y"])


def test_add_is_atomic_across_clients(make_store) -> None:
    stores = [make_store() for _ in range(4)]

    def work(s: KVStore) -> None:
        for _ in range(25):
            s.add("counter", 1)

    threads = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert stores[0].add("counter", 0) == 100
    assert stores[1].get("counter") == b"100"


def test_compare_set(make_store) -> None:
    s = make_store()
    assert s.compare_set("k", "", "first") == b"first"  # absent + empty expected -> set
    assert s.compare_set("k", "wrong", "second") == b"first"  # mismatch -> current value
    assert s.compare_set("k", "first", "second") == b"second"
    assert s.get("k") == b"second"
    assert s.compare_set("absent", "x", "y") == b"x"  # absent + non-empty expected: unchanged
    assert not s.check(["absent"])


def test_delete_num_keys_multi(make_store) -> None:
    s = make_store()
    s.multi_set(["a", "b", "c"], [b"1", b"2", b"3"])
    assert s.multi_get(["c", "a"]) == [b"3", b"1"]
    assert s.num_keys() == 3
    assert s.delete_key("b") is True
    assert s.delete_key("b") is False
    assert s.num_keys() == 2
    s.append("a", b"+")
    assert s.get("a") == b"1+"


def test_set_timeout(make_store) -> None:
    s = make_store(timeout_s=30)
    s.set_timeout(datetime.timedelta(seconds=0.3))
    assert s.timeout == datetime.timedelta(seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        s.get("missing")
    assert time.monotonic() - t0 < 3


def test_prefixes_are_isolated(make_store, key_prefix: str) -> None:
    one, two = make_store(prefix=key_prefix + "one/"), make_store(prefix=key_prefix + "two/")
    one.set("k", b"1")
    assert not two.check(["k"])
    assert two.num_keys() == 0


def test_gloo_all_reduce_in_threads(make_store) -> None:
    """Gloo's C++ side drives the Python store (PrefixStore, waits, adds)."""
    world = 2
    results: dict[int, float] = {}
    errors: list[BaseException] = []
    # The Python stores must outlive the C++ objects that use them (pybind11 trampolines).
    stores = [make_store(timeout_s=30) for _ in range(world)]

    def member(rank: int) -> None:
        try:
            store = dist.PrefixStore("pg", stores[rank])
            pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=30))
            t = torch.tensor([float(rank + 1)])
            pg.allreduce([t]).wait()
            results[rank] = float(t.item())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {0: 3.0, 1: 3.0}


_GLOO_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from rdzv_core import create_handler
    handler = create_handler(sys.argv[1], local_addr="127.0.0.1")
    info = handler.next_rendezvous()
    dist.init_process_group("gloo", store=info.store, rank=info.rank, world_size=info.world_size)
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    print(f"RESULT {info.rank} {info.world_size} {t.item()}", flush=True)
    dist.destroy_process_group()
    handler.shutdown()
    """
)


def test_gloo_all_reduce_in_two_processes(rdzv_url, capabilities) -> None:
    """Two processes: handler -> next_rendezvous -> init_process_group(store=...) -> all_reduce."""
    if not capabilities.multi_process:
        pytest.skip("backend declares multi_process=False (one keyspace per process)")
    url = rdzv_url(min_nodes=2, max_nodes=2, keep_alive_ttl=2, timeout=60)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_SCRIPT, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode(errors="replace")[-2000:]
            outputs.append(out.decode())
    finally:
        for p in procs:
            p.kill()
    lines = sorted(line for o in outputs for line in o.splitlines() if line.startswith("RESULT"))
    assert lines == ["RESULT 0 2 3.0", "RESULT 1 2 3.0"]


def test_store_of_a_round_is_scoped_to_run_and_version(kv_factory) -> None:
    """Two runs on one backend never see each other's store keys."""
    from rdzv_core import Rendezvous, RendezvousParams

    p = RendezvousParams(min_nodes=1, keep_alive_ttl=1.0, timeout=20)
    a = Rendezvous(kv_factory(), f"a{uuid.uuid4().hex[:8]}", p)
    b = Rendezvous(kv_factory(), f"b{uuid.uuid4().hex[:8]}", p)
    ra, rb = a.next_round(), b.next_round()
    sa = KVStore(a.kv, a.store_prefix(ra.version), datetime.timedelta(seconds=1))
    sb = KVStore(b.kv, b.store_prefix(rb.version), datetime.timedelta(seconds=1))
    sa.set("MASTER_PORT", b"1234")
    assert not sb.check(["MASTER_PORT"])
    ra2 = a.next_round()
    assert ra2.version > ra.version
    assert not KVStore(a.kv, a.store_prefix(ra2.version)).check(["MASTER_PORT"])
    a.leave()
    b.leave()


# -- torch 2.13's queues and barrier ------------------------------------------------------------


def test_queue_fifo_under_concurrent_pushers_and_poppers(make_store) -> None:
    """Three clients push 20 items each while two others pop: every item is popped exactly once,
    and each popper sees each pusher's items in push order."""
    pushers, poppers = [make_store(timeout_s=30) for _ in range(3)], [make_store(timeout_s=30) for _ in range(2)]
    per_pusher, errors = 20, []
    seen: list[list[tuple[int, int]]] = [[] for _ in poppers]

    def push(c: int) -> None:
        for i in range(per_pusher):
            pushers[c].queue_push("jobs", f"{c}:{i}")

    def pop(p: int) -> None:
        try:
            for _ in range(len(pushers) * per_pusher // len(poppers)):
                c, i = poppers[p].queue_pop("jobs").decode().split(":")
                seen[p].append((int(c), int(i)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=pop, args=(p,)) for p in range(len(poppers))]
    threads += [threading.Thread(target=push, args=(c,)) for c in range(len(pushers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(x for s in seen for x in s) == [(c, i) for c in range(len(pushers)) for i in range(per_pusher)]
    for s in seen:
        for c in range(len(pushers)):
            mine = [i for cc, i in s if cc == c]
            assert mine == sorted(mine)
    assert pushers[0].queue_len("jobs") == 0


def test_queue_pop_blocks_until_a_push(make_store) -> None:
    a, b = make_store(), make_store(timeout_s=20)
    pushed_at: list[float] = []

    def push() -> None:
        pushed_at.append(time.monotonic())
        a.queue_push("q", b"late")

    timer = threading.Timer(0.3, push)
    timer.start()
    try:
        assert b.queue_pop("q") == b"late"
        returned_at = time.monotonic()
    finally:
        timer.join(30)
    assert pushed_at and returned_at >= pushed_at[0]
    assert a.queue_len("q") == 0


def test_queue_pop_timeout_and_empty(make_store) -> None:
    """Blocking pop on an empty queue: ``DistStoreError`` after the store timeout; ``block=False``:
    ``QueueEmptyError`` at once (both as TCPStore)."""
    store = make_store(timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(dist.QueueEmptyError):
        store.queue_pop("empty", block=False)
    assert time.monotonic() - t0 < 0.4
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError) as caught:
        store.queue_pop("empty")
    assert not isinstance(caught.value, dist.QueueEmptyError)
    assert 0.45 <= time.monotonic() - t0 <= 3.0


def test_queue_len_check_wait_and_keys_apart(make_store, later) -> None:
    """``queue_len`` counts items (0 for a queue never used); a queue is apart from the key of the
    same name and from ``num_keys``/``list_keys``; ``check``/``wait`` see a non-empty queue."""
    a, b = make_store(), make_store()
    assert a.queue_len("q") == 0
    assert not b.check(["q"])
    later(0.2, lambda: a.queue_push("q", b"x"))
    b.wait(["q"], datetime.timedelta(seconds=10))
    a.queue_push("q", "y")
    a.set("q", b"plain")
    assert b.queue_len("q") == 2
    assert b.get("q") == b"plain"
    assert b.num_keys() == 1 and b.list_keys() == ["q"]
    assert b.check(["q"])
    assert [b.queue_pop("q"), b.queue_pop("q")] == [b"x", b"y"]
    assert b.delete_key("q") and not b.check(["q"])


def test_barrier_across_clients(make_store) -> None:
    """Four clients: nobody leaves before the last arrives; then a barrier that only three reach
    raises ``DistStoreError`` on each after the store timeout (no timeout argument given)."""
    world = 4
    stores = [make_store(timeout_s=30) for _ in range(world)]
    arrived: list[float] = []
    left: list[float] = []
    errors: list[BaseException] = []

    def member(s: KVStore, key: str) -> None:
        try:
            arrived.append(time.monotonic())
            s.barrier(key, world)
            left.append(time.monotonic())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(s, "all")) for s in stores]
    for i, t in enumerate(threads):
        t.start()
        if i == 0:
            time.sleep(0.2)  # the others arrive later: the first must have waited for them
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(left) == world and min(left) >= max(arrived)

    for s in stores:
        s.set_timeout(datetime.timedelta(seconds=0.5))
    t0 = time.monotonic()
    threads = [threading.Thread(target=member, args=(s, "short")) for s in stores[:3]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 3 and all(isinstance(e, dist.DistStoreError) and "timeout" in str(e) for e in errors)
    assert time.monotonic() - t0 <= 5.0
    assert stores[0].add("short/num_members", 0) == 3


def test_extended_api_works_through_cpp(make_store) -> None:
    """``has_extended_api`` is True, and what it promises (append, multi_get, multi_set) works when
    C++ drives the store (``PrefixStore``, as gloo does)."""
    store = make_store()
    prefixed = dist.PrefixStore("pg", store)
    assert store.has_extended_api() and prefixed.has_extended_api()
    prefixed.multi_set(["a", "b"], ["1", "2"])
    prefixed.append("a", "+")
    assert prefixed.multi_get(["a", "b"]) == [b"1+", b"2"]
    assert store.get("pg/a") == b"1+"
