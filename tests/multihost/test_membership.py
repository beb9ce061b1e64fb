"""Membership dynamics end to end: spares, silently lost nodes, the exit barrier, mixed worker counts.

Every node is a real launcher process (``rdzv-run``, or plain ``torchrun`` with the
``rdzv-*`` handlers) with gloo workers (``benchmarks/trainer.py``) that record
every step with its world size, over real servers: file, Redis, etcd v2 and etcd v3.
Assertions are on outcomes: world sizes and ranks of the steps, which worker
processes made them (a new pid is a restart), restart counts, exit codes, whether
the run is closed, and deadlines on those outcomes.
"""

from __future__ import annotations

import os
import time

import pytest

from rdzv_agent.coordination import BARRIER_PREFIX

from tests.support.waiting import eventually
from tests.support.membership_jobs import START, TTL, Job, training as _training

pytestmark = [pytest.mark.slow, pytest.mark.membership, pytest.mark.launchers]

# -- 1. spares ---------------------------------------------------------------------------------------


def _torchrun_on_redis(job: Job, launcher: str) -> bool:
    """torchrun variants of scenarios whose torchrun side is backend-neutral (the handler's answers) run on Redis
    only (the rdzv-run variants cover every backend); the freeze runs under torchrun on every backend."""
    if launcher == "torchrun" and job.backend.scheme != "redis":
        pytest.skip("torchrun variant: on Redis only")
    return launcher == "torchrun"


@pytest.mark.parametrize("launcher", ["rdzv-run", "torchrun"])
def test_a_node_beyond_max_nodes_waits_as_a_spare_and_replaces_a_dead_member(job, launcher) -> None:
    """``--nnodes 2:2``, A and B train, C starts: A and B go on with the same workers while C waits;
    then A is killed and C takes its place (B and C train at world size 2)."""
    torchrun = _torchrun_on_redis(job, launcher)
    for name in ("A", "B"):
        job.node(name, "2:2", torchrun=torchrun)
    eventually(_training(job, ["A", "B"], 2), START, "A and B training at world size 2", job.tails)
    job.node("C", "2:2", torchrun=torchrun)
    eventually(lambda: job.state().get("waiting", 0) >= 1, START, "C counted as waiting", job.tails)
    counted = time.time()
    # while C waits: 4 keep-alive TTLs of steps (>= 50 ms each), all by the workers that were already there
    eventually(_training(job, ["A", "B"], 2, after=counted, steps=int(4 * TTL / 0.05)), 60,
               "A and B training on while C waits", job.tails)
    for name in ("A", "B"):
        pids = {r["pid"] for r in job.records(name)}
        assert len(pids) == 1, f"{name}'s workers were restarted while the spare waited: {pids}\n{job.tails()}"
    assert job.records("C") == [], "the spare trained although the round was full"

    job.nodes["A"].kill_all()  # A's host is lost
    killed = time.time()
    eventually(_training(job, ["B", "C"], 2, after=killed), 60, "B and the spare C training at world size 2",
               job.tails)
    job.touch("stop-all")
    for name in ("B", "C"):
        assert job.nodes[name].wait(60) == 0, job.tails()


# -- 2. silent loss --------------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["rdzv-run", "torchrun"])
def test_a_frozen_node_is_noticed_within_the_keep_alive_ttl(job, launcher) -> None:
    """SIGSTOP of one node's whole process tree (no FIN, no RST): the two others train at world size 2
    long before the 60 s collective timeout, without spending a failure restart."""
    torchrun = launcher == "torchrun"
    for name in ("A", "B", "C"):
        job.node(name, "2:3", torchrun=torchrun, pg_timeout=60.0)
    eventually(_training(job, ["A", "B", "C"], 3), START, "A, B and C training at world size 3", job.tails)
    job.nodes["C"].freeze()
    frozen = time.time()
    # TTL + detection + stopping the hung workers + a new round (0.5 s last call) + new workers (torch import)
    eventually(_training(job, ["A", "B"], 2, after=frozen), TTL + 25.0, "A and B training at world size 2",
               job.tails)
    first = min(r["t"] for n in ("A", "B") for r in job.steps_at(n, 2, frozen))
    assert first - frozen < 60.0 - 10.0  # well before the collective timeout would have ended the hang
    assert {r["restart"] for n in ("A", "B") for r in job.steps_at(n, 2, frozen)} == {0}  # a membership change
    job.touch("stop-all")
    for name in ("A", "B"):
        assert job.nodes[name].wait(60) == 0, job.tails()


# -- 3. the exit barrier ----------------------------------------------------------------------------------


@pytest.mark.agent_scenario  # the exit barrier uses torch's store keys: backend-neutral
def test_a_finished_node_waits_at_the_exit_barrier_and_the_others_re_form_without_it(job) -> None:
    """C's workers finish first: C holds at the exit barrier and the run stays open; A's worker then fails:
    A and B re-form at world size 2 (C leaves, the run still open); when they finish, the run is closed."""
    for name in ("A", "B", "C"):
        job.node(name, "2:3", collective=False, max_restarts=1)
    eventually(_training(job, ["A", "B", "C"], 3), START, "A, B and C at world size 3", job.tails)
    job.touch("stop-C")
    c_workers = job.nodes["C"].workers()
    eventually(lambda: not any(os.path.exists(f"/proc/{p}") and _running(p) for p in c_workers), 30,
               "C's workers to finish", job.tails)
    steps_b = len(job.records("B"))
    eventually(lambda: len(job.records("B")) >= steps_b + int(2 * TTL / 0.05), 60, "B training on", job.tails)
    assert job.nodes["C"].proc.poll() is None, f"C did not wait at the exit barrier\n{job.tails()}"
    assert not job.is_closed(), "C closed the run while A and B still train"

    job.touch("fail-A")
    failed = time.time()
    eventually(_training(job, ["A", "B"], 2, after=failed), 60, "A and B re-formed at world size 2", job.tails)
    assert job.nodes["C"].wait(30) == 0, job.tails()
    assert not job.is_closed(), "C closed the run on leaving the barrier"
    assert {r["restart"] for r in job.steps_at("A", 2, failed)} == {1}  # A spent its restart
    assert {r["restart"] for r in job.steps_at("B", 2, failed)} == {0}  # B only re-formed
    job.touch("stop-all")
    for name in ("A", "B"):
        assert job.nodes[name].wait(60) == 0, job.tails()
    assert job.is_closed()  # the last nodes to finish closed it, together


