"""``examples/slurm/train.sbatch`` under a real Slurm (``slurmctld`` and three ``slurmd`` on this host, see
:mod:`tests.support.slurm_cluster`), over a real Redis server: jobs submitted with ``sbatch``, requeued with
``scontrol requeue``, signalled with ``scancel``, one node's task killed with SIGKILL. What a job does is read
from its workers' records (:mod:`tests.support.agent_workers.step_worker`), from Slurm's view of the job
(``JobState``, ``ExitCode``, ``Restarts``) and from the run's state in Redis, not from log wording.

* the real torch example trains to the end on 3 nodes;
* a job that ended, requeued, trains again as the run's incarnation 1, and a second job trains in a run of its own
  -- under ``rdzv-run`` and under torchrun with the ``rdzv-redis`` handler (parametrized by launcher);
* ``scancel --signal=USR1``, to the steps or (``--batch``) to the batch shell, which passes it to ``srun``: every
  worker sees SIGUSR1, the job exits 138, the run stays open;
* one node's launcher and its worker killed (SIGKILL) in a job started with ``--nnodes 2:3`` (and no
  ``--max-restarts``: the script's default 3 stands): the two others re-form at world size 2 and finish; the job
  fails with the killed task's status;
* a running job requeued (Slurm's SIGTERM to its steps): its workers stop unfinished and leave the run open; the
  requeued job trains in incarnation 1 from the workers' checkpoints to the target step count.

One test trains the real torch example; the others use the torch-free step worker, so that the module stays
within a few minutes of wall time on 2 cores (docs/schedulers.md, "Tested", has measured times).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import psutil
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
#: The launchers the script is tested with: ``RDZV_RUN`` (a program beside this Python) and ``RDZV_BACKEND``.
LAUNCHERS = {"rdzv-run": "redis", "torchrun": "rdzv-redis"}


def _submit(slurm: SlurmCluster, tmp_path, redis, name: str, argv: list[str], options: str = "",
            launcher: str = "rdzv-run", max_restarts: int | None = 0) -> int:
    """``sbatch`` of the example script with the training command ``argv``, ``options`` appended to the
    launcher's (``RDZV_RUN_OPTIONS``), ``launcher`` a key of :data:`LAUNCHERS`; the job id. ``RDZV_RUN_OPTIONS``
    starts with ``--max-restarts MAX_RESTARTS`` (``None``: none, the script's default stands) and the test's
    short rendezvous settings.

    Raises:
        RuntimeError: sbatch failed.
    """
    env = {
        "RDZV_BACKEND": LAUNCHERS[launcher], "RDZV_ENDPOINT": redis.address,
        "RDZV_RUN": _launcher_path(launcher),
        "RDZV_RUN_OPTIONS": " ".join([*([] if max_restarts is None else [f"--max-restarts {max_restarts}"]),
                                      "--rdzv-conf last_call_timeout=0.5,keep_alive_ttl=2", options]).strip(),
        "TMPDIR": str(tmp_path),
    }
    return slurm.sbatch([f"--output={tmp_path / name}.out", f"--chdir={tmp_path}", SCRIPT, *argv], env=env)


def _launcher_path(launcher: str) -> str:
    """The program ``launcher`` (a key of :data:`LAUNCHERS`) beside this Python (it may not exist)."""
    return os.path.join(os.path.dirname(sys.executable), launcher)


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


def _all_stepping(out: str, job_id: int, restart: int, world: int) -> list[dict] | None:
    """The records of ``job_id``'s start ``restart`` when there are ``world`` of them, each at world size ``world``
    with a step taken; else ``None``."""
    recs = _records(out, job_id, restart)
    if len(recs) == world and all(r["world_size"] == world and r["steps"] > r.get("resumed_from", 0) for r in recs):
        return recs
    return None


def _task_of(pid: int) -> psutil.Process:
    """The Slurm task (a launcher: the child of a ``slurmstepd``) that ``pid`` descends from.

    Raises:
        LookupError: ``pid`` descends from no ``slurmstepd``.
        psutil.NoSuchProcess: ``pid`` or an ancestor exited meanwhile.
    """
    proc = psutil.Process(pid)
    for parent in proc.parents():
        if parent.name() == "slurmstepd":
            return proc
        proc = parent
    raise LookupError(f"process {pid} is not in a Slurm step")


def _kill_tree(proc: psutil.Process) -> list[int]:
    """SIGKILL ``proc`` and every process under it (collected first, so none escapes to init); their pids."""
    tree = [proc, *proc.children(recursive=True)]
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in tree]


def _job_ended(slurm: SlurmCluster, job_id: int, restarts: int) -> dict[str, str] | None:
    """``job_id``'s fields once its start number ``restarts`` (``Restarts``) ended, else ``None``."""
    fields = slurm.job(job_id)
    if fields.get("Restarts") == str(restarts) and fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
        return fields
    return None


def _requeue_and_release(slurm: SlurmCluster, job_id: int) -> None:
    """``scontrol requeue`` the job, wait until it is pending again, and release it at once (Slurm holds a requeued
    job: its ``BeginTime``, 120 s here), as an operator would.

    Raises:
        AssertionError: a command failed, or the job was not pending again within 30 s.
    """
    done = slurm.run(["scontrol", "requeue", str(job_id)])
    assert done.returncode == 0, done.stderr
    eventually(lambda: slurm.job(job_id).get("JobState") == "PENDING", 30, f"job {job_id} to be pending again",
               detail=lambda: str(slurm.job(job_id)))
    done = slurm.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
    assert done.returncode == 0, done.stderr


def test_the_example_script_trains_digits_to_the_end_on_three_nodes(slurm, tmp_path, rdzv_server_redis):
    job = _submit(slurm, tmp_path, rdzv_server_redis, "digits",
                  [TRAIN_DIGITS, "--epochs", "3", "--checkpoint", str(tmp_path / "ckpt.pt")])
    fields = slurm.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"], 240)
    out = _output(tmp_path, "digits")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert "WORLD_SIZE_SEEN 3" in out.splitlines(), out[-4000:]
    assert any(line.startswith("accuracy=") for line in out.splitlines()), out[-4000:]
    assert run_is_closed(_url(rdzv_server_redis, job, 0))


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_requeued_job_trains_again_and_two_jobs_never_share_a_run(slurm, tmp_path, rdzv_server_redis, launcher):
    if not os.path.exists(_launcher_path(launcher)):
        pytest.skip(f"no {launcher} beside {sys.executable}")
    out = str(tmp_path / "records")
    steps = ["--steps", "20", "--step-time", "0.02"]
    first = _submit(slurm, tmp_path, rdzv_server_redis, "first", [STEP_WORKER, "--out", out, *steps],
                    launcher=launcher)
    assert slurm.wait_state(first, ["COMPLETED", "FAILED"], JOB_TIMEOUT)["JobState"] == "COMPLETED", \
        _output(tmp_path, "first")
    assert run_is_closed(_url(rdzv_server_redis, first, 0))

    other = _submit(slurm, tmp_path, rdzv_server_redis, "other", [STEP_WORKER, "--out", out, *steps],
                    launcher=launcher)
    assert slurm.wait_state(other, ["COMPLETED", "FAILED"], JOB_TIMEOUT)["JobState"] == "COMPLETED", \
        _output(tmp_path, "other")
    for job in (first, other):  # each job is a world of its own nodes, in a run of its own
        recs = _records(out, job, 0)
        assert all(os.path.basename(r["parent_argv"][-1]) == launcher for r in recs), recs  # workers' parent
        assert [r["world_size"] for r in recs] == [NODES] * NODES and {r["run_id"] for r in recs} == {str(job)}
        assert all(r["done"] and r["steps"] == 20 for r in recs)
        # ranks in the allocation's node order, whichever launcher joined first
        assert [(r["rank"], r["node_id"]) for r in recs] == [(i, str(i)) for i in range(NODES)], recs

    _requeue_and_release(slurm, first)
    fields = eventually(lambda: _job_ended(slurm, first, 1), JOB_TIMEOUT, f"requeued job {first} to end",
                        detail=lambda: _output(tmp_path, "first")[-4000:])
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), _output(tmp_path, "first")
    again = _records(out, first, 1)  # written by the requeued job (SLURM_RESTART_COUNT=1)
    assert [r["restart_count"] for r in again] == [1] * NODES
    assert all(os.path.basename(r["parent_argv"][-1]) == launcher for r in again), again
    assert [r["world_size"] for r in again] == [NODES] * NODES and all(r["steps"] == 20 for r in again)
    assert {r["run_id"] for r in again} == {str(first)}
    assert [(r["rank"], r["node_id"]) for r in again] == [(i, str(i)) for i in range(NODES)], again
    assert run_is_closed(_url(rdzv_server_redis, first, 1))  # the requeued job's own run, closed at its end


