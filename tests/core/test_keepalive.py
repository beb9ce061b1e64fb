"""The process-wide keep-alive scheduler (:mod:`rdzv_core.rendezvous.keepalive`), on real backends.

* 200 keys on one scheduler (memory backend, TTL :data:`TTL`): none expires or is
  found gone while watched for several TTLs, and the process runs the scheduler and
  at most ``REFRESH_WORKERS`` refresh threads, not one thread per key;
* refreshes blocked in a black hole (a real ``redis-server`` behind
  :class:`~conformance_tests.proxy.TCPProxy`) do not make keys on a healthy
  backend lapse; the blocked keys' own refreshes resume once the network is back;
* after :meth:`~rdzv_core.rendezvous.keepalive.KeepAlive.stop` the key is refreshed no more: it
  expires and is not written again;
* a ``fork()``-ed child (of a process whose scheduler runs) keeps its own keys alive.

Absence ("no key expired") is judged by a watch for ``DELETE`` events over a window
set by the test, at least one TTL longer than any refresh interval.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from typing import Any, Iterator

import pytest

from conformance_tests.agents import quiet
from conformance_tests.proxy import Mode, TCPProxy
from rdzv_core import EventType, KVBackend, list_backends, open_backend
from rdzv_core.errors import ConfigError
from rdzv_core.outage import Responsiveness
from rdzv_core.rendezvous.keepalive import REFRESH_WORKERS, THREAD_PREFIX, KeepAlive

TTL = 1.5  #: keep-alive TTL (seconds): a refresh every 0.5 s, 1 s of slack per refresh on a loaded machine


@pytest.fixture
def memory() -> Iterator[KVBackend]:
    kv = open_backend(f"memory://ka{uuid.uuid4().hex[:8]}/")
    yield kv
    kv.close()


@pytest.fixture
def prefix() -> str:
    return f"keepalive/t{uuid.uuid4().hex[:12]}/"


def _deletes(kv: KVBackend, prefix: str, after: int, until: float) -> list[Any]:
    """``DELETE`` events under ``prefix`` after revision ``after``, watched until ``until`` (monotonic)."""
    return [e.key for e in quiet(kv, prefix, after, until - time.monotonic()) if e.type is EventType.DELETE]


def _puts(kv: KVBackend, prefix: str, after: int, keys: set[str], until: float) -> set[str]:
    """Which of ``keys`` were written (``PUT`` events) after revision ``after``, watched until all were
    or until ``until`` (monotonic)."""
    seen: set[str] = set()
    while seen != keys and (remaining := until - time.monotonic()) > 0:
        for event in kv.watch(prefix, after, remaining):
            after = max(after, event.revision)
            if event.type is EventType.PUT and event.key in keys:
                seen.add(event.key)
    return seen


def _start(kv: KVBackend, keys: list[str], ttl: float) -> list[KeepAlive]:
    for key in keys:
        kv.put(key, b"member", ttl=ttl)
    return [KeepAlive(kv, key, ttl, value=b"member", name="test") for key in keys]


def test_two_hundred_keys_are_all_refreshed_before_they_lapse(memory: KVBackend, prefix: str) -> None:
    keys = [f"{prefix}k{i:03d}" for i in range(200)]
    after = memory.list(prefix)[1]
    keepalives = _start(memory, keys, TTL)
    try:
        deleted = _deletes(memory, prefix, after, until=time.monotonic() + 4 * TTL)
        threads = [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]  # after 4 TTLs
        present = {e.key for e in memory.list(prefix)[0]}
    finally:
        for ka in keepalives:
            ka.stop()
    assert not deleted, f"{len(deleted)} keys expired, e.g. {deleted[:3]}"
    assert present == set(keys)
    assert not any(ka.lapsed.is_set() or ka.recreated for ka in keepalives)
    # not a thread per key: microsecond refreshes overlap little (the pool may reach REFRESH_WORKERS under load)
    assert len(threads) <= min(REFRESH_WORKERS, len(keys) // 2), f"{len(threads)} keep-alive threads for 200 keys"
    assert not any(ka.is_alive() for ka in keepalives)


def test_refreshes_blocked_in_a_black_hole_do_not_delay_other_keys(
        rdzv_server_redis: Any, memory: KVBackend, prefix: str) -> None:
    """8 keys whose refreshes hang (``operation_timeout`` 2 s) while 50 memory keys must go on being refreshed."""
    op_timeout = 2.0
    with TCPProxy(rdzv_server_redis.host, rdzv_server_redis.port) as proxy:
        blocked_kv = open_backend(f"redis://{proxy.address}/?operation_timeout={op_timeout}")
        try:
            blocked = _start(blocked_kv, [f"{prefix}hole{i}" for i in range(8)], TTL)
            healthy_keys = [f"{prefix}ok{i:02d}" for i in range(50)]
            after = memory.list(prefix)[1]
            healthy = _start(memory, healthy_keys, TTL)
            since = blocked_kv.list(prefix)[1]
            proxy.set_mode(Mode.BLACKHOLE)
            # Long enough for every blocked key to hang in a refresh twice, and for any healthy
            # key not refreshed meanwhile to expire.
            deleted = _deletes(memory, prefix, after, until=time.monotonic() + 2 * op_timeout + TTL)
            proxy.set_mode(Mode.PASS)
            # The Redis keys expired in the hole (TTL < hole): found gone and written again once back.
            restored = _puts(blocked_kv, prefix, since, {ka.key for ka in blocked},
                             until=time.monotonic() + 2 * op_timeout + TTL)
            for ka in healthy + blocked:
                ka.stop()
        finally:
            blocked_kv.close()
    assert not deleted, f"healthy keys expired while other refreshes hung: {deleted[:5]}"
    assert not any(ka.lapsed.is_set() for ka in healthy)
    assert restored == {ka.key for ka in blocked}, "a blocked key was not written again after the black hole"
    assert all(ka.lapsed.is_set() and ka.recreated >= 1 for ka in blocked)


def test_an_outage_is_one_warning_not_one_per_failed_refresh(
        rdzv_server_redis: Any, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Refreshes failing for many intervals (connections dropped) log one WARNING, then DEBUG; INFO once back."""
    with TCPProxy(rdzv_server_redis.host, rdzv_server_redis.port) as proxy:
        kv = open_backend(f"redis://{proxy.address}/?operation_timeout=0.5")
        try:
            caplog.set_level("DEBUG", logger="rdzv_core.rendezvous.keepalive")
            (ka,) = _start(kv, [prefix + "k"], 0.6)  # a refresh every 0.2 s; failures retry every 0.05-0.1 s
            proxy.set_mode(Mode.DROP)
            deadline = time.monotonic() + 30
            while sum(r.levelname == "DEBUG" for r in caplog.records) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            proxy.set_mode(Mode.PASS)
            while not any(r.levelname == "INFO" for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.05)
            ka.stop()
        finally:
            kv.close()
    records = [r for r in caplog.records if r.name == "rdzv_core.rendezvous.keepalive"]
    levels = [r.levelname for r in records]
    assert levels.count("DEBUG") >= 5, levels  # five or more failures after the first...
    # ...at WARNING once (plus one if the key lapsed in the outage and was written again)
    assert levels.count("WARNING") <= 2, levels
    assert "INFO" in levels, levels  # and the recovery once


