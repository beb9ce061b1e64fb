"""A job restarted under the same run id (a Slurm requeue keeps the job id) is not locked out by its own earlier,
closed run: ``SLURM_RESTART_COUNT`` makes it the run's next incarnation (``docs/schedulers.md``). Without it, the
reused id is refused with the way out."""

from __future__ import annotations

import pytest

from tests.support.agent_workers.harness import WORKER
from tests.support.launch_runs import new_run, records, run_is_closed

pytestmark = [pytest.mark.agent_scenario, pytest.mark.launchers]  # over file:// only (tests/conftest.py)


def _job(procs, url: str, out: str, name: str, env: dict[str, str] | None = None) -> list[int]:
    """Two ``rdzv-run`` nodes of one job on ``url``; their exit codes."""
    nodes = [procs.start(["--rdzv", url, "--nnodes", "2", "--monitor-interval", "0.1", WORKER, "--out", out],
                         f"{name}{i}", env=env) for i in range(2)]
    codes = [node.wait(120) for node in nodes]
    assert codes == [0, 0], "\n".join(node.tail() for node in nodes)
    return codes


def test_a_restarted_job_trains_again_under_its_restart_count(node_url, procs, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    run_id = new_run(procs)
    url = node_url(run_id)
    assert _job(procs, url, str(tmp_path / "first"), "first") == [0, 0]
    assert run_is_closed(url)

    restarted = str(tmp_path / "restarted")
    assert _job(procs, url, restarted, "restarted", env={"SLURM_RESTART_COUNT": "1"}) == [0, 0]
    recs = records(restarted)
    assert sorted(r["RANK"] for r in recs) == ["0", "1"] and {r["WORLD_SIZE"] for r in recs} == {"2"}
    assert run_is_closed(url + "&incarnation=1")  # the restarted job ended as a job does: its incarnation closed

    reused = str(tmp_path / "reused")
    node = procs.start(["--rdzv", url, "--nnodes", "2", WORKER, "--out", reused], "reused")
    assert node.wait(120) == 1, node.tail()
    assert not records(reused)
    closed_lines = [line for line in node.stderr().splitlines() if "is closed" in line]
    assert any("rdzv reset" in line for line in closed_lines), node.tail()