@pytest.mark.parametrize("target", ["steps", "batch"])
def test_usr1_reaches_the_workers_and_the_nodes_leave_the_run_open(slurm, tmp_path, rdzv_server_redis, target):
    """``scancel --signal=USR1``: to the job's steps (as ``--signal=USR1@N``), or ``--batch``: to the batch shell
    only (as ``--signal=B:USR1@N``), whose trap passes it to ``srun`` (without it the shell dies: ``FAILED 0:10``)."""
    out = str(tmp_path / "records")
    job = _submit(slurm, tmp_path, rdzv_server_redis, "signalled",
                  [STEP_WORKER, "--out", out, "--until", str(tmp_path / "never")], options="--shutdown-timeout 2")
    eventually(lambda: len([r for r in _records(out, job, 0) if r["steps"] > 0]) == NODES, JOB_TIMEOUT,
               "every node's worker to take steps", detail=lambda: _output(tmp_path, "signalled"))
    scancel = ["scancel", "--signal=USR1", *(["--batch"] if target == "batch" else []), str(job)]
    assert slurm.run(scancel).returncode == 0
    fields = slurm.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED"], JOB_TIMEOUT)
    recs = _records(out, job, 0)
    assert [("SIGUSR1" in r["signals"], r["done"]) for r in recs] == [(True, False)] * NODES, recs
    assert fields["JobState"] == "FAILED"  # every launcher stopped by the signal: 128 + SIGUSR1
    assert fields["ExitCode"].split(":")[0] == "138", fields
    assert not run_is_closed(_url(rdzv_server_redis, job, 0))  # no node closed the run


