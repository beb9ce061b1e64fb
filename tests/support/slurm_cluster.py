"""A real Slurm cluster on this host for the scheduler tests: ``munged``, one ``slurmctld`` and three ``slurmd``.

:class:`SlurmCluster` writes a ``slurm.conf`` into its own temporary directory (nodes ``n1``-``n3``, all on this
host, each ``slurmd -N nX`` on its own free port; ``proctrack/linuxproc`` and ``task/none``, so no cgroups;
munge with its own key and socket, named by ``AuthInfo``), starts the daemons in the foreground as children of
this process, waits until every node is idle, and on :meth:`stop` cancels what is left of its jobs, stops exactly
the daemons it started (by their pids) and removes the directory. The Slurm commands reach it through
:attr:`SlurmCluster.env` (``SLURM_CONF``).

Needs root (``slurmd`` runs jobs as their user; ``munged --force``) and ``slurm-wlm`` with ``munge``
(``scripts/test.sh`` installs them): :func:`missing` says what is missing, for a skip.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator, Sequence

import pytest

from conformance_tests.servers import free_port
from tests.support.waiting import eventually

__all__ = ["SlurmCluster", "missing", "NODES", "slurm"]

#: The cluster's node names.
NODES = ("n1", "n2", "n3")
_DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "scancel", "sinfo")
#: Seconds the daemons get to come up, and a node to register and become idle.
START_TIMEOUT = 60.0
#: Seconds :meth:`SlurmCluster.stop` waits for the cancelled jobs to end (beyond KillWait: a loaded host).
JOBS_END = 30.0


def missing() -> str | None:
    """Why the Slurm tests cannot run here (not root, a program missing), or ``None`` when they can."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (slurmd, munged)"
    absent = [name for name in _DAEMONS if shutil.which(name) is None]
    if absent:
        return f"slurm-wlm/munge not installed (missing {', '.join(absent)}; scripts/test.sh installs them)"
    return None


