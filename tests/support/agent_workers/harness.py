"""Test harness: start ``rdzv-run`` processes, wait on their output with deadlines, kill everything.

Every launcher runs in its own session; its workers run in theirs. Cleanup
finds the workers even after their launcher died, by the run id that each
worker has in ``TORCHELASTIC_RUN_ID``, and SIGKILLs every process group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Iterable, Sequence

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # HERE is tests/support/agent_workers
TRAIN_DIGITS = os.path.join(REPO, "examples", "train_digits.py")


class Launcher:
    """One ``rdzv-run`` process; stdout and stderr go to files in ``workdir``.

    Args:
        argv: arguments after ``rdzv-run``.
        workdir: directory for ``NAME.out`` / ``NAME.err``.
        name: label for messages and file names.
        env: extra environment variables (``RDZV_NODE_NAME`` is ``name`` unless given: the launchers of a test
            share a host, as the nodes of a job do not).
        gate: if given, the launcher imports everything first and starts only
            once this file exists (a pre-warmed node that joins on cue).
        module: the launcher module run with ``python -m`` (``torch.distributed.run`` for torchrun).
        prefix: argv put before the command, e.g. a multi-host ``Host.command_prefix`` to run it on that host.
    """

    def __init__(
        self,
        argv: Sequence[str],
        workdir: str,
        name: str,
        env: dict[str, str] | None = None,
        gate: str | None = None,
        module: str = "rdzv_agent.launch.launcher",
        prefix: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.out_path = os.path.join(workdir, f"{name}.out")
        self.err_path = os.path.join(workdir, f"{name}.err")
        if gate is None:
            cmd = [sys.executable, "-m", module, *argv]
        elif module != "rdzv_agent.launch.launcher":
            raise ValueError("gate is for rdzv-run launchers only")
        else:
            code = (
                "import os, sys, time\n"
                "from rdzv_agent.launch.launcher import main\n"
                f"gate = {gate!r}\n"
                "deadline = time.monotonic() + 300\n"
                "while not os.path.exists(gate) and time.monotonic() < deadline:\n"
                "    time.sleep(0.02)\n"
                "sys.exit(main())  # sys.argv[1:]: as the rdzv-run command (the node's reaper)\n"
            )
            cmd = [sys.executable, "-c", code, *argv]
        full_env = dict(os.environ)
        full_env.pop("RDZV_URL", None)
        tmpdir = os.path.join(workdir, "tmp")  # default log dirs land here, not in /tmp
        os.makedirs(tmpdir, exist_ok=True)
        full_env["TMPDIR"] = tmpdir
        full_env["RDZV_NODE_NAME"] = "-".join(name.split()) or "node"  # a node of its own in the run's ledger
        full_env.update(env or {})
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*prefix, *cmd], stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=full_env,
                start_new_session=True, cwd=workdir,
            )
        self.known: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        with open(self.out_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        with open(self.err_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def descendants(self) -> list[int]:
        """Pids of the launcher's live descendants (remembered for cleanup)."""
        try:
            pids = [p.pid for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            pids = []
        self.known.update(pids)
        return pids

    def workers(self) -> list[int]:
        """Pids of the launcher's live descendants but its reaper's watch process (``rdzv_agent.workers.reaper``), which
        lives as long as the launcher: the workers and what they started."""
        pids = []
        for pid in self.descendants():
            try:
                if not any(arg.endswith("reaper.py") for arg in psutil.Process(pid).cmdline()):
                    pids.append(pid)
            except psutil.Error:
                continue
        return pids

    def wait(self, timeout: float) -> int:
        """The exit status; raises ``AssertionError`` with the output tail if not exited in time."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout} s\n{self.tail()}") from None

    def tail(self, chars: int = 3000) -> str:
        return (f"--- {self.name} stdout ---\n{self.stdout()[-chars:]}\n"
                f"--- {self.name} stderr ---\n{self.stderr()[-chars:]}")

    def freeze(self) -> list[int]:
        """SIGSTOP the launcher and every descendant (a host that stopped: no FIN, no RST); their pids."""
        pids = [self.pid]
        os.kill(self.pid, signal.SIGSTOP)  # first, so that it starts nothing new meanwhile
        for pid in self.descendants():
            try:
                os.kill(pid, signal.SIGSTOP)
                pids.append(pid)
            except ProcessLookupError:
                pass
        return pids

    def kill_all(self) -> None:
        """SIGKILL the launcher and every descendant's process group."""
        self.descendants()
        for pid in [self.pid, *self.known]:
            _kill_group(pid)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _kill_group(pid: int) -> None:
    for fn in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            fn()
        except (ProcessLookupError, PermissionError):
            pass


def processes_of_run(run_id: str) -> list[psutil.Process]:
    """Live processes whose environment has ``TORCHELASTIC_RUN_ID=run_id`` (the workers)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("TORCHELASTIC_RUN_ID") == run_id:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_run(launchers: Iterable[Launcher], run_ids: Iterable[str]) -> None:
    """Kill every launcher and every worker of ``run_ids``; wait until they are gone."""
    for launcher in launchers:
        launcher.kill_all()
    for run_id in run_ids:
        procs = processes_of_run(run_id)
        for proc in procs:
            _kill_group(proc.pid)
        psutil.wait_procs(procs, timeout=10)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def ints_after(prefix: str, text: str) -> list[int]:
    """Every integer that follows ``prefix`` at the start of a line, in order."""
    return [int(m) for m in re.findall(rf"^{re.escape(prefix)}\s*(\d+)\s*$", text, re.MULTILINE)]


def accuracies(text: str) -> list[float]:
    """Every ``accuracy=0.xxxx`` line's value."""
    return [float(m) for m in re.findall(r"^accuracy=([0-9.]+)\s*$", text, re.MULTILINE)]
