"""The multi-host harness itself (conformance_tests/multihost.py): addresses, names, partitions, cleanup.

Each test makes real namespaces (root only; skipped elsewhere with the reason) and asserts on what a
process on a host sees: connections made or refused or timed out, names resolved, namespaces left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.agent_workers.harness import REPO, pid_alive

from conformance_tests import multihost
from conformance_tests.multihost import Cluster

pytestmark = pytest.mark.multihost

RESOLVE = """
import socket, sys
try:
    print(socket.gethostbyname(sys.argv[1]))
except OSError:
    print("unresolved")
"""


@pytest.fixture(scope="module")
def pair(rdzv_hosts_module):
    return rdzv_hosts_module(["alpha", "beta"])


def listener(host):
    """A listening TCP socket on ``host``'s address (port chosen by the OS)."""
    return host.call(lambda: socket.create_server((host.address, 0)))


def ours(cluster_prefix: str) -> list[str]:
    return [ns for ns in multihost.namespaces() if ns.startswith(cluster_prefix)]


def test_hosts_reach_each_other_by_address_not_by_name(pair):
    alpha, beta = pair["alpha"], pair["beta"]
    assert alpha.address != beta.address
    with listener(beta) as server:
        with alpha.connect(beta.address, server.getsockname()[1]) as conn:
            assert conn.getsockname()[0] == alpha.address  # the packets left from alpha's own address
    for host, other in ((alpha, beta), (beta, alpha)):
        shown = host.run([sys.executable, "-c", "import socket; print(socket.getfqdn(), socket.gethostname())"])
        assert shown.stdout.split() == [host.name, host.name], shown.stderr
        looked_up = host.run([sys.executable, "-c", RESOLVE, other.name])
        assert looked_up.stdout.strip() == "unresolved", looked_up.stderr
    # a test may ask for names: then the other host resolves to its address
    alpha.set_hosts([beta])
    try:
        assert alpha.run([sys.executable, "-c", RESOLVE, "beta"]).stdout.strip() == beta.address
    finally:
        alpha.set_hosts()


def test_a_host_added_later_with_a_host_name_of_its_own_and_extra_names(rdzv_hosts):
    cluster = rdzv_hosts([])  # no host yet: they come from add_host
    first = cluster.add_host("pod-a-x1", hostname="pod-a")
    second = cluster.add_host("pod-a-x2", hostname="pod-a")  # another host, the same host name
    assert first.address != second.address and [h.name for h in cluster] == ["pod-a-x1", "pod-a-x2"]
    assert second.run(["hostname"]).stdout.strip() == "pod-a"
    second.set_hosts(extra=[(first.address, "svc svc.ns.svc.cluster.local")])
    for name in ("svc", "svc.ns.svc.cluster.local"):
        assert second.run([sys.executable, "-c", RESOLVE, name]).stdout.strip() == first.address
    with pytest.raises(ValueError, match="hostname"):
        cluster.add_host("pod-b", hostname="Not_A_Name")


def test_cut_makes_connect_time_out_not_refused_and_heal_restores_it(pair):
    alpha, beta = pair["alpha"], pair["beta"]
    with listener(beta) as server:
        port = server.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            alpha.connect(beta.address, 1)  # no listener: refused at once while the link is up
        established = alpha.connect(beta.address, port)
        pair.cut(beta)
        try:
            for target in (port, 1):  # a listener or none: the SYN vanishes, no RST, no ICMP
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    alpha.connect(beta.address, target, timeout=0.5)
                assert time.monotonic() - started >= 0.45
            established.sendall(b"x")  # queued, never answered: no reset arrives either
            established.settimeout(0.3)
            with pytest.raises(TimeoutError):
                established.recv(1)
        finally:
            pair.heal(beta)
            established.close()
        with alpha.connect(beta.address, port, timeout=2):
            pass


def root_namespace() -> tuple[str, str]:
    """This machine's own interfaces and addresses (``ip -o link``/``addr``, counters left out)."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    addrs = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return "\n".join(line.split(" link/")[0] for line in links.splitlines()), addrs


def test_processes_per_host_and_close_leaves_nothing_behind():
    before = root_namespace()
    cluster = Cluster(["one", "two"])
    assert root_namespace() == before  # no interface, bridge or address in the root namespace
    prefix = cluster.prefix
    sleeper = cluster["one"].popen(["sleep", "600"])
    other = cluster["two"].popen(["sleep", "600"])
    assert cluster["one"].processes() == [sleeper.pid]
    with pytest.raises(ValueError):
        cluster["one"].kill([other.pid])  # not a process on host one
    cluster["two"].kill([other.pid])
    assert other.wait(5) == -signal.SIGKILL and sleeper.poll() is None
    assert len(ours(prefix)) == 3  # the switch and two hosts
    with pytest.raises(RuntimeError, match="a failed test"):
        with cluster:
            raise RuntimeError("a failed test")
    assert sleeper.wait(5) == -signal.SIGKILL
    assert ours(prefix) == []
    assert not [d for d in os.listdir(multihost.ETC_NETNS) if d.startswith(prefix)]


OWNER = """
import sys
from conformance_tests.multihost import Cluster
cluster = Cluster(["h"])
sleeper = cluster["h"].popen(["sleep", "600"])
print(cluster.prefix, sleeper.pid, flush=True)
sys.stdin.read()  # until the test closes our stdin (or kills us)
cluster.close()
"""


def test_stale_cleanup_removes_a_dead_runs_namespaces_but_not_a_live_ones(tmp_path):
    multihost.require()
    owners = [subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=REPO)
              for _ in range(2)]
    dead, live = owners
    try:
        shown = [p.stdout.readline().split() for p in owners]
        prefixes, sleepers = [prefix for prefix, _ in shown], [int(pid) for _, pid in shown]
        assert all(len(ours(p)) == 2 for p in prefixes)
        dead.kill()  # SIGKILL: no atexit, its namespaces (and its host's sleep) stay behind
        dead.wait(10)
        multihost.cleanup_stale()  # (another harness starting meanwhile may have removed them first: the same)
        assert ours(prefixes[0]) == [] and len(ours(prefixes[1])) == 2
        assert not os.path.exists(os.path.join(multihost.ETC_NETNS, f"{prefixes[0]}-h"))
        assert not pid_alive(sleepers[0]) and pid_alive(sleepers[1])  # the dead run's host process too
    finally:
        live.stdin.close()  # the live run closes its own cluster
        assert live.wait(20) == 0
        dead.kill()
    assert ours(prefixes[1]) == []
