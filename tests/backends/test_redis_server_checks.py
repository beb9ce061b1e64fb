"""Redis servers the backend refuses at open: one that evicts keys (unless ``allow_eviction=true``) and a
Redis Cluster -- through ``open_backend``, ``rdzv-run`` (exit 2) and ``rdzv check`` (a failed check), against
real ``redis-server``s."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from typing import Iterator

import pytest
import redis
from tests.support.servers import serve

from conformance_tests.redis_server import RedisCluster, RedisServer, RedisTLSServer
from rdzv_core import ConfigError, UnsuitableServerError, open_backend

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

#: How long refusing a server may take at most (seconds): one PING and one INFO on loopback.
FAST = 1.0
LAUNCH_DEADLINE = 120.0  #: seconds a launcher (it imports torch) may take to exit on a loaded machine
#: URL settings a refusing launcher must not wait out: both far beyond LAUNCH_DEADLINE.
PATIENT = {"operation_timeout": "600", "timeout": "600"}
EVICTING = ("volatile-lru", "allkeys-lru")


@pytest.fixture(scope="module", params=EVICTING)
def evicting(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A server with ``maxmemory 4mb`` and an evicting policy (the param)."""
    yield from serve(RedisServer(appendonly=False, extra_args=("--maxmemory", "4mb",
                                                                "--maxmemory-policy", request.param)))


@pytest.fixture(scope="module")
def noeviction() -> Iterator[RedisServer]:
    yield from serve(RedisServer(appendonly=False, extra_args=("--maxmemory", "4mb",
                                                                "--maxmemory-policy", "noeviction")))


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """Three masters, no replicas, on loopback."""
    nodes = RedisCluster(3)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


def _policy(server: RedisServer) -> str:
    with redis.Redis(host=server.host, port=server.port, socket_timeout=10) as client:
        return str(client.config_get("maxmemory-policy")["maxmemory-policy"])


def _refused(url: str) -> tuple[UnsuitableServerError, float]:
    started = time.monotonic()
    with pytest.raises(UnsuitableServerError) as info:
        open_backend(url)
    return info.value, time.monotonic() - started


def _rdzv_run(url: str) -> subprocess.CompletedProcess[str]:
    """rdzv-run with ``url``; it must exit within LAUNCH_DEADLINE s (``subprocess.TimeoutExpired`` fails the test)."""
    return subprocess.run([sys.executable, "-m", "rdzv_agent", "--nproc-per-node", "1", "--rdzv", url, "/bin/true"],
                          capture_output=True, text=True, timeout=LAUNCH_DEADLINE)


def _rdzv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rdzv_admin.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_evicting_server_is_refused_at_open_naming_the_policy(evicting: RedisServer) -> None:
    policy = _policy(evicting)
    exc, seconds = _refused(evicting.url("job"))
    assert seconds < FAST
    assert isinstance(exc, ConfigError) and (exc.field, exc.value) == ("maxmemory-policy", policy)
    assert policy in str(exc) and "noeviction" in str(exc) and "allow_eviction=true" in str(exc)
    assert evicting.address in str(exc)


def test_evicting_server_is_accepted_with_allow_eviction(evicting: RedisServer) -> None:
    with open_backend(evicting.url("job", allow_eviction="true")) as kv:
        assert len(kv.server_warnings) == 1 and _policy(evicting) in kv.server_warnings[0]
        kv.put("t/" + uuid.uuid4().hex, b"v")


def test_allow_eviction_takes_only_a_boolean(evicting: RedisServer) -> None:
    with pytest.raises(ConfigError) as info:
        open_backend(evicting.url("job", allow_eviction="maybe"))
    assert (info.value.field, info.value.value) == ("allow_eviction", "maybe")


def test_noeviction_with_maxmemory_opens(noeviction: RedisServer) -> None:
    with open_backend(noeviction.url("job")) as kv:
        assert kv.server_warnings == ()
        key = "t/" + uuid.uuid4().hex
        kv.put(key, b"v")
        assert kv.get(key) is not None