class SlurmCluster:
    """One ``slurmctld`` and a ``slurmd`` per node of :data:`NODES`, with their own munge, under a temporary
    directory. Use as a context manager or call :meth:`start` and :meth:`stop`.

    Args:
        kill_wait: Slurm's ``KillWait``: seconds between the SIGTERM and the SIGKILL of a job step that is
            cancelled, preempted or out of time.

    Attributes:
        dir: the temporary directory (configuration, state, spools, logs); ``None`` before :meth:`start`.
        env: the environment for Slurm commands (``os.environ`` with ``SLURM_CONF``).
    """

    def __init__(self, kill_wait: int = 5) -> None:
        self.kill_wait = kill_wait
        #: the first job id (random: two clusters of one test session never reuse a job id, hence a run id)
        self.first_job_id = random.randrange(1000, 1_000_000)
        self.dir: str | None = None
        self.env: dict[str, str] = dict(os.environ)
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- life cycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Write the configuration, start munged, slurmctld and the slurmds; return once every node is idle.

        Raises:
            RuntimeError: a daemon exited during start-up (its log's tail in the message).
            AssertionError: the nodes did not become idle within :data:`START_TIMEOUT` seconds.
        """
        self.dir = tempfile.mkdtemp(prefix="rdzv-slurm-")
        os.chmod(self.dir, 0o755)  # munged refuses a key or socket in a group- or world-writable directory
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.path("slurm.conf")])
            eventually(lambda: self._answers(), START_TIMEOUT, "slurmctld to answer scontrol ping",
                       detail=lambda: self.log_tail("slurmctld"))
            for node in NODES:
                os.makedirs(self.path("spool", node), exist_ok=True)
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", self.path("slurm.conf")])
            eventually(self._all_idle, START_TIMEOUT, f"nodes {', '.join(NODES)} to be idle",
                       detail=lambda: self.sinfo() + "\n" + self.log_tail("slurmctld"))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job of this cluster and wait (up to :data:`JOBS_END` s) until none is left, stop the daemons
        this object started (SIGTERM, then SIGKILL after 10 s) by their pids, and remove the directory. Safe to
        call twice."""
        if self._procs and self._running("slurmctld"):
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
            # the jobs' slurmstepd end their processes (SIGKILL after KillWait) only while slurmd runs: wait
            deadline = time.monotonic() + JOBS_END
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "--noheader", "--format=%i"], env=self.env, capture_output=True, text=True,
                    timeout=30).stdout.strip():
                time.sleep(0.2)
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self._procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._procs.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # -- commands -----------------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """A path under the cluster's directory."""
        assert self.dir is not None, "the cluster is not started"
        return os.path.join(self.dir, *parts)

    def run(self, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command against this cluster; its completed process (``check`` is the caller's)."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def sbatch(self, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        """``sbatch --parsable ARGV``: the job id.

        Raises:
            RuntimeError: sbatch failed (its stderr in the message).
        """
        done = subprocess.run(["sbatch", "--parsable", *argv], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (``JobState``, ``ExitCode``, ``Restarts``, ...); ``{}``
        once the controller forgot it."""
        done = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)])
        if done.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait_state(self, job_id: int, states: Sequence[str], timeout: float) -> dict[str, str]:
        """Wait until ``job_id``'s ``JobState`` is one of ``states``; the job's fields then.

        Raises:
            AssertionError: not within ``timeout`` seconds (the job and the controller's log in the message).
        """
        return eventually(lambda: (lambda fields: fields if fields.get("JobState") in states else None)(
            self.job(job_id)), timeout, f"job {job_id} to be {'/'.join(states)}",
            detail=lambda: f"{self.job(job_id)}\n{self.log_tail('slurmctld')}")

    def sinfo(self) -> str:
        """``sinfo -N``'s output (for messages)."""
        done = self.run(["sinfo", "-N", "-h", "-o", "%N %T"])
        return done.stdout + done.stderr

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a daemon's log (``slurmctld``, ``slurmd-n1``, ``munged``), for messages."""
        try:
            with open(self.path(f"{name}.log"), encoding="utf-8", errors="replace") as f:
                return f"--- {name}.log ---\n" + f.read()[-chars:]
        except OSError as exc:
            return f"--- {name}.log: {exc} ---"

    # -- internals ---------------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.path(f"{name}.out"), "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True)
        self._procs.append((name, proc))

    def _running(self, name: str) -> bool:
        return any(n == name and p.poll() is None for n, p in self._procs)

    def _check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                with open(self.path(f"{name}.out"), encoding="utf-8", errors="replace") as f:
                    out = f.read()[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode} during start-up\n{out}\n"
                                   f"{self.log_tail(name)}")

    def _start_munge(self) -> None:
        os.makedirs(self.path("munge"), mode=0o700)
        key = self.path("munge", "munge.key")
        subprocess.run(["mungekey", "--create", "--keyfile", key], check=True, capture_output=True, timeout=30)
        os.chmod(key, 0o400)
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.path('munge', 'socket')}",
                               f"--key-file={key}", f"--pid-file={self.path('munge', 'munged.pid')}",
                               f"--log-file={self.path('munged.log')}",
                               f"--seed-file={self.path('munge', 'seed')}"])
        eventually(lambda: self._check_alive() or os.path.exists(self.path("munge", "socket")), START_TIMEOUT,
                   "munged's socket", detail=lambda: self.log_tail("munged"))

    def _write_config(self) -> None:
        host = socket.gethostname()
        ctld, first = free_port(), free_port()
        ports = [first, *(free_port() for _ in NODES[1:])]
        for d in ("state", "spool"):
            os.makedirs(self.path(d), exist_ok=True)
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=500 State=UNKNOWN"
            for n, p in zip(NODES, ports, strict=True))
        conf = f"""\
ClusterName=rdzvtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.path('munge', 'socket')}
CredType=cred/munge
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool', '%n')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd-%n.pid')}
SlurmctldLogFile={self.path('slurmctld.log')}
SlurmdLogFile={self.path('slurmd-%n.log')}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/linear
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait={self.kill_wait}
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
JobRequeue=1
FirstJobId={self.first_job_id}
{node_lines}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.path("slurm.conf"), "w") as f:
            f.write(conf)
        self.env["SLURM_CONF"] = self.path("slurm.conf")

    def _answers(self) -> bool:
        self._check_alive()
        return self.run(["scontrol", "ping"]).stdout.count("UP") > 0

    def _all_idle(self) -> bool:
        self._check_alive()
        states = [line.split()[1] for line in self.sinfo().splitlines() if len(line.split()) == 2]
        return len(states) == len(NODES) and all(s.rstrip("*") == "idle" for s in states)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster` for the tests of one module, stopped after them; skipped (with the reason)
    when :func:`missing` says it cannot run here."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    with SlurmCluster() as cluster:
        yield cluster
