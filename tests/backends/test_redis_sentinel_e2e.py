"""End to end over ``redis+sentinel://``: two ``rdzv-run`` nodes train ``examples/train_digits.py``;
the Redis master is killed mid-training, the sentinels promote the replica, and the job finishes.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Iterator

import pytest

from tests.support.agent_workers.harness import TRAIN_DIGITS, Launcher, accuracies, ints_after, kill_run

from tests.support.waiting import eventually
from conformance_tests.redis_sentinel import MASTER_NAME, SentinelGroup

pytestmark = [pytest.mark.slow, pytest.mark.launchers]

START = 240.0  # seconds for the nodes to start, form a round and begin training (torch imports on 2 cores)
FINISH = 300.0  # seconds for the job to finish after the failover


@pytest.fixture
def group(rdzv_server_sentinel: SentinelGroup) -> Iterator[SentinelGroup]:
    yield rdzv_server_sentinel
    rdzv_server_sentinel.start()


def test_the_master_killed_mid_training_the_job_finishes_on_the_promoted_replica(group, tmp_path) -> None:
    """Expected: both launchers exit 0, the accuracy is reached, and the workers were started once:
    the failover (a few seconds, within the keep-alive TTL of 10 s) costs no new round."""
    if not os.path.exists(TRAIN_DIGITS):
        pytest.skip("examples/train_digits.py is missing")
    run_id = f"sentinel{uuid.uuid4().hex[:10]}"
    url = (f"redis+sentinel://{group.address}/{run_id}?master_name={MASTER_NAME}"
           "&last_call_timeout=1&keep_alive_ttl=10&timeout=120")
    checkpoint = str(tmp_path / "checkpoint.pt")
    nodes = [
        Launcher(["--rdzv", url, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3",
                  "--monitor-interval", "0.2", "--log-dir", str(tmp_path / "logs"),
                  TRAIN_DIGITS, "--checkpoint", checkpoint, "--epochs", "14", "--epoch-sleep", "0.4",
                  "--pg-timeout", "30"], str(tmp_path), f"node{i}")
        for i in range(2)
    ]

    def tails() -> str:
        return "\n".join(n.tail() for n in nodes)

    def epochs_done() -> int:
        return max((int(line.split()[1].split("/")[0]) for n in nodes for line in n.stdout().splitlines()
                    if line.startswith("epoch ")), default=0)

    try:
        eventually(lambda: epochs_done() >= 2, START, "training at world size 2", tails)
        old = group.master().address
        group.kill()
        group.wait_for_master(other_than=old, deadline=time.monotonic() + 30)
        for n in nodes:
            assert n.wait(FINISH) == 0, tails()
        found = [a for n in nodes for a in accuracies(n.stdout())]
        assert len(found) == 1 and found[0] >= 0.90, tails()
        starts = [w for n in nodes for w in ints_after("WORLD_SIZE_SEEN", n.stdout())]
        # One start of global rank 0: the failover cost no worker restart (same round).
        assert starts == [2], f"rank 0 was started {len(starts)} times: {starts}\n{tails()}"
    finally:
        kill_run(nodes, [run_id])