@pytest.mark.agent_scenario  # the exit barrier uses torch's store keys: backend-neutral
@pytest.mark.parametrize("launcher", ["rdzv-run", "torchrun"])
def test_a_node_that_dies_at_the_exit_barrier_does_not_disturb_the_others(job, launcher) -> None:
    """C's workers finish and C waits at the exit barrier, then C's host is lost: A and B train on with the
    same workers (a finished member is not a lost one) and end the job normally."""
    torchrun = _torchrun_on_redis(job, launcher)
    for name in ("A", "B", "C"):
        job.node(name, "2:3", collective=False, torchrun=torchrun)
    eventually(_training(job, ["A", "B", "C"], 3), START, "A, B and C at world size 3", job.tails)
    job.touch("stop-C")
    c_workers = job.nodes["C"].workers()
    eventually(lambda: not any(_running(p) for p in c_workers), 30, "C's workers to finish", job.tails)
    c_rank = job.records("C")[-1]["group_rank"]
    eventually(lambda: any(m.get("finished") for m in job.state().get("alive", []) if m.get("rank") == c_rank),
               30, "C marked finished at its barrier", job.tails)
    # ... and counted in (its barrier key follows the mark: a node lost between the two writes holds the others
    # at the barrier until its timeout): rdzv-run's key per group rank, torch's counter
    arrived = f"{BARRIER_PREFIX}/arrived/{c_rank}" if launcher == "rdzv-run" else f"{BARRIER_PREFIX}/num_members"
    eventually(lambda: job.round_store_has(arrived), 30, "C counted into the exit barrier", job.tails)
    job.nodes["C"].kill_all()
    killed = time.time()
    eventually(_training(job, ["A", "B"], 3, after=killed + 3 * TTL, steps=1), 60, "A and B training on",
               job.tails)
    for name in ("A", "B"):
        pids = {r["pid"] for r in job.records(name)}
        assert len(pids) == 1, f"{name}'s workers were restarted after C died at its barrier: {pids}"
    job.touch("stop-all")
    for name in ("A", "B"):
        assert job.nodes[name].wait(60) == 0, job.tails()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


# -- 4. mixed worker counts ---------------------------------------------------------------------------------


@pytest.mark.agent_scenario  # ranks come from the handler: backend-neutral
def test_nodes_with_different_worker_counts_get_distinct_ranks(job) -> None:
    """A runs 1 worker, B runs 2: world size 3, global ranks 0-2 by group rank then local rank."""
    job.node("A", "2:2", nproc=1, collective=False, pg_timeout=20.0, trainer_args=("--max-steps", "1"))
    job.node("B", "2:2", nproc=2, collective=False, pg_timeout=20.0, trainer_args=("--max-steps", "1"))
    for name in ("A", "B"):
        assert job.nodes[name].wait(START) == 0, job.tails()
    starts = job.records(kind="start")
    assert sorted(r["rank"] for r in starts) == [0, 1, 2], starts
    assert {r["world"] for r in starts} == {3} and {r["sum"] for r in starts} == {6}, starts
    local_sizes = {r["group_rank"]: 1 if r["node"] == "A" else 2 for r in starts}
    for r in starts:
        base = sum(size for group_rank, size in local_sizes.items() if group_rank < r["group_rank"])
        assert r["rank"] == base + r["local_rank"], starts
        assert (r["role_rank"], r["role_world"]) == (r["rank"], 3), starts



# -- 5. re-forming at the default last call ------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["rdzv-run", "torchrun"])
def test_survivors_re_form_without_waiting_out_the_default_last_call(job, launcher) -> None:
    """torch's default last call (30 s), ``--nnodes 2:3``: A, B and C train (the first round freezes at
    max_nodes). C is killed: A and B train again at world size 2 well before a 30 s last call could have
    ended (nobody else is expected: the round froze as soon as both had joined). C comes back: it joins as
    a grow and all three train at world size 3."""
    if job.backend.scheme not in ("redis", "file"):
        pytest.skip("the re-forming rule lives in the one state machine: Redis and file cover it end to end")
    torchrun = _torchrun_on_redis(job, launcher)
    del job.query["last_call_timeout"]  # torch's default: 30 s
    for name in ("A", "B", "C"):
        job.node(name, "2:3", torchrun=torchrun)
    eventually(_training(job, ["A", "B", "C"], 3), START, "A, B and C training at world size 3", job.tails)
    job.nodes["C"].kill_all()
    killed = time.time()
    # detection (at once: the workers' collective fails) + a round without last call + new workers (torch import)
    eventually(_training(job, ["A", "B"], 2, after=killed), 25.0, "A and B training at world size 2 before "
               "a 30 s last call could end", job.tails)
    job.node("C2", "2:3", torchrun=torchrun)
    back = time.time()
    eventually(_training(job, ["A", "B", "C2"], 3, after=back), START, "A, B and the returning C training at "
               "world size 3", job.tails)
    job.touch("stop-all")
    for name in ("A", "B", "C2"):
        assert job.nodes[name].wait(60) == 0, job.tails()
