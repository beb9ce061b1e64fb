"""A node's processes end with the node: what ``rdzv-run``'s workers start does not outlive the launcher.

Real ``rdzv-run`` launchers (``--standalone``), real workers (``agent_workers/orphan_worker.py``, no torch): each
worker starts a helper in a new session that holds the worker's output pipes and sleeps 600 s, then fails (or
waits). After the launcher ends -- failures with no restarts left, SIGTERM, ``kill -9`` -- no helper may be
left within 2 s, and a helper holding the launcher's pipes must not delay its exit. ``--keep-orphans`` leaves
them running.
"""

from __future__ import annotations

import glob
import os
import signal
import time

import psutil
import pytest

from tests.support.agent_workers.harness import HERE, Launcher, pid_alive

from tests.support.waiting import eventually

pytestmark = [pytest.mark.agent_scenario, pytest.mark.launchers]

ORPHAN_WORKER = os.path.join(HERE, "orphan_worker.py")
#: Seconds the helpers may outlive their launcher (the watchdog's or the launcher's kill, then the kernel's reaping).
GONE_WITHIN = 2.0
#: Seconds per attempt, from its first worker's start, within which a launcher whose workers fail must exit
#: (a helper that held its pipes made each attempt wait about 7 s for them to close). Launcher start-up
#: (torch) excluded: on a loaded host it alone takes longer than that.
EXIT_PER_ATTEMPT = 5.0
#: The helper's command line, to recognize it before killing a recorded pid at teardown.
HELPER_MARK = "time.sleep(600)"


def helper_pids(out):
    """The pids the workers recorded for their helpers: ``{"RANK-ATTEMPT": pid}``."""
    found = {}
    for path in glob.glob(os.path.join(out, "helper-*.pid")):
        with open(path) as f:
            found[os.path.basename(path)[len("helper-"):-len(".pid")]] = int(f.read())
    return found


def since_first_attempt(out):
    """Seconds from the first attempt's helper record (written once its worker runs) until now (wall clock)."""
    return time.time() - os.path.getmtime(os.path.join(out, "helper-0-0.pid"))


def alive(pids):
    return sorted(p for p in pids if pid_alive(p))


@pytest.fixture
def node(tmp_path):
    """``node(argv)`` starts one launcher; at teardown it and every recorded helper are killed (by pid)."""
    started = []
    out = str(tmp_path / "out")

    def start(argv, name="node"):
        launcher = Launcher(argv, str(tmp_path), name)
        started.append(launcher)
        return launcher

    start.out = out
    yield start
    for launcher in started:
        launcher.kill_all()
    for pid in helper_pids(out).values():
        try:
            proc = psutil.Process(pid)
            if HELPER_MARK in " ".join(proc.cmdline()):
                proc.kill()
        except psutil.Error:
            pass


def assert_gone(pids, launcher):
    eventually(lambda: not alive(pids), GONE_WITHIN, "the workers' helpers to be gone",
               lambda: f"alive: {alive(pids)}\n{launcher.tail()}")


def test_helpers_of_failed_attempts_end_with_the_launcher_and_do_not_delay_it(node):
    launcher = node(["--standalone", "--nproc-per-node", "1", "--max-restarts", "2", "--monitor-interval", "0.1",
                     ORPHAN_WORKER, "--out", node.out])
    assert launcher.wait(60) == 1, launcher.tail()
    took = since_first_attempt(node.out)
    pids = helper_pids(node.out)
    assert sorted(pids) == ["0-0", "0-1", "0-2"], launcher.tail()  # the first start and two restarts
    assert took < 3 * EXIT_PER_ATTEMPT, f"the launcher took {took:.1f} s\n{launcher.tail()}"
    assert_gone(pids.values(), launcher)


def test_sigterm_ends_the_helpers_of_every_attempt(node, tmp_path):
    launcher = node(["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.1",
                     ORPHAN_WORKER, "--out", node.out, "--fail-attempts", "1", "--wait-for", str(tmp_path / "never")])
    pids = eventually(lambda: len(helper_pids(node.out)) == 2 and helper_pids(node.out), 60,
                      "the second attempt's helper", launcher.tail)
    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.wait(30) == 128 + signal.SIGTERM, launcher.tail()
    assert_gone(pids.values(), launcher)


def test_kill_9_of_the_launcher_ends_the_helpers(node, tmp_path):
    """The workers die of PR_SET_PDEATHSIG; their helpers, re-parented to init, by the launcher's watchdog."""
    launcher = node(["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", ORPHAN_WORKER,
                     "--out", node.out, "--fail-attempts", "0", "--wait-for", str(tmp_path / "never")])
    pids = eventually(lambda: len(helper_pids(node.out)) == 2 and helper_pids(node.out), 60,
                      "both workers' helpers", launcher.tail)
    os.kill(launcher.pid, signal.SIGKILL)
    assert launcher.wait(30) == -signal.SIGKILL
    assert_gone(pids.values(), launcher)


def test_keep_orphans_leaves_the_helpers_running(node):
    launcher = node(["--standalone", "--nproc-per-node", "1", "--keep-orphans", "--monitor-interval", "0.1",
                     ORPHAN_WORKER, "--out", node.out])
    assert launcher.wait(60) == 1, launcher.tail()
    took = since_first_attempt(node.out)
    pids = list(helper_pids(node.out).values())
    assert len(pids) == 1 and alive(pids) == pids, launcher.tail()  # the teardown kills it by pid
    assert took < EXIT_PER_ATTEMPT, f"the launcher took {took:.1f} s\n{launcher.tail()}"
