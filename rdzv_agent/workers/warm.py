"""Warm workers: the next generation of this node's workers, started ahead with torch imported.

While a round trains, the agent keeps one *warm* process per local slot (``--warm-workers``):
the worker's Python is up, ``sys.argv``/``sys.path[0]`` are as the entry point will see them,
the slot's round-independent environment is set (:meth:`LocalElasticAgent._slot_env
<rdzv_agent.local.LocalElasticAgent>`: ``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``,
``OMP_NUM_THREADS``, ``LOCAL_WORLD_SIZE``, ``ROLE_NAME``, ``TORCHELASTIC_RUN_ID``, ...) and
``torch`` plus the ``--warm-imports`` modules are imported, at ``SCHED_IDLE`` priority; then it
blocks on a socket. When workers start, each slot's warm process gets the round's complete
environment, the launcher's cwd and its stdout/stderr (the same pipes or files a cold start
gets) and runs the entry point in ``__main__`` as CPython does (:mod:`rdzv_agent.workers._warm_boot`).
It was started as a cold worker is: its own session, ``PR_SET_PDEATHSIG``, stdin from
``/dev/null``, no other fds, the reaper's token in its environment (:mod:`rdzv_agent.workers.reaper`), and
under ``numactl`` with ``--numa-binding``. The next generation is started once the workers run.

A start first waits for the slot's warm process to finish its imports (it is switched back to
normal priority: the wait replaces the imports a cold start would do). A slot starts cold instead
when its warm process is gone, its imports failed (a WARNING names
``--warm-imports`` and the error; warm workers then stay off for the run), or its slot environment
differs from the one it was started with. Commands that are not ``PYTHON -u SCRIPT|-m MODULE|-c
CODE ...`` (``--no-python``, a directory or zip as SCRIPT) always start cold
(:func:`boot_argv` gives ``None``).
"""

from __future__ import annotations

import array
import json
import logging
import os
import socket
import subprocess
import tempfile
import zipfile
from typing import Callable, Mapping, Sequence

from .reaper import NodeReaper

__all__ = ["WarmProcess", "WarmPool", "boot_argv", "entry_of", "BOOT", "LOADER", "FD_PLACEHOLDER", "READY_TIMEOUT",
           "WARM_AFTER", "WARM_AFTER_ENV", "entry_path0"]

log = logging.getLogger(__name__)

#: The program a warm process runs (by path, not imported: no ``rdzv_agent`` in its ``sys.modules``).
BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_warm_boot.py")
#: ``python -u -c LOADER BOOT ...``: runs :data:`BOOT` in a namespace of its own, then its ``main()``.
LOADER = ("import sys; p = sys.argv[1]; g = {'__name__': '_rdzv_warm_boot', '__file__': p}; "
          "exec(compile(__import__('pathlib').Path(p).read_bytes(), p, 'exec'), g); g['main']()")
_HEADER = 8
#: Seconds a start waits for a warm process to finish its imports (it runs at normal priority then) before
#: it starts that worker cold: the wait costs nothing a cold start would not spend importing the same modules.
READY_TIMEOUT = 120.0
#: Stands for the socket's fd in a :func:`boot_argv` command.
FD_PLACEHOLDER = "{fd}"
#: Seconds the workers run before the next warm generation is started (``RDZV_WARM_AFTER``): its imports then
#: do not compete with the workers' own start-up, and a job that ends or fails within them pays nothing for it.
WARM_AFTER = 10.0
WARM_AFTER_ENV = "RDZV_WARM_AFTER"


