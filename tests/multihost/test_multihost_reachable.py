"""On namespace hosts: nodes that cannot resolve each other's names train together.

One server host (Redis and etcd with the v2 API) and three node hosts whose ``/etc/hosts`` list only
``localhost`` (conformance_tests/multihost.py). A real ``rdzv-run`` per node host starts one gloo
worker (tests/support/agent_workers/worker.py ``--allreduce``): the round must form at world size 3 with
ranks 0, 1, 2, every worker must join the process group at the ``MASTER_ADDR`` it was given (the
all-reduce of RANK+1 is 6 everywhere) and every launcher must exit 0. ``MASTER_ADDR`` must be the
address of the host of rank 0 (its name resolves nowhere). Rank 0 used to publish its host
name and the workers could not reach it.

The comparison with plain torchrun (``--rdzv-backend c10d`` and ``rdzv-redis``) asserts what each
hands its workers as ``MASTER_ADDR``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import uuid

import pytest

from tests.support.agent_workers.harness import WORKER, Launcher, kill_run

from tests.support.waiting import eventually

pytestmark = pytest.mark.multihost

NODES = ("node0", "node1", "node2")
FINISH = 150.0  # seconds for three launchers and workers to import torch, meet, all-reduce and exit (2 cores)
SCHEMES = {"redis": "redis", "etcd-v3": "etcd", "etcd-v2": "etcd"}


@pytest.fixture(scope="module")
def site(rdzv_hosts_module):
    """The hosts and the servers on the server host: ``(cluster, {"redis": ctrl, "etcd": ctrl})``."""
    cluster = rdzv_hosts_module(["server", *NODES])
    servers = {"redis": cluster["server"].start_redis(), "etcd": cluster["server"].start_etcd()}
    return cluster, servers


@pytest.fixture
def job(site, tmp_path):
    """Start launchers on node hosts: ``job.start(backend, nodes)``; everything is killed afterwards."""
    cluster, servers = site

    class Job:
        def __init__(self) -> None:
            self.run_id = f"mh{uuid.uuid4().hex[:10]}"
            self.out = str(tmp_path / "records")
            self.launchers: list[Launcher] = []

        def url(self, backend: str) -> str:
            address = servers[SCHEMES[backend]].address
            scheme = {"etcd-v2": "etcd"}.get(backend, backend)
            return f"{scheme}://{address}/{self.run_id}?keep_alive_ttl=3&timeout=90"

        def start(self, argv: list[str], module: str = "rdzv_agent.launch.launcher",
                  per_host: dict[str, list[str]] | None = None, env: dict[str, str] | None = None,
                  gloo_ifname: bool = False) -> list[Launcher]:
            """One launcher per node host; ``per_host[name]`` is put before ``argv`` on that host. gloo picks
            its interface by resolving the host name, else loopback: ``gloo_ifname`` names it for the workers
            (rdzv-run does that itself; torchrun does not: docs/networking.md)."""
            for name in NODES:
                host_env = {"MH_HOST": name, "OMP_NUM_THREADS": "1", **(env or {})}
                if gloo_ifname:
                    host_env["GLOO_SOCKET_IFNAME"] = cluster[name].interface
                full = [*(per_host or {}).get(name, []), *argv]
                self.launchers.append(Launcher(full, str(tmp_path), name, env=host_env, module=module,
                                               prefix=cluster[name].command_prefix))
            return self.launchers

        def records(self) -> list[dict]:
            found = []
            for entry in sorted(os.listdir(self.out)) if os.path.isdir(self.out) else []:
                if entry.endswith(".json"):
                    with open(os.path.join(self.out, entry)) as f:
                        found.append(json.load(f))
            return found

        def tails(self) -> str:
            return "\n".join(n.tail() for n in self.launchers)

    job = Job()
    yield job
    kill_run(job.launchers, [job.run_id])
    for name in NODES:
        cluster[name].kill()


def worker_argv(job) -> list[str]:
    return [WORKER, "--out", job.out, "--allreduce"]


def host_of(site, name: str) -> str:
    return site[0][name].address


@pytest.mark.parametrize("backend", ["redis", "etcd-v3", "etcd-v2"])
def test_three_hosts_that_cannot_resolve_names_train_at_world_size_3(site, job, backend):
    launchers = job.start(["--rdzv", job.url(backend), "--nnodes", "3", "--nproc-per-node", "1",
                           "--max-restarts", "0", "--monitor-interval", "0.2", *worker_argv(job)])
    for launcher in launchers:
        assert launcher.wait(FINISH) == 0, job.tails()
    records = job.records()
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2], job.tails()
    assert {r["WORLD_SIZE"] for r in records} == {"3"}
    assert {r["allreduce"] for r in records} == {6}  # 1 + 2 + 3: one process group across the hosts
    assert sorted(r["env"]["MH_HOST"] for r in records) == sorted(NODES)  # one worker per host
    rank0 = next(r for r in records if r["RANK"] == "0")
    assert {r["MASTER_ADDR"] for r in records} == {host_of(site, rank0["env"]["MH_HOST"])}
    ipaddress.ip_address(rank0["MASTER_ADDR"])  # an address, not a name
    # the launchers named gloo's interface (none was set): each host's own, the one towards the backend
    assert {r["env"]["MH_HOST"]: r["env"].get("GLOO_SOCKET_IFNAME") for r in records} == \
        {name: site[0][name].interface for name in NODES}


TORCHRUN_TIMEOUT = 120.0


@pytest.mark.parametrize("handler", ["c10d", "rdzv-redis"])
def test_torchrun_on_the_same_hosts_master_addr(site, job, handler):
    """What plain torchrun hands its workers: torch's c10d publishes rank 0's host name (unresolvable on the
    other hosts: its workers cannot meet); the ``rdzv-redis`` handler publishes rank 0's address.

    torch's c10d needs help to get that far on such hosts: without ``is_host`` its handler resolves its own
    host name and dies of the ``gaierror``; with the shared TCP store (its default) rank 0's agent then
    connects to its own store at its unresolvable name and retries until the others' 60 s store timeout
    (docs/networking.md). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` lets it start the workers.
    """
    cluster, servers = site
    per_host, env = {}, {}
    if handler == "c10d":  # torch's c10d store is hosted by the agent on the endpoint's host (node0)
        endpoint = f"{cluster['node0'].address}:29400"
        per_host = {name: ["--rdzv-conf", f"is_host={int(name == 'node0')}"] for name in NODES}
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    else:
        endpoint = servers["redis"].address
    launchers = job.start(["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", handler,
                           "--rdzv-endpoint", endpoint, "--rdzv-id", job.run_id, "--monitor-interval", "0.2",
                           *worker_argv(job)], module="torch.distributed.run", per_host=per_host, env=env,
                          gloo_ifname=True)
    eventually(lambda: len(job.records()) == 3, TORCHRUN_TIMEOUT, "three workers' records", job.tails)
    records = job.records()
    published = {r["MASTER_ADDR"] for r in records}
    assert len(published) == 1, records
    if handler == "c10d":
        name = published.pop()
        assert name in NODES  # a host name ...
        other = cluster[next(n for n in NODES if n != name)]
        resolves = other.run([sys.executable, "-c", "import socket, sys; socket.gethostbyname(sys.argv[1])", name])
        assert resolves.returncode != 0  # ... that the other hosts cannot resolve
        return  # its workers wait for the unreachable store until their timeout: not waited for here
    for launcher in launchers:
        assert launcher.wait(FINISH) == 0, job.tails()
    assert {r["allreduce"] for r in job.records()} == {6}
    rank0 = next(r for r in job.records() if r["RANK"] == "0")
    assert published == {host_of(site, rank0["env"]["MH_HOST"])}


CHOOSE = """
import json, sys
from rdzv_core.torch_api.address import choose_address
cases = json.loads(sys.argv[1])
print(json.dumps([choose_address(configured, [tuple(e) for e in endpoints])[0] for configured, endpoints in cases]))
"""


def test_the_published_address_rule_on_a_host(site):
    """``--local-addr`` wins; a name that resolves (here: in the host's own /etc/hosts) is kept; else the local
    address of the route to the backend; no network endpoint, or a backend on loopback: the name."""
    cluster, servers = site
    node, server = cluster["node2"], servers["redis"]
    cases = [[None, [[server.host, server.port]]], ["10.9.9.9", [[server.host, server.port]]], [None, []],
             [None, [["127.0.0.1", 6379]]], [None, [["no-such-host.invalid", 1], [server.host, server.port]]]]

    def chosen() -> list[str]:
        done = node.run([sys.executable, "-c", CHOOSE, json.dumps(cases)])
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert chosen() == [node.address, "10.9.9.9", "node2", "node2", node.address]
    node.set_hosts([node])  # its own name resolves to its address now: torch's choice, the name, is kept
    try:
        assert chosen() == ["node2", "10.9.9.9", "node2", "node2", "node2"]
    finally:
        node.set_hosts()
