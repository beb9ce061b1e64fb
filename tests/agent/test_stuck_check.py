"""The stuck-process check (``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``) with workers really in ``D`` state.

The D state is real: the worker blocks in the kernel's vfork wait
(``agent_workers/dstate.py``), which ``/proc`` shows as ``D`` and psutil as
``disk-sleep``. Before :mod:`rdzv_agent.supervision.stuck`, ``rdzv-run`` ignored the variable:
the stuck worker ran its 60 s and was restarted or succeeded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.support.agent_workers import dstate
from tests.support.agent_workers.harness import Launcher
from tests.support.waiting import eventually
from rdzv_agent.supervision.stuck import UninterruptibleCheck, in_uninterruptible_sleep

pytestmark = [pytest.mark.skipif(not dstate.supported(), reason="needs Linux x86_64/aarch64 (raw clone)"),
              pytest.mark.launchers]

ENV = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"
DSTATE = dstate.__file__

# start_<restart count>_<local rank> first; local rank 0 then sits in D for $D_SECONDS, local rank 1 sleeps as long.
WORKER = textwrap.dedent(
    f"""
    import os, sys, time
    sys.path.insert(0, {os.path.dirname(DSTATE)!r})
    from dstate import uninterruptible_sleep
    out = sys.argv[1]
    rc, lr = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
    open(os.path.join(out, f"start_{{rc}}_{{lr}}"), "w").close()
    seconds = float(os.environ["D_SECONDS"])
    if lr == "0":
        uninterruptible_sleep(seconds)
    else:
        time.sleep(seconds)
    open(os.path.join(out, f"done_{{rc}}_{{lr}}"), "w").close()
    """
)


def test_check_flags_a_real_d_state_process_only_after_the_timeout(tmp_path) -> None:
    marker = tmp_path / "in"
    stuck = subprocess.Popen([sys.executable, DSTATE, "30", str(marker)])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        eventually(lambda: in_uninterruptible_sleep(stuck.pid), 30, "the D state")
        assert psutil.Process(stuck.pid).status() == "disk-sleep"
        assert in_uninterruptible_sleep(sleeper.pid) is False
        now = [100.0]
        check = UninterruptibleCheck(2.0, clock=lambda: now[0])
        pids = {0: stuck.pid, 1: sleeper.pid}
        assert check.check(pids) == {}  # first seen now
        now[0] = 101.9
        assert check.check(pids) == {}
        now[0] = 102.0
        assert check.check(pids) == {0: 2.0}
        stuck.kill()  # killable: SIGKILL ends the wait
        stuck.wait(10)
        now[0] = 110.0
        assert check.check(pids) == {}  # no longer in D (gone): forgotten
        assert UninterruptibleCheck(0.0).check(pids) == {}  # 0: off
    finally:
        for proc in (stuck, sleeper):
            proc.kill()
            proc.wait(10)


def our_processes(script: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if script in (proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def launch(tmp_path, module: str, env: dict[str, str], restarts: int = 2) -> Launcher:
    (tmp_path / "w.py").write_text(WORKER)
    argv = ["--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts), "--monitor-interval", "0.2",
            str(tmp_path / "w.py"), str(tmp_path)]
    return Launcher(argv, str(tmp_path), module.rsplit(".", 1)[-1], env=env, module=module)


@pytest.mark.slow
@pytest.mark.parametrize("module", ["rdzv_agent.launch.launcher", "torch.distributed.run"])
def test_worker_in_d_state_past_the_timeout_fails_the_job_without_restart(tmp_path, module) -> None:
    """Under rdzv-run and torchrun 2.13 alike: the job ends within seconds, no restart despite --max-restarts 2.

    torchrun then exits 0, a torch bug: its agent returns the UNHEALTHY result, and ``launch_agent`` only
    raises for ``RunResult.is_failed()`` (state FAILED). rdzv-run exits 1."""
    script = str(tmp_path / "w.py")
    node = launch(tmp_path, module, {ENV: "1", "D_SECONDS": "60"})
    try:
        eventually(lambda: (tmp_path / "start_0_0").exists(), 120, "the workers", node.tail)
        began = time.monotonic()
        assert node.wait(30) == (1 if module == "rdzv_agent.launch.launcher" else 0), node.tail()
        assert time.monotonic() - began < 30  # not the 60 s of the D state
        assert not (tmp_path / "start_1_0").exists() and not (tmp_path / "done_0_0").exists()
        if module == "rdzv_agent.launch.launcher":  # the stuck worker and its vfork child were stopped with the job
            assert eventually(lambda: not our_processes(script), 10, "the workers gone")
    finally:
        node.kill_all()
        for proc in our_processes(script):
            proc.kill()


def test_bad_value_is_a_usage_error_naming_the_variable(tmp_path) -> None:
    (tmp_path / "ok.py").write_text("pass\n")
    done = subprocess.run([sys.executable, "-m", "rdzv_agent.launch.launcher", "--standalone", str(tmp_path / "ok.py")],
                          env={**os.environ, ENV: "5s"}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert ENV in done.stderr and "'5s'" in done.stderr
