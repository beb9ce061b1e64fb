"""Backend outages end to end: a final round keeps its members through an outage of any length.

Real launchers (``rdzv-run``, or plain ``torchrun`` with the ``rdzv-redis`` handler), one gloo worker each
(``benchmarks/trainer.py``, an ``all_reduce`` every step, each step recorded with its pid, rank, group rank and
world size, no checkpoint: a restarted worker shows as a second ``start`` record and a second pid), over a real
server of the test's own that the test pauses (SIGSTOP), kills and restarts empty, or kills and restarts with
its data. The backend is not in the workers' data path: they train through the outage; afterwards each
member's keep-alive writes its key again, re-establishes the round record where the backend lost it, and
nobody acts on a missing key before the backend answered for a whole ``keep_alive_ttl`` (``docs/design.md``,
"The backend away"). So: one worker start per node, the same ranks and world size before and after, exit 0.
A node that really died during the outage is let go after it: the survivors re-form without it.

Assertions are on outcomes (step records, pids, exit codes, the round record read through the backend) with
generous deadlines, never on log wording. The launchers log at INFO (``NAME.err`` in the test's directory).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from typing import Any, Iterator

import pytest

from benchmarks.trainer_records import read_records
from tests.support.agent_workers.harness import REPO, Launcher, kill_run, pid_alive
from tests.support.waiting import eventually
from conformance_tests.etcd_server import EtcdServer
from conformance_tests.redis_server import RedisServer
from conformance_tests.servers import ServerProcess
from rdzv_core import Rendezvous, RendezvousParams, open_backend

pytestmark = [pytest.mark.slow, pytest.mark.membership, pytest.mark.launchers]

TRAINER = os.path.join(REPO, "benchmarks", "trainer.py")
TTL = 2.0  # keep_alive_ttl of these runs (seconds)
START = 120.0  # seconds for launchers to start, meet and make their first steps (torch imports on 2 cores)
AFTER = 3 * TTL + 2.0  # seconds of training after an outage during which a wrong destroy would have shown


class Job:
    """The nodes of one run over ``server`` (scheme ``scheme``), their step records and the run's state."""

    def __init__(self, scheme: str, server: ServerProcess, workdir: str) -> None:
        self.scheme, self.server, self.workdir = scheme, server, workdir
        self.run_id = f"out{uuid.uuid4().hex[:10]}"
        self.out = os.path.join(workdir, "out")
        os.makedirs(self.out)
        self.nodes: dict[str, Launcher] = {}
        self.query = {"last_call_timeout": "1", "keep_alive_ttl": str(TTL), "timeout": "120"}

    def node(self, name: str, nnodes: str, torchrun: bool = False, collective: bool = True) -> Launcher:
        common = ["--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.2"]
        if torchrun:
            conf = ",".join(f"{k}={v}" for k, v in {**self.query, "join_timeout": self.query["timeout"]}.items()
                            if k != "timeout")
            argv = [*common, "--rdzv-backend", "rdzv-redis", "--rdzv-endpoint", self.server.address,
                    "--rdzv-id", self.run_id, "--rdzv-conf", conf]
            module = "torch.distributed.run"
        else:
            query = "&".join(f"{k}={v}" for k, v in self.query.items())
            argv = [*common, "--rdzv", f"{self.scheme}://{self.server.address}/{self.run_id}?{query}",
                    "--log-dir", os.path.join(self.workdir, "logs")]
            module = "rdzv_agent.launch.launcher"
        argv += [TRAINER, "--out", self.out, "--step-sleep", "0.1", "--pg-timeout", "30"]
        if collective:  # an all_reduce every step (else only the first: a lost peer goes unnoticed by the workers)
            argv.append("--collective")
        launcher = Launcher(argv, self.workdir, name, env={"TRAINER_NODE": name, "LOGLEVEL": "INFO"},
                            module=module)
        self.nodes[name] = launcher
        return launcher

    def records(self, node: str | None = None, kind: str = "step") -> list[dict[str, Any]]:
        return [r for name in ([node] if node else list(self.nodes)) for r in read_records(self.out, name, kind)]

    def steps(self, node: str, world: int | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in self.records(node) if (world is None or r["world"] == world) and r["t"] > after]

    def training(self, nodes: list[str], world: int | None = None, after: float = 0.0, steps: int = 1):
        """A predicate: every node in ``nodes`` recorded ``steps`` steps (at ``world``) after time ``after``."""
        return lambda: all(len(self.steps(n, world, after)) >= steps for n in nodes)

    def round_record(self) -> dict[str, Any]:
        """The run's round record as stored now (``last_call`` left out: a re-established record has none)."""
        with open_backend(f"{self.scheme}://{self.server.address}/") as kv:
            state = Rendezvous(kv, self.run_id, RendezvousParams(min_nodes=1)).describe()
        return {k: state.get(k) for k in ("status", "version", "id", "participants", "ranks")}

    def stop(self, names: list[str], collective: bool = True) -> None:
        """Ask every worker to stop; each of ``names`` must exit 0, its worker having finished (with
        ``collective``: all at the same step)."""
        open(os.path.join(self.out, "stop-all"), "w").close()
        for name in names:
            assert self.nodes[name].wait(60) == 0, self.tails()
        last = {name: self.records(name)[-1]["step"] for name in names}
        assert not collective or len(set(last.values())) == 1, f"the workers did not stop at one step: {last}"

    def tails(self) -> str:
        return "\n".join(n.tail() for n in self.nodes.values())


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A ``redis-server`` of this test's own that forgets everything when killed (no AOF)."""
    server = RedisServer(appendonly=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    """An ``etcd`` of this test's own; a kill and start brings it back with its data."""
    server = EtcdServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _job(scheme: str, server: ServerProcess, tmp_path) -> Iterator[Job]:
    job = Job(scheme, server, str(tmp_path))
    try:
        yield job
    finally:
        kill_run(list(job.nodes.values()), [job.run_id])


@pytest.fixture
def redis_job(redis, tmp_path) -> Iterator[Job]:
    yield from _job("redis", redis, tmp_path)


@pytest.fixture
def etcd_job(etcd, tmp_path) -> Iterator[Job]:
    yield from _job("etcd-v3", etcd, tmp_path)


def assert_rounds_consistent(job: Job) -> dict[str, tuple[int, set[int]]]:
    """Every worker of a round (one process group: one ``MASTER_ADDR:MASTER_PORT``) saw the same world size,
    the ranks of a round are exactly ``0 .. world-1``, each on one node, and every first ``all_reduce`` of
    ``RANK + 1`` summed to ``1 + .. + world``. Returns ``{master: (world, group ranks)}``."""
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in job.records(kind="start") + job.records():
        rounds[record["master"]].append(record)
    found = {}
    for master, records in rounds.items():
        worlds = {r["world"] for r in records}
        assert len(worlds) == 1, f"round {master}: workers saw world sizes {worlds}"
        world = worlds.pop()
        by_rank = defaultdict(set)
        for r in records:
            by_rank[r["rank"]].add((r["node"], r["group_rank"]))
        assert set(by_rank) == set(range(world)), f"round {master}: ranks {sorted(by_rank)} at world size {world}"
        assert all(len(v) == 1 for v in by_rank.values()), f"round {master}: a rank on two nodes: {dict(by_rank)}"
        assert {r["sum"] for r in records if r["kind"] == "start"} <= {world * (world + 1) // 2}, records
        found[master] = (world, {r["group_rank"] for r in records})
    return found


def assert_no_restarts(job: Job, names: list[str], outage: float, world: int) -> None:
    """Each node of ``names`` started one worker, which trained before ``outage`` and after it with the same
    rank, group rank and world size ``world`` (one round: one process group)."""
    for name in names:
        starts = job.records(name, kind="start")
        pids = {r["pid"] for r in job.records(name)}
        assert len(starts) == 1 and len(pids) == 1, \
            f"{name}'s worker started {len(starts)} time(s), pids {pids}\n{job.tails()}"
        before = {(r["rank"], r["group_rank"], r["world"], r["master"]) for r in job.steps(name) if r["t"] < outage}
        after = {(r["rank"], r["group_rank"], r["world"], r["master"]) for r in job.steps(name, after=outage)}
        assert before == after and len(before) == 1 and next(iter(before))[2] == world, (name, before, after)
        assert starts[0]["restart"] == 0
    assert len(assert_rounds_consistent(job)) == 1


def _train_through(job: Job, names: list[str], world: int, outage_start: float, length: float) -> None:
    """Wait (the outage's length) until every node recorded steps ``length`` seconds after ``outage_start``:
    the workers train on while the backend is away."""
    eventually(job.training(names, world, after=outage_start + length), length + 30,
               f"training on for {length} s into the outage", job.tails)


def _train_after(job: Job, names: list[str], world: int, healed: float) -> None:
    """Wait until every node recorded steps :data:`AFTER` seconds after the heal: long enough for a wrong
    destroy (keep-alive judged lost) to have stopped the workers."""
    eventually(job.training(names, world, after=healed + AFTER), START, "training on after the outage", job.tails)


def _pausing_redis(job: Job, redis: RedisServer, names: list[str], torchrun: bool) -> None:
    for name in names:
        job.node(name, "2:3", torchrun=torchrun)
    eventually(job.training(names, 2, steps=5), START, "both nodes training at world size 2", job.tails)
    record = job.round_record()
    redis.pause()
    paused = time.time()
    try:
        _train_through(job, names, 2, paused, 3 * TTL)
    finally:
        redis.resume()
    healed = time.time()
    _train_after(job, names, 2, healed)
    assert job.round_record() == record  # the same final round: version, id, members, rank policy
    job.stop(names)
    assert_no_restarts(job, names, paused, 2)


def test_redis_paused_longer_than_the_ttl_restarts_no_worker(redis_job, redis) -> None:
    """Redis SIGSTOPped for 3 x keep_alive_ttl while two ``rdzv-run`` nodes train (``--nnodes 2:3``): the
    keep-alive keys expire as Redis resumes, are written again, and nobody destroys the round: one worker
    start per node, the same ranks and world size before and after, the same round record, exit 0."""
    _pausing_redis(redis_job, redis, ["A", "B"], torchrun=False)


def test_redis_paused_under_plain_torchrun_restarts_no_worker(redis_job, redis) -> None:
    """As the pause above, under plain ``torchrun`` with the ``rdzv-redis`` handler: torch's agent loop asks
    ``num_nodes_waiting()`` throughout the outage and gets 0; no worker restarts, exit 0."""
    _pausing_redis(redis_job, redis, ["A", "B"], torchrun=True)


def test_redis_restarted_empty_restarts_no_worker(redis_job, redis) -> None:
    """Redis killed, down for ~2 s and started again empty (no AOF) on the same port while two nodes train:
    the members write their keys again and re-establish the lost round record (same version, id, members):
    one worker start per node, the same ranks and world size, exit 0."""
    job, names = redis_job, ["A", "B"]
    for name in names:
        job.node(name, "2:3")
    eventually(job.training(names, 2, steps=5), START, "both nodes training at world size 2", job.tails)
    record = job.round_record()
    redis.kill()
    killed = time.time()
    try:
        _train_through(job, names, 2, killed, 2.0)
    finally:
        redis.start()
    healed = time.time()
    _train_after(job, names, 2, healed)
    assert job.round_record() == record  # re-established as it was
    job.stop(names)
    assert_no_restarts(job, names, killed, 2)


def test_etcd_v3_killed_and_restarted_with_its_data_restarts_no_worker(etcd_job, etcd) -> None:
    """etcd (v3 API) SIGKILLed and started again with its data after ~2 x keep_alive_ttl while two nodes
    train: one worker start per node, the same ranks and world size, the same round record, exit 0."""
    job, names = etcd_job, ["A", "B"]
    for name in names:
        job.node(name, "2:3")
    eventually(job.training(names, 2, steps=5), START, "both nodes training at world size 2", job.tails)
    record = job.round_record()
    etcd.kill()
    killed = time.time()
    try:
        _train_through(job, names, 2, killed, 2 * TTL)
    finally:
        etcd.start()
    healed = time.time()
    _train_after(job, names, 2, healed)
    assert job.round_record() == record
    job.stop(names)
    assert_no_restarts(job, names, killed, 2)


@pytest.mark.parametrize("collective", [True, False], ids=["collective-steps", "local-steps"])
def test_a_node_killed_during_a_redis_pause_is_let_go_after_it(redis_job, redis, collective, record_property) -> None:
    """Three nodes (``--nnodes 2:3``) train; Redis is paused for ~3 x keep_alive_ttl and one node (not the one
    of group rank 0) is SIGKILLed with its worker during the pause. After SIGCONT the two survivors re-form and
    train at world size 2 with group ranks 0 and 1, within keep_alive_ttl + 10 s of the resume; in no round did
    a worker see a world size or rank set that does not match its peers'; both survivors exit 0.

    ``collective-steps``: the survivors' workers fail with their peer (an all_reduce every step), their agents
    spend a failure restart (``restart`` 1) and re-rendezvous. ``local-steps``: only the first step is a
    collective, the survivors' workers never notice; the dead member's key stays missing once the backend has
    answered for a whole TTL, the round is destroyed and the survivors re-form as a membership change
    (``restart`` 0)."""
    job, names = redis_job, ["A", "B", "C"]
    for name in names:
        job.node(name, "2:3", collective=collective)
    eventually(job.training(names, 3, steps=5), START, "three nodes training at world size 3", job.tails)
    victim = next(n for n in reversed(names) if job.records(n)[-1]["group_rank"] != 0)
    survivors = [n for n in names if n != victim]
    redis.pause()
    paused = time.monotonic()
    try:
        doomed = job.nodes[victim].descendants()
        job.nodes[victim].kill_all()  # the node's host is lost while the backend is away
        eventually(lambda: not any(pid_alive(p) for p in doomed), 10, "the victim's processes to die")
        # the outage itself: the rest of ~3 x TTL (the fault's length, not a wait for an outcome)
        time.sleep(max(0.0, paused + 3 * TTL - time.monotonic()))
    finally:
        redis.resume()
    resumed = time.time()
    eventually(job.training(survivors, 2, after=resumed), TTL + 60, "the survivors training at world size 2",
               job.tails)
    first = min((r for n in survivors for r in job.steps(n, 2, after=resumed)), key=lambda r: r["t"])
    recovery, spawned = first["t"] - resumed, first["spawned"] - resumed
    record_property("recovery_seconds", round(recovery, 2))
    record_property("worker_spawned_seconds", round(spawned, 2))
    print(f"\nfirst step at world size 2: {recovery:.2f} s after the resume (its worker began {spawned:.2f} s "
          f"after it: the rest is torch's import and the gloo group)")
    assert recovery < TTL + 10.0, (f"{recovery:.1f} s from the resume to the survivors' first step at world size 2 "
                                   f"(the worker began {spawned:.1f} s after the resume)\n{job.tails()}")
    job.stop(survivors, collective)
    rounds = assert_rounds_consistent(job)
    assert sorted(rounds.values(), key=lambda r: -r[0]) == [(3, {0, 1, 2}), (2, {0, 1})], rounds
    last = {n: job.records(n)[-1] for n in survivors}
    assert {r["world"] for r in last.values()} == {2} and {r["group_rank"] for r in last.values()} == {0, 1}, last
    restarts = {r["restart"] for n in survivors for r in job.steps(n, 2)}
    assert restarts == {1 if collective else 0}, f"restart counts at world size 2: {restarts}\n{job.tails()}"
