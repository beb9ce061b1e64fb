"""torch's file-timer watchdog (``TORCHELASTIC_ENABLE_FILE_TIMER``) under ``rdzv-run`` and plain ``torchrun``.

The worker is torchrun code, unchanged: ``timer.configure(timer.FileTimerClient(
os.environ["TORCHELASTIC_TIMER_FILE"]))`` and ``with timer.expires(after=...)``. Before
:mod:`rdzv_agent.supervision.watchdog` the variable was missing under ``rdzv-run`` (KeyError).
"""

from __future__ import annotations

import json
import os
import textwrap
import time

import psutil
import pytest

from tests.support.agent_workers.harness import Launcher

pytestmark = [pytest.mark.slow, pytest.mark.launchers]
pytest.importorskip("torch")

# Writes start_<restart count>_<local rank> (JSON: pid, time, timer file) first. Attempt 0, local rank 0: a 1 s
# scope around a 60 s sleep (expires); every other worker: a 10 s scope around 0.2 s (finishes in time).
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch.distributed.elastic.timer as timer
    out = sys.argv[1]
    rc, lr = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
    path = os.environ["TORCHELASTIC_TIMER_FILE"]
    with open(os.path.join(out, f"start_{rc}_{lr}"), "w") as f:
        json.dump({"pid": os.getpid(), "time": time.time(), "timer_file": path}, f)
    timer.configure(timer.FileTimerClient(path))
    if rc == "0" and lr == "0":
        with timer.expires(after=1, scope="slow-step"):
            time.sleep(60)
    with timer.expires(after=10, scope="quick-step"):
        time.sleep(0.2)
    open(os.path.join(out, f"done_{rc}_{lr}"), "w").close()
    """
)

LAUNCHERS = {"rdzv-run": "rdzv_agent.launch.launcher", "torchrun": "torch.distributed.run"}


def start(tmp_path, launcher: str, env: dict[str, str]) -> Launcher:
    (tmp_path / "w.py").write_text(WORKER)
    argv = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
            str(tmp_path / "w.py"), str(tmp_path)]
    return Launcher(argv, str(tmp_path), launcher, env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1", **env},
                    module=LAUNCHERS[launcher])


def started(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / name).read_text())


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_expired_scope_kills_the_worker_and_rdzv_run_restarts_it(tmp_path) -> None:
    node = start(tmp_path, "rdzv-run", {})
    try:
        assert node.wait(180) == 0, node.tail()
    finally:
        node.kill_all()
    first, restarted = started(tmp_path, "start_0_0"), started(tmp_path, "start_1_0")
    assert not (tmp_path / "done_0_0").exists()  # killed inside its 60 s sleep
    assert restarted["time"] - first["time"] < 30  # ~1 s scope + torch's 0.1 s watchdog loop + the restart
    assert gone(first["pid"])
    # the worker that finished in time was untouched; the second attempt (TORCHELASTIC_RESTART_COUNT=1) finished
    assert (tmp_path / "done_0_1").exists() and (tmp_path / "done_1_0").exists() and (tmp_path / "done_1_1").exists()
    # torch's semantics: a new $TMPDIR/watchdog_timer_<uuid> pipe per start, the same for all workers of a start
    files = {started(tmp_path, f"start_{a}_{lr}")["timer_file"] for a in (0, 1) for lr in (0, 1)}
    assert len(files) == 2
    for path in files:
        assert os.path.dirname(path) == str(tmp_path / "tmp") and os.path.basename(path).startswith("watchdog_timer_")
        assert not os.path.exists(path)  # removed when the workers stopped


def test_timer_file_variable_names_the_pipe(tmp_path) -> None:
    pipe = str(tmp_path / "my.pipe")
    node = start(tmp_path, "rdzv-run", {"TORCHELASTIC_TIMER_FILE": pipe})
    try:
        assert node.wait(180) == 0, node.tail()
    finally:
        node.kill_all()
    assert {started(tmp_path, f"start_{a}_{lr}")["timer_file"] for a in (0, 1) for lr in (0, 1)} == {pipe}
    assert not (tmp_path / "done_0_0").exists() and (tmp_path / "done_1_0").exists()
    assert not os.path.exists(pipe)


def test_same_script_under_torchrun_kills_the_worker_and_torchrun_itself(tmp_path) -> None:
    """Reference: torch 2.13's FileTimerServer kills the expired worker, then SIGKILLs its own process (torchrun):
    no restart despite --max-restarts 1 (rdzv-run kills the worker only; see rdzv_agent/supervision/watchdog.py)."""
    node = start(tmp_path, "torchrun", {})
    try:
        code = node.wait(180)
        first = started(tmp_path, "start_0_0")
        deadline = time.monotonic() + 10
        while not gone(first["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(first["pid"]) and not (tmp_path / "done_0_0").exists()
        assert code == -9, node.tail()
        assert not (tmp_path / "start_1_0").exists()
        assert (tmp_path / "done_0_1").exists()  # the worker that finished in time was untouched
    finally:
        node.kill_all()
        pids = [started(tmp_path, f)["pid"] for f in os.listdir(tmp_path) if f.startswith("start_")]
        for pid in pids:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def test_enable_value_other_than_0_or_1_is_a_usage_error(tmp_path) -> None:
    node = start(tmp_path, "rdzv-run", {"TORCHELASTIC_ENABLE_FILE_TIMER": "true"})
    try:
        assert node.wait(120) == 2, node.tail()
    finally:
        node.kill_all()
    assert "TORCHELASTIC_ENABLE_FILE_TIMER" in node.stderr() and "'true'" in node.stderr()


def test_stop_before_any_client_leaves_no_thread(tmp_path) -> None:
    """torch's FileTimerServer leaves its thread blocked opening the pipe when no worker ever wrote to it."""
    import threading

    from rdzv_agent.supervision.watchdog import WorkerWatchdog

    before = set(threading.enumerate())
    watchdog = WorkerWatchdog(True, str(tmp_path / "pipe"))
    env: dict[str, str] = {}
    watchdog.start("run", [env])
    assert env == {"TORCHELASTIC_TIMER_FILE": str(tmp_path / "pipe")} and os.path.exists(env["TORCHELASTIC_TIMER_FILE"])
    assert len(set(threading.enumerate()) - before) == 1
    watchdog.stop()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before
    assert not os.path.exists(env["TORCHELASTIC_TIMER_FILE"])