def test_stop_ends_the_refreshes(memory: KVBackend, prefix: str) -> None:
    key = prefix + "k"
    resolution = list_backends()["memory"].spec.capabilities.ttl_resolution
    after = memory.list(prefix)[1]
    ka = _start(memory, [key], TTL)[0]
    assert not _deletes(memory, prefix, after, until=time.monotonic() + 2 * TTL), "expired while refreshed"
    ka.stop()
    stopped = time.monotonic()
    after = memory.list(prefix)[1]
    gone = _deletes(memory, prefix, after, until=stopped + TTL + resolution + 2.0)
    # A keep-alive still running would find the key gone and write it again within one interval.
    written = [e for e in memory.watch(prefix, after, 2 * ka.interval) if e.type is EventType.PUT]
    assert gone == [key], "the key did not expire after stop()"
    assert written == [] and memory.get(key) is None
    assert not ka.lapsed.is_set() and ka.recreated == 0 and not ka.is_alive()
    ka.stop()  # again: a no-op


def test_a_forked_child_keeps_its_own_keys_alive(memory: KVBackend, prefix: str, tmp_path: Any) -> None:
    parent = _start(memory, [prefix + "parent"], TTL)[0]  # the parent's scheduler runs across the fork
    try:
        child = multiprocessing.get_context("fork").Process(target=_child, args=(f"file://{tmp_path}/", prefix))
        child.start()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
    finally:
        parent.stop()
    assert child.exitcode == 0, f"child exit code {child.exitcode} (3: key expired, 4: key gone or lapsed)"


def _child(url: str, prefix: str) -> None:
    kv = open_backend(url)
    key = prefix + "child"
    after = kv.list(prefix)[1]
    ka = _start(kv, [key], TTL)[0]
    deleted = _deletes(kv, prefix, after, until=time.monotonic() + 3 * TTL)
    entry = kv.get(key)
    ka.stop()
    kv.close()
    raise SystemExit(3 if deleted else 4 if entry is None or ka.lapsed.is_set() else 0)


@pytest.mark.parametrize("ttl", [0, -1.0, float("nan")])
def test_a_ttl_that_is_not_positive_is_refused(memory: KVBackend, ttl: float) -> None:
    with pytest.raises(ConfigError) as info:
        KeepAlive(memory, "keepalive/x", ttl)
    assert info.value.field == "ttl"


def test_an_overdue_refresh_counts_as_a_break_until_the_keep_alive_stops() -> None:
    """``Responsiveness``: no call begun for longer than ``max_gap`` (a paused process whose next refresh has not
    run yet) breaks the period now, and so does a late call still in flight; a stopped keep-alive (``idle``)
    vouches as it last did."""
    answers = Responsiveness(slow=10.0, max_gap=0.1)
    answers.record(started := answers.begin(), time.monotonic(), ok=True)
    assert answers.since <= started
    pause_end = time.monotonic() + 0.15
    while (now := time.monotonic()) < pause_end:  # no call for longer than max_gap
        time.sleep(pause_end - now)
    assert answers.since >= pause_end and answers.last_break >= pause_end
    late = answers.begin()  # the overdue call runs: still a break while in flight
    assert answers.since >= late
    answers.record(late, ended := time.monotonic(), ok=True)
    assert answers.since == ended  # the period restarts at the late call's end
    answers.idle()
    while (now := time.monotonic()) < ended + 0.15:
        time.sleep(ended + 0.15 - now)
    assert answers.since == ended  # stopped on purpose: no hold-up
