"""End to end: several ``rdzv-run`` nodes train ``examples/train_digits.py`` elastically.

Each node is one launcher with one worker (2 cores). The backend is a
parameter (the conformance plugin's ``--rdzv-url``): ``file://`` and Redis
(``agent_scenario``, see ``tests/conftest.py``). The tests assert outcomes: exit
codes, the world sizes rank 0 reported (``WORLD_SIZE_SEEN``), that training
resumed from the checkpoint (``RESUMED_FROM_EPOCH``) and the final accuracy.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid

import pytest

from tests.support.agent_workers.harness import (
    TRAIN_DIGITS, Launcher, accuracies, ints_after, kill_run, pid_alive)
from tests.support.waiting import eventually
from rdzv_core import create_handler

# over file:// and redis:// (agent_scenario), at most two launcher tests at once (launchers): tests/conftest.py;
# membership scenarios (nodes killed, joining late, stopped, refused): scripts/test.sh runs them after the main pytest
pytestmark = [pytest.mark.slow, pytest.mark.agent_scenario, pytest.mark.launchers, pytest.mark.membership]

START = 240.0  # seconds for nodes to start, form a round and begin training (torch imports on 2 cores)
FINISH = 300.0  # seconds for the job to finish after the fault


@pytest.fixture
def cluster(rdzv_base_url, rdzv_url, tmp_path):
    """Start nodes of one run: ``cluster.node(name, nnodes, gate=None)``; all killed at teardown."""
    if rdzv_base_url.startswith("memory://"):
        pytest.skip("memory:// is in-process; launchers are separate processes")
    if not os.path.exists(TRAIN_DIGITS):
        pytest.skip("examples/train_digits.py is missing")

    class Cluster:
        def __init__(self) -> None:
            self.run_id = f"e2e{uuid.uuid4().hex[:10]}"
            self.nodes: list[Launcher] = []
            self.checkpoint = str(tmp_path / "checkpoint.pt")
            self.query = {"last_call_timeout": "1", "keep_alive_ttl": "2", "timeout": "120"}

        @property
        def url(self) -> str:
            return rdzv_url(run_id=self.run_id, **self.query)

        def node(self, name: str, nnodes: str, epochs: int, gate: str | None = None) -> Launcher:
            argv = [
                "--rdzv", self.url, "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3",
                "--monitor-interval", "0.2", "--log-dir", str(tmp_path / "logs"),
                TRAIN_DIGITS, "--checkpoint", self.checkpoint, "--epochs", str(epochs),
                "--epoch-sleep", "0.4", "--pg-timeout", "30",
            ]
            launcher = Launcher(argv, str(tmp_path), name, gate=gate)
            self.nodes.append(launcher)
            return launcher

        def rank0_node(self, world_size: int) -> Launcher | None:
            """The node whose stdout shows a round of ``world_size`` (it hosts global rank 0)."""
            for n in self.nodes:
                if world_size in ints_after("WORLD_SIZE_SEEN", n.stdout()):
                    return n
            return None

        def trained(self, world_size: int, epochs_done: int) -> bool:
            """Rank 0 reported ``epochs_done`` epochs at ``world_size``."""
            pattern = re.compile(rf"^epoch (\d+)/\d+ world_size={world_size} ", re.MULTILINE)
            return any(int(m) >= epochs_done for n in self.nodes for m in pattern.findall(n.stdout()))

        def tails(self) -> str:
            return "\n".join(n.tail() for n in self.nodes)

        def final(self, survivors: list[Launcher]) -> tuple[Launcher, float]:
            """The survivor that printed the accuracy, and the accuracy (exactly one such line)."""
            found = [(n, a) for n in survivors for a in accuracies(n.stdout())]
            assert len(found) == 1, self.tails()
            return found[0]

    c = Cluster()
    yield c
    kill_run(c.nodes, [c.run_id])


def test_sigkill_one_of_three_nodes_the_others_resume_at_world_size_2(cluster):
    nodes = [cluster.node(f"node{i}", "2:3", epochs=14) for i in range(3)]
    eventually(lambda: cluster.trained(3, 2), START, "training at world size 3", cluster.tails)

    rank0 = cluster.rank0_node(3)
    victim = next(n for n in nodes if n is not rank0)
    doomed = victim.descendants()
    victim.kill_all()  # SIGKILL the launcher and its workers: a node lost without warning
    eventually(lambda: not any(pid_alive(p) for p in doomed), 10, "the victim's processes to die")

    survivors = [n for n in nodes if n is not victim]
    for n in survivors:
        assert n.wait(FINISH) == 0, cluster.tails()
    last_node, accuracy = cluster.final(survivors)
    assert ints_after("WORLD_SIZE_SEEN", last_node.stdout())[-1] == 2
    assert ints_after("RESUMED_FROM_EPOCH", last_node.stdout())[-1] >= 2  # resumed from the checkpoint
    assert accuracy >= 0.90


def test_a_late_third_node_joins_and_the_group_grows_to_three(cluster, tmp_path):
    gate = str(tmp_path / "third-may-join")
    first = [cluster.node(f"node{i}", "2:3", epochs=16) for i in range(2)]
    third = cluster.node("late", "2:3", epochs=16, gate=gate)  # imports now, joins on cue
    eventually(lambda: cluster.trained(2, 1), START, "training at world size 2", cluster.tails)
    assert 3 not in [w for n in first for w in ints_after("WORLD_SIZE_SEEN", n.stdout())]
    open(gate, "w").close()

    for n in [*first, third]:
        assert n.wait(FINISH) == 0, cluster.tails()
    last_node, accuracy = cluster.final([*first, third])
    assert ints_after("WORLD_SIZE_SEEN", last_node.stdout())[-1] == 3
    assert ints_after("RESUMED_FROM_EPOCH", last_node.stdout())[-1] >= 1
    assert accuracy >= 0.90


def test_sigterm_to_one_node_does_not_close_the_run(cluster):
    nodes = [cluster.node(f"node{i}", "1:2", epochs=12) for i in range(2)]
    eventually(lambda: cluster.trained(2, 1), START, "training at world size 2", cluster.tails)

    leaving = cluster.rank0_node(2)  # the node hosting rank 0 (and the workers' TCPStore) leaves
    stayer = next(n for n in nodes if n is not leaving)
    workers = leaving.descendants()
    os.kill(leaving.pid, signal.SIGTERM)
    assert leaving.wait(60) == 128 + signal.SIGTERM, cluster.tails()
    eventually(lambda: not any(pid_alive(p) for p in workers), 10, "the leaving node's workers to stop")
    handler = create_handler(cluster.url)
    try:
        assert not handler.is_closed()  # leaving is not closing

        assert stayer.wait(FINISH) == 0, cluster.tails()
        _, accuracy = cluster.final([stayer])
        assert ints_after("WORLD_SIZE_SEEN", stayer.stdout())[-1] == 1
        assert accuracy >= 0.90
        assert handler.is_closed()  # the successful node closed the run
    finally:
        handler.shutdown()


def test_a_node_with_other_nnodes_is_refused_with_exit_2_and_the_others_train_on(cluster, tmp_path):
    """Two nodes train with ``--nnodes 2:3``; a third starts with ``--nnodes 2:2``: it exits 2 at once, naming
    ``max_nodes`` and both values, without joining or closing the run; the two train on undisturbed (one
    round) and end with 0. Before, the two kinds of node formed rounds together until one failed and closed
    the run for all."""
    gate = str(tmp_path / "mismatched-may-join")
    pair = [cluster.node(f"node{i}", "2:3", epochs=16) for i in range(2)]
    odd = cluster.node("odd", "2:2", epochs=16, gate=gate)  # imports now, starts on cue
    eventually(lambda: cluster.trained(2, 1), START, "training at world size 2", cluster.tails)
    opened = time.monotonic()
    open(gate, "w").close()
    assert odd.wait(60) == 2, cluster.tails()
    assert time.monotonic() - opened < 5.0, cluster.tails()
    assert "max_nodes=2 differs from the run's max_nodes=3" in odd.stderr(), odd.tail()
    handler = create_handler(cluster.url)
    try:
        assert not handler.is_closed()  # the refused node left the run as it was
    finally:
        handler.release()

    for n in pair:
        assert n.wait(FINISH) == 0, cluster.tails()
    last_node, accuracy = cluster.final(pair)
    assert ints_after("WORLD_SIZE_SEEN", last_node.stdout()) == [2]  # one round: nobody re-formed
    assert accuracy >= 0.90
