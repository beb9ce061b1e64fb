"""Node health end to end: a node that fails at every start is quarantined and a spare takes its place.

Real launchers (``rdzv-run``) with gloo trainers (``benchmarks/trainer.py``) on real servers; each launcher is a
node of its own in the run's ledger (``RDZV_NODE_NAME``). Assertions are on outcomes: which nodes trained at
which world size, how often the faulty node's workers started, exit codes, the ledger's entries.
"""

from __future__ import annotations

import pytest

from rdzv_core.rendezvous.ledger import NodeLedger, QuarantinePolicy
from tests.support.membership_jobs import START, Job, training
from tests.support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.membership, pytest.mark.launchers]


def _ledger(job: Job) -> NodeLedger:
    observer = job._observer()
    return NodeLedger(observer.kv, observer.keys, QuarantinePolicy())


def test_a_node_failing_at_every_start_is_quarantined_and_a_spare_takes_its_place(job: Job) -> None:
    """``--nnodes 2:3 --max-restarts 3``: A, B and the lemon L form the first round, a fourth node S waits as a
    spare. L's workers fail right after ``init_process_group`` at every start (the others' fail with them). After
    its second failure (``quarantine_after`` 2, the default) L is quarantined: A, B and S train at world size 3,
    and L's workers never start again. The job ends: A, B and S exit 0, L exits non-zero."""
    if job.backend.scheme == "etcd-v2":
        pytest.skip("the ledger lives in the one state machine: file, Redis and etcd-v3 cover it end to end")
    job.touch("lemon-L")
    job.query["last_call_timeout"] = "10"  # the first round has all three, however slowly they start
    for name in ("A", "B", "L"):
        job.node(name, "2:3")
    eventually(lambda: job.records("L", kind="lemon"), START, "the lemon's first start", job.tails)
    job.node("S", "2:3")
    eventually(training(job, ["A", "B", "S"], 3), START, "A, B and the spare S training at world size 3",
               job.tails)
    entry = _ledger(job).read("L")
    assert entry.quarantined() and [o.kind for o in entry.offences] == ["failed", "failed"], entry
    for name in ("A", "B", "S"):
        assert _ledger(job).read(name).offences == (), f"{name} was charged: {_ledger(job).read(name)}"
    job.touch("stop-all")
    for name in ("A", "B", "S"):
        assert job.nodes[name].wait(90) == 0, job.tails()
    assert job.nodes["L"].wait(60) not in (0, None), job.tails()
    assert len(job.records("L", kind="lemon")) == 2, "the quarantined node's workers started again"


def test_without_a_spare_the_job_trains_on_without_the_quarantined_node(job: Job) -> None:
    """``--nnodes 2:3``: A, B and the lemon L; once L is quarantined, A and B train at world size 2 (min_nodes is
    met without it) and finish with exit 0."""
    if job.backend.scheme not in ("file", "redis"):
        pytest.skip("the same state machine: file and Redis cover it end to end")
    job.touch("lemon-L")
    job.query["last_call_timeout"] = "10"
    for name in ("A", "B", "L"):
        job.node(name, "2:3")
    eventually(training(job, ["A", "B"], 2), START, "A and B training at world size 2 without L", job.tails)
    assert _ledger(job).read("L").quarantined()
    job.touch("stop-all")
    for name in ("A", "B"):
        assert job.nodes[name].wait(90) == 0, job.tails()
    assert job.nodes["L"].wait(60) not in (0, None), job.tails()
    assert len(job.records("L", kind="lemon")) == 2
