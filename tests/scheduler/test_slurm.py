"""``examples/slurm/train.sbatch`` under a real Slurm (``slurmctld`` and three ``slurmd`` on this host, see
:mod:`tests.support.slurm_cluster`), over a real Redis server: jobs submitted with ``sbatch``, requeued with
``scontrol requeue``, signalled with ``scancel``. What a job does is read from its workers' records
(:mod:`tests.support.agent_workers.step_worker`) and from Slurm's view of the job, not from log wording.

One test trains the real torch example; the others use the torch-free step worker, so that the module stays
near a minute and a half of wall time on 2 cores.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from tests.support.agent_workers.harness import HERE, REPO, TRAIN_DIGITS
from tests.support.launch_runs import run_is_closed
from tests.support.slurm_cluster import SlurmCluster
from tests.support.waiting import eventually

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(300)]

SCRIPT = os.path.join(REPO, "examples", "slurm", "train.sbatch")
STEP_WORKER = os.path.join(HERE, "step_worker.py")
NODES = 3
#: Seconds a job of the step worker may take from submission to its end (three launchers start on 2 cores).
JOB_TIMEOUT = 120.0


def _submit(slurm: SlurmCluster, tmp_path, redis, name: str, argv: list[str], options: str = "") -> int:
    """``sbatch`` of the example script with the training command ``argv``; the job id."""
    env = {
        "RDZV_BACKEND": "redis", "RDZV_ENDPOINT": redis.address,
        "RDZV_RUN": os.path.join(os.path.dirname(sys.executable), "rdzv-run"),
        "RDZV_RUN_OPTIONS": f"--max-restarts 0 --rdzv-conf last_call_timeout=0.5,keep_alive_ttl=2 {options}".strip(),
        "TMPDIR": str(tmp_path),
    }
    return slurm.sbatch([f"--output={tmp_path / name}.out", f"--chdir={tmp_path}", SCRIPT, *argv], env=env)


def _records(out: str, job_id: int, restart: int) -> list[dict]:
    found = []
    for path in sorted(glob.glob(os.path.join(out, f"{job_id}-{restart}-*.json"))):
        with open(path) as f:
            found.append(json.load(f))
    return found


def _url(redis, job_id: int, incarnation: int) -> str:
    """The URL of the job's run (incarnation 0: the URL without the key, as the job's first start uses it)."""
    return f"redis://{redis.address}/{job_id}" + (f"?incarnation={incarnation}" if incarnation else "")


def _output(tmp_path, name: str) -> str:
    with open(tmp_path / f"{name}.out", encoding="utf-8", errors="replace") as f:
        return f.read()


def test_the_example_script_trains_digits_to_the_end_on_three_nodes(slurm, tmp_path, rdzv_server_redis):
    job = _submit(slurm, tmp_path, rdzv_server_redis, "digits",
                  [TRAIN_DIGITS, "--epochs", "3", "--checkpoint", str(tmp_path / "ckpt.pt")])
    fields = slurm.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"], 240)
    out = _output(tmp_path, "digits")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert "WORLD_SIZE_SEEN 3" in out.splitlines(), out[-4000:]
    assert any(line.startswith("accuracy=") for line in out.splitlines()), out[-4000:]
    assert run_is_closed(_url(rdzv_server_redis, job, 0))


def test_a_requeued_job_trains_again_and_two_jobs_never_share_a_run(slurm, tmp_path, rdzv_server_redis):
    out = str(tmp_path / "records")
    steps = ["--steps", "20", "--step-time", "0.02"]
    first = _submit(slurm, tmp_path, rdzv_server_redis, "first", [STEP_WORKER, "--out", out, *steps])
    assert slurm.wait_state(first, ["COMPLETED", "FAILED"], JOB_TIMEOUT)["JobState"] == "COMPLETED", \
        _output(tmp_path, "first")
    assert run_is_closed(_url(rdzv_server_redis, first, 0))

    other = _submit(slurm, tmp_path, rdzv_server_redis, "other", [STEP_WORKER, "--out", out, *steps])
    assert slurm.wait_state(other, ["COMPLETED", "FAILED"], JOB_TIMEOUT)["JobState"] == "COMPLETED", \
        _output(tmp_path, "other")
    for job in (first, other):  # each job is a world of its own nodes, in a run of its own
        recs = _records(out, job, 0)
        assert [r["world_size"] for r in recs] == [NODES] * NODES and {r["run_id"] for r in recs} == {str(job)}
        assert all(r["done"] and r["steps"] == 20 for r in recs)
        # ranks in the allocation's node order, whichever launcher joined first
        assert [(r["rank"], r["node_id"]) for r in recs] == [(i, str(i)) for i in range(NODES)], recs

    assert slurm.run(["scontrol", "requeue", str(first)]).returncode == 0
    # Slurm holds a requeued job (its BeginTime: 120 s here); release it now, as an operator would
    eventually(lambda: slurm.job(first).get("JobState") == "PENDING", 30, f"job {first} to be pending again")
    assert slurm.run(["scontrol", "update", f"JobId={first}", "StartTime=now"]).returncode == 0
    fields = eventually(lambda: (lambda f: f if f.get("Restarts") == "1" and f.get("JobState") in (
        "COMPLETED", "FAILED") else None)(slurm.job(first)), JOB_TIMEOUT, f"requeued job {first} to end")
    assert fields["JobState"] == "COMPLETED", _output(tmp_path, "first")
    again = _records(out, first, 1)  # written by the requeued job (SLURM_RESTART_COUNT=1)
    assert [r["restart_count"] for r in again] == [1] * NODES
    assert [r["world_size"] for r in again] == [NODES] * NODES and all(r["steps"] == 20 for r in again)
    assert [(r["rank"], r["node_id"]) for r in again] == [(i, str(i)) for i in range(NODES)], again
    assert run_is_closed(_url(rdzv_server_redis, first, 1))


def test_usr1_reaches_the_workers_and_the_nodes_leave_the_run_open(slurm, tmp_path, rdzv_server_redis):
    out = str(tmp_path / "records")
    job = _submit(slurm, tmp_path, rdzv_server_redis, "signalled",
                  [STEP_WORKER, "--out", out, "--until", str(tmp_path / "never")], options="--shutdown-timeout 2")
    eventually(lambda: len([r for r in _records(out, job, 0) if r["steps"] > 0]) == NODES, JOB_TIMEOUT,
               "every node's worker to take steps", detail=lambda: _output(tmp_path, "signalled"))
    assert slurm.run(["scancel", "--signal=USR1", str(job)]).returncode == 0  # to the job's steps: the launchers
    fields = slurm.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED"], JOB_TIMEOUT)
    recs = _records(out, job, 0)
    assert [("SIGUSR1" in r["signals"], r["done"]) for r in recs] == [(True, False)] * NODES, recs
    assert fields["JobState"] == "FAILED"  # every launcher stopped by the signal: 128 + SIGUSR1
    assert fields["ExitCode"].split(":")[0] == "138", fields
    assert not run_is_closed(_url(rdzv_server_redis, job, 0))  # no node closed the run