def test_evicting_tls_server_is_refused() -> None:
    server = RedisTLSServer(appendonly=False, extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"))
    for _ in serve(server):
        exc, seconds = _refused(server.url("job"))
        assert seconds < FAST and exc.value == "allkeys-lru"
        with open_backend(server.url("job", allow_eviction="1")) as kv:
            assert len(kv.server_warnings) == 1


def test_rdzv_run_exits_2_promptly_on_an_evicting_server(evicting: RedisServer) -> None:
    """rdzv-run refuses it as bad usage, without waiting out the backend's operation_timeout or a rendezvous:
    both are set far beyond the launcher's deadline (LAUNCH_DEADLINE), so an exit at all shows neither was
    waited for (the refusal itself takes less than FAST, tested above)."""
    out = _rdzv_run(evicting.url("job", **PATIENT))
    assert out.returncode == 2, out.stderr
    assert _policy(evicting) in out.stderr


def test_rdzv_check_fails_on_an_evicting_server_and_warns_when_allowed(evicting: RedisServer) -> None:
    policy = _policy(evicting)
    refused = _rdzv("check", evicting.url(), "--json")
    assert refused.returncode == 1, refused.stderr
    report = json.loads(refused.stdout)
    assert report["checks"] == {"server": False} and policy in report["problems"][0]
    text = _rdzv("check", evicting.url())
    assert text.returncode == 1 and any(line.strip().startswith("FAIL") and policy in line
                                        for line in text.stdout.splitlines())
    allowed = _rdzv("check", evicting.url(allow_eviction="true"), "--json")
    assert allowed.returncode == 0, allowed.stderr
    report = json.loads(allowed.stdout)
    assert all(report["checks"].values()) and report["problems"] == []
    assert len(report["warnings"]) == 1 and policy in report["warnings"][0]
    shown = _rdzv("check", evicting.url(allow_eviction="true"))
    assert shown.returncode == 0 and any(line.strip().startswith("WARN") and policy in line
                                         for line in shown.stdout.splitlines())


def test_redis_cluster_is_refused_at_open(cluster: RedisCluster) -> None:
    for node in cluster.nodes:
        exc, seconds = _refused(node.url("job"))
        assert seconds < FAST
        assert (exc.field, exc.value) == ("cluster_enabled", "1")
        assert len(str(exc).splitlines()) == 1
        for alternative in ("cluster mode", "redis+sentinel://", "etcd-v3://"):
            assert alternative in str(exc)


def test_rdzv_run_and_rdzv_check_refuse_a_redis_cluster(cluster: RedisCluster) -> None:
    """rdzv-run exits 2 naming cluster mode, within LAUNCH_DEADLINE although its operation_timeout and rendezvous
    timeout are longer (neither was waited out); ``rdzv check`` fails on the server check."""
    out = _rdzv_run(cluster.url("job", **PATIENT))
    assert out.returncode == 2 and "cluster mode" in out.stderr, out.stderr
    check = _rdzv("check", cluster.url(), "--json")
    assert check.returncode == 1 and json.loads(check.stdout)["checks"] == {"server": False}


def test_acl_user_without_info_opens_with_a_warning(evicting: RedisServer) -> None:
    """A user the ACL denies INFO is not refused (the server cannot be judged): the backend says it went unchecked."""
    user = "noinfo" + uuid.uuid4().hex[:6]
    with redis.Redis(host=evicting.host, port=evicting.port, socket_timeout=10) as client:
        client.execute_command("ACL", "SETUSER", user, "on", ">pw", "~rdzv:*", "&rdzv:*", "+@all", "-info")
    with open_backend(f"redis://{user}:pw@{evicting.address}/job") as kv:
        assert len(kv.server_warnings) == 1 and "+info" in kv.server_warnings[0]
        kv.put("t/" + uuid.uuid4().hex, b"v")


def test_a_replica_is_refused_at_open_naming_its_master(noeviction: RedisServer) -> None:
    """``redis://`` pointed at a read-only replica: refused at once (``field`` ``role``), naming the master and
    Sentinel, instead of the first write failing as a corrupt bookkeeping key; ``rdzv check`` fails on it."""
    replica = RedisServer(appendonly=False, extra_args=("--replicaof", noeviction.host, str(noeviction.port)))
    for _ in serve(replica):
        exc, seconds = _refused(replica.url("job"))
        assert (exc.field, exc.value) == ("role", "replica") and seconds < FAST
        assert f"{noeviction.host}:{noeviction.port}" in str(exc) and "redis+sentinel://" in str(exc)
        assert _rdzv("check", replica.url()).returncode == 1