def entry_of(args: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``(kind, entry, rest)`` of the worker command ``PYTHON *args``, or ``None`` if it cannot be warm.

    ``kind`` is ``"script"`` (``-u SCRIPT``: a file, not a zip), ``"module"`` (``-u -m MODULE``) or ``"code"``
    (``-u -c CODE``, ``--run-path``): the commands the launcher builds for a Python entry point.
    """
    if len(args) < 2 or args[0] != "-u":
        return None
    if args[1] in ("-m", "-c"):
        if len(args) < 3:
            return None
        return ("module" if args[1] == "-m" else "code"), args[2], list(args[3:])
    if args[1].startswith("-") or not os.path.isfile(args[1]) or zipfile.is_zipfile(args[1]):
        return None
    return "script", args[1], list(args[2:])


def boot_argv(program: str, args: Sequence[str], imports: Sequence[str]) -> list[str] | None:
    """The warm command for the cold command ``[program, *args]``, or ``None`` if it cannot be warm.

    The command holds :data:`FD_PLACEHOLDER` where :class:`WarmProcess` puts its socket's fd; the commands that
    qualify are :func:`entry_of`'s.
    """
    entry = entry_of(args)
    if entry is None:
        return None
    kind, name, rest = entry
    return [program, "-u", "-c", LOADER, BOOT, FD_PLACEHOLDER, kind, name, ",".join(imports), *rest]


def entry_path0(args: Sequence[str]) -> str | None:
    """``sys.path[0]`` of the worker that ``PYTHON *args`` starts (``None``: not a :func:`boot_argv` command)."""
    if len(args) < 2 or args[0] != "-u":
        return None
    if args[1] == "-m":
        return os.getcwd()
    if args[1] == "-c":
        return ""
    return os.path.dirname(os.path.realpath(args[1]))


def _idle_then(preexec: Callable[[], None] | None) -> Callable[[], None]:
    """A ``preexec_fn``: ``SCHED_IDLE`` (best effort), then ``preexec``. In the child, so no thread escapes it."""
    idle = getattr(os, "SCHED_IDLE", None)
    param = os.sched_param(0)

    def run() -> None:
        if idle is not None:
            try:
                os.sched_setscheduler(0, idle, param)
            except OSError:
                pass
        if preexec is not None:
            preexec()

    return run


def _sched_other(pid: int) -> None:
    """Put every thread of ``pid`` back to the normal scheduling policy (best effort)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):
            pass