def test_a_killed_node_leaves_the_others_to_re_form_at_two_and_finish(slurm, tmp_path, rdzv_server_redis):
    out, stop = str(tmp_path / "records"), tmp_path / "stop"
    job = _submit(slurm, tmp_path, rdzv_server_redis, "killed",
                  [STEP_WORKER, "--out", out, "--until", str(stop), "--sigterm-exits"], options="--nnodes 2:3",
                  max_restarts=None)
    before = eventually(lambda: _all_stepping(out, job, 0, NODES), JOB_TIMEOUT,
                        "every node's worker to take steps at world size 3", detail=lambda: _output(tmp_path, "killed"))
    # RDZV_RUN_OPTIONS ("--nnodes 2:3", no --max-restarts) add to the script's defaults: its 3 restarts stand
    assert [r["max_restarts"] for r in before] == [3] * NODES, before
    victim = next(r for r in before if r["node_id"] == "1")  # the middle node: the survivors' ranks must close up
    killed = _kill_tree(_task_of(victim["pid"]))
    assert victim["pid"] in killed

    def reformed() -> dict[str, dict] | None:
        recs = {r["node_id"]: r for r in _records(out, job, 0) if r["world_size"] == NODES - 1 and r["steps"] > 0}
        return recs if set(recs) == {"0", "2"} else None

    after = eventually(reformed, JOB_TIMEOUT, "the two other nodes' workers to take steps at world size 2",
                       detail=lambda: _output(tmp_path, "killed"))
    # new workers (the others stopped theirs to re-form), ranks in the survivors' order
    assert not {r["pid"] for r in after.values()} & {r["pid"] for r in before}
    assert [(r["rank"], r["node_id"]) for r in sorted(after.values(), key=lambda r: r["rank"])] == [(0, "0"), (1, "2")]

    stop.touch()
    fields = eventually(lambda: _job_ended(slurm, job, 0), JOB_TIMEOUT, f"job {job} to end",
                        detail=lambda: _output(tmp_path, "killed")[-4000:])
    survivors = [r for r in _records(out, job, 0) if r["world_size"] == NODES - 1]
    assert [(r["node_id"], r["done"]) for r in sorted(survivors, key=lambda r: r["rank"])] == [
        ("0", True), ("2", True)], survivors
    # srun waits for the other tasks (--kill-on-bad-exit=0) and exits with the killed task's status, 128 + SIGKILL;
    # the batch script ends with it
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "137:0"), (fields, _output(tmp_path, "killed"))
    assert run_is_closed(_url(rdzv_server_redis, job, 0))  # the survivors ended the run by themselves


def test_a_running_job_requeued_continues_from_its_checkpoints(slurm, tmp_path, rdzv_server_redis):
    out, ckpt, target = str(tmp_path / "records"), str(tmp_path / "ckpt"), 150
    job = _submit(slurm, tmp_path, rdzv_server_redis, "preempted",
                  [STEP_WORKER, "--out", out, "--steps", str(target), "--checkpoint", ckpt, "--sigterm-exits"])
    eventually(lambda: _all_stepping(out, job, 0, NODES), JOB_TIMEOUT, "every node's worker to take steps",
               detail=lambda: _output(tmp_path, "preempted"))
    _requeue_and_release(slurm, job)  # Slurm stops the running job's steps with SIGTERM first
    first = _records(out, job, 0)
    assert [("SIGTERM" in r["signals"], r["done"]) for r in first] == [(True, False)] * NODES, first
    assert all(0 < r["steps"] < target for r in first), first
    assert not run_is_closed(_url(rdzv_server_redis, job, 0))  # stopped by a signal: left open

    fields = eventually(lambda: _job_ended(slurm, job, 1), JOB_TIMEOUT, f"requeued job {job} to end",
                        detail=lambda: _output(tmp_path, "preempted")[-4000:])
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), _output(tmp_path, "preempted")
    again = _records(out, job, 1)
    assert [(r["restart_count"], r["world_size"], r["done"]) for r in again] == [(1, NODES, True)] * NODES, again
    assert [(r["rank"], r["node_id"]) for r in again] == [(i, str(i)) for i in range(NODES)], again
    # each rank resumed from where the same rank stopped, and took the rest of the steps in this start
    assert [(r["resumed_from"], r["steps"]) for r in again] == [(r["steps"], target) for r in first], (first, again)
    assert all(r["steps"] - r["resumed_from"] > 0 for r in again), again
    assert run_is_closed(_url(rdzv_server_redis, job, 1))