class WarmProcess:
    """One warm process of one local slot.

    Args:
        argv: the command from :func:`boot_argv` (possibly after numactl's).
        env: the slot's environment (round-independent variables only).
        preexec: the ``preexec_fn`` of a cold worker (``PR_SET_PDEATHSIG``), or ``None``; the process starts at
            ``SCHED_IDLE`` (:meth:`wait_ready` puts it back).

    Raises:
        OSError: the process cannot be started.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str],
                 preexec: Callable[[], None] | None = None) -> None:
        self.slot_env = dict(env)
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        try:
            self.popen = subprocess.Popen(
                [str(child.fileno()) if a == FD_PLACEHOLDER else a for a in argv],
                env=self.slot_env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                pass_fds=(child.fileno(),), start_new_session=True, close_fds=True,
                preexec_fn=_idle_then(preexec),
            )
        except OSError:
            self._sock.close()
            raise
        finally:
            child.close()
            out.close()
            err.close()
        self.pid = self.popen.pid
        self._status = b""

    def wait_ready(self, timeout: float) -> str | None:
        """Wait up to ``timeout`` seconds for the imports to end, at normal priority from now on.

        Returns:
            ``"ready"``; ``"failed: NAME: ERROR"`` (an import raised); or ``None``: no answer in time, or it
            exited.
        """
        _sched_other(self.pid)
        self._sock.settimeout(timeout)
        try:
            while not self._status.endswith(b"\n"):
                chunk = self._sock.recv(4096)
                if not chunk:
                    return None
                self._status += chunk
        except OSError:  # the timeout included
            return None
        finally:
            self._sock.settimeout(None)
        if self._status.startswith(b"R"):
            return "ready"
        return "failed: " + self._status[1:].decode("utf-8", "replace").strip()

    def activate(self, env: Mapping[str, str], stdout_fd: int, stderr_fd: int) -> None:
        """Make it the worker: send ``env``, this process's cwd and the two fds (which stay open here).

        Raises:
            OSError: it exited, or the socket failed (then start the worker cold).
        """
        if self.popen.poll() is not None:
            raise OSError(f"warm process {self.pid} exited with {self.popen.returncode}")
        payload = json.dumps({"env": dict(env), "cwd": os.getcwd()}).encode("utf-8")
        data = len(payload).to_bytes(_HEADER, "big") + payload
        sent = self._sock.sendmsg([data[:1 << 16]],
                                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [stdout_fd, stderr_fd]))])
        if sent < len(data):  # not sendall(b""): it still sends, and fails once the worker took the message
            self._sock.sendall(data[sent:])
        self._sock.close()

    def discard(self) -> None:
        """SIGKILL and reap it (idempotent)."""
        self._sock.close()
        if self.popen.poll() is None:
            try:
                self.popen.kill()
            except OSError:
                pass
        try:
            self.popen.wait(5.0)
        except subprocess.TimeoutExpired:
            log.warning("warm process %d did not end after SIGKILL", self.pid)


class WarmPool:
    """The agent's warm processes, one per local slot.

    Args:
        imports: modules to import ahead besides ``torch`` (``--warm-imports``).
        reaper: the node's reaper, told to leave the warm processes alone (they are not left-behind processes).
    """

    def __init__(self, imports: Sequence[str] = (), reaper: NodeReaper | None = None) -> None:
        self.imports = list(imports)
        self._reaper = reaper
        self._slots: dict[int, WarmProcess] = {}
        self.enabled = True

    @property
    def pids(self) -> list[int]:
        """Pids of the current warm processes."""
        return [w.pid for w in self._slots.values()]

    def spawn(self, slots: Mapping[int, tuple[Sequence[str], Mapping[str, str]]],
              preexec: Callable[[], None] | None = None) -> None:
        """Start a warm process for each slot that has none: local rank -> (argv, slot env).

        ``preexec`` is the cold workers' ``preexec_fn`` (:func:`~rdzv_agent.workers.process.parent_death_hook`). A slot
        whose process cannot be started is left empty (logged); it then starts cold.
        """
        if not self.enabled:
            return
        for lr, (argv, env) in slots.items():
            if lr in self._slots:
                continue
            try:
                self._slots[lr] = WarmProcess(argv, env, preexec)
            except OSError as exc:
                log.warning("cannot start a warm worker for local rank %d (%s): it will start cold", lr, exc)
                continue
            if self._reaper is not None:
                self._reaper.keep([self._slots[lr].pid])

    def take(self, local_rank: int, slot_env: Mapping[str, str]) -> WarmProcess | None:
        """The slot's warm process, if it can start the worker exactly; else ``None`` (it is discarded).

        Waits for its imports to end (:meth:`WarmProcess.wait_ready`, at most :data:`READY_TIMEOUT` s): one that
        failed is a WARNING and turns warm workers off for the run, as the failure would recur.
        """
        warm = self._slots.pop(local_rank, None)
        if warm is None:
            return None
        if self._reaper is not None:
            self._reaper.release([warm.pid])
        status = warm.wait_ready(READY_TIMEOUT)
        reason = None
        if status is not None and status.startswith("failed"):
            log.warning("warm workers: an import failed in the warm process (%s; --warm-imports %s): the workers "
                        "start cold, and warm workers are off for this run", status[len("failed: "):],
                        ",".join(self.imports) or "not given")
            self.enabled = False
            self.close()
            reason = "its imports failed"
        elif status is None:
            reason = f"it exited with {warm.popen.poll()}" if warm.popen.poll() is not None else \
                f"its imports did not end within {READY_TIMEOUT:g} s"
        elif warm.slot_env != dict(slot_env):
            reason = "the slot's environment changed"
        if reason is None:
            return warm
        log.info("local rank %d starts cold: %s", local_rank, reason)
        warm.discard()
        return None

    def close(self) -> None:
        """Discard every warm process."""
        slots, self._slots = self._slots, {}
        for warm in slots.values():
            warm.discard()
        if self._reaper is not None:
            self._reaper.release([w.pid for w in slots.values()])
