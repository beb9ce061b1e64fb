"""The node's reaper: what the workers start ends with the node (Linux).

Workers start helpers of their own -- data-loader processes, compile servers, monitoring
sidecars -- often in a new session (``start_new_session=True``), where stopping the
worker's process group does not reach them, and a helper whose worker exited is
re-parented away from the worker's tree. ``rdzv-run`` (:func:`rdzv_agent.launch.launcher.main`
run as its own process) makes sure they end with the node, in two parts:

* **The launcher is a subreaper** (``prctl(PR_SET_CHILD_SUBREAPER)``): a process of a
  worker's tree whose parent dies is re-parented to the launcher instead of to init.
  So every process the workers left behind is a child of the launcher (or a descendant
  of one) that is not a live worker: :meth:`NodeReaper.adopted` finds them. When a worker
  group stops -- restart, membership change, failure, success, signal --
  :func:`rdzv_agent.workers.process.stop_processes` stops them with the workers' trees: the same
  signal (SIGTERM), then SIGKILL after the shutdown grace (``--shutdown-timeout``), and
  reaps them. Meanwhile those that exit on their own are reaped at most every
  :data:`REAP_INTERVAL` seconds (:meth:`NodeReaper.reap`), so they do not stay zombies.
  A subreaper rather than a cgroup: it needs no rights (a cgroup v2 subtree must be
  writable and delegated; on cgroup v1 or hybrid hosts, and in most containers, it is
  not), and it is exact for the launcher's own children.
* **A watch process outlives the launcher** for ``kill -9``: the kernel kills the
  workers (``PR_SET_PDEATHSIG``, :mod:`rdzv_agent.workers.process`), but their helpers are then
  re-parented to init, as are those the launcher had adopted. At start the launcher runs
  this file as a small program (stdlib and psutil only, no torch)
  in a session of its own, holding the read end of a pipe whose write end only the
  launcher holds. Every worker gets a per-launcher token in :data:`TOKEN_ENV`, inherited
  by whatever it starts. When the pipe closes -- the launcher exited, normally or killed
  -- the watch stops every process whose environment holds the token, and their
  descendants (SIGTERM, then SIGKILL after the grace), then exits. After a normal exit it
  finds nothing: the launcher stopped them first. Limit: a helper started with an
  environment that does not carry the token (``env={}``) is stopped while the launcher
  lives, but not after a ``kill -9`` of the launcher.

The opt-out (``rdzv-run --keep-orphans``, ``PET_KEEP_ORPHANS=1``) leaves all of this off:
the launcher is no subreaper, no watch runs, and processes the workers leave behind keep
running (those still in a worker's tree when the group is stopped are stopped with it,
as always). Under plain torchrun (torch's own agent) none of this applies.

Elsewhere than Linux, or where ``prctl`` fails, :meth:`NodeReaper.start` returns ``None``
(with a WARNING) and the launcher behaves as with ``--keep-orphans``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Callable, Collection, Sequence

import psutil

__all__ = ["NodeReaper", "TOKEN_ENV", "REAP_INTERVAL", "alive", "libc_prctl", "terminate"]

log = logging.getLogger(__name__)

#: The variable each worker gets: the launcher's token, which whatever the worker starts inherits.
TOKEN_ENV = "RDZV_REAPER_TOKEN"
#: Seconds between two reapings of adopted processes that exited on their own.
REAP_INTERVAL = 1.0

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
#: Runs this file as ``__main__`` (the watch) without putting its directory, or the current one, on ``sys.path``.
_RUN_WATCH = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv.pop(1), run_name='__main__')"


@functools.lru_cache(maxsize=1)
def libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def alive(proc: psutil.Process) -> bool:
    """True if ``proc`` is running and not a zombie."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def terminate(procs: Sequence[psutil.Process], grace: float, sig: int = signal.SIGTERM) -> list[psutil.Process]:
    """Send ``sig`` to ``procs``, wait up to ``grace`` seconds for them to end, SIGKILL the rest.

    Returns:
        The processes that had to be SIGKILLed.
    """
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = []
    for proc in procs:
        if alive(proc):
            try:
                proc.kill()
                killed.append(proc)
            except psutil.Error:
                pass
    return killed


def _with_descendants(roots: Sequence[psutil.Process]) -> list[psutil.Process]:
    """``roots`` and every descendant of each, without duplicates (roots first)."""
    found: dict[int, psutil.Process] = {p.pid: p for p in roots}
    for root in roots:
        try:
            found.update((p.pid, p) for p in root.children(recursive=True))
        except psutil.Error:
            pass
    return list(found.values())


class NodeReaper:
    """The launcher as subreaper of its workers' processes, and the watch that outlives it (see the module).

    Build with :meth:`start`; :meth:`close` when the launcher is done.

    Args:
        token: the value of :data:`TOKEN_ENV` in the workers' environment.
        watch: the watch process, or ``None`` (then a ``kill -9`` of the launcher leaves the helpers).
        pipe: the write end of the watch's pipe (closed by :meth:`close`), or ``None``.
    """

    def __init__(self, token: str, watch: subprocess.Popen[bytes] | None, pipe: int | None) -> None:
        self.token = token
        self._watch = watch
        self._pipe = pipe
        self._reaped_at = 0.0
        self._kept: set[int] = set()

    @classmethod
    def start(cls, grace: float) -> NodeReaper | None:
        """Make this process a subreaper and start the watch process.

        Args:
            grace: seconds the watch waits between SIGTERM and SIGKILL (the launcher's shutdown timeout).

        Returns:
            The reaper, or ``None`` (logged as a WARNING) where ``PR_SET_CHILD_SUBREAPER`` is not available.
        """
        prctl = libc_prctl()
        if prctl is None or prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            errno = ctypes.get_errno() if prctl is not None else 0
            log.warning("cannot make the launcher a subreaper (%s): processes the workers leave behind may "
                        "outlive it", os.strerror(errno) if errno else "not Linux")
            return None
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        read_end, write_end = os.pipe()  # both close-on-exec: the workers never get the write end
        try:
            watch = subprocess.Popen(
                [sys.executable, "-c", _RUN_WATCH, os.path.abspath(__file__), token, repr(float(grace))],
                stdin=read_end, stdout=subprocess.DEVNULL, close_fds=True, start_new_session=True,
            )
        except OSError as exc:
            os.close(write_end)
            log.warning("cannot start the reaper's watch process (%s): after a kill -9 of the launcher, processes "
                        "its workers started may outlive it", exc)
            watch, write_end = None, -1
        finally:
            os.close(read_end)
        return cls(token, watch, write_end if watch is not None else None)

    @property
    def env(self) -> dict[str, str]:
        """The variables to add to each worker's environment."""
        return {TOKEN_ENV: self.token}

    def keep(self, pids: Collection[int]) -> None:
        """Children that are not left behind though no worker: the agent's warm processes (:mod:`.warm`)."""
        self._kept.update(pids)

    def release(self, pids: Collection[int]) -> None:
        """Undo :meth:`keep` for ``pids``."""
        self._kept.difference_update(pids)

    def _own(self) -> set[int]:
        return self._kept | ({self._watch.pid} if self._watch is not None else set())

    def adopted(self, workers: Collection[int]) -> list[psutil.Process]:
        """Processes the workers left behind: this process's children that are not in ``workers`` (pids), the
        watch nor kept (:meth:`keep`), and all their descendants."""
        skip = set(workers) | self._own()
        try:
            children = [p for p in psutil.Process().children() if p.pid not in skip]
        except psutil.Error:
            return []
        return _with_descendants(children)

    def reap(self, workers: Collection[int], force: bool = False) -> None:
        """Collect the exit status of adopted children that ended (not ``workers``: their ``Popen`` does).

        At most every :data:`REAP_INTERVAL` seconds unless ``force``.
        """
        now = time.monotonic()
        if not force and now - self._reaped_at < REAP_INTERVAL:
            return
        self._reaped_at = now
        skip = set(workers) | self._own()
        try:
            children = [p for p in psutil.Process().children() if p.pid not in skip]
        except psutil.Error:
            return
        for child in children:
            try:
                os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Close the watch's pipe and wait up to ``timeout`` seconds for it to exit (idempotent)."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._watch is not None:
            try:
                self._watch.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the reaper's watch process (pid %d) did not exit within %g s", self._watch.pid, timeout)
            self._watch = None


def _marked(token: str) -> list[psutil.Process]:
    """Live processes (not this one) whose environment holds ``TOKEN_ENV=token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TOKEN_ENV) == token and alive(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _watch(token: str, grace: float) -> int:
    """The watch process: wait for the launcher's pipe (stdin) to close, then stop what carries ``token``."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # a terminal's or a session's signals: keep watching
        signal.signal(sig, signal.SIG_IGN)
    while os.read(0, 4096):
        pass
    left = _with_descendants(_marked(token))
    if left:
        sys.stderr.write(f"rdzv-run: the launcher (pid {token.split('-')[0]}) is gone; stopping {len(left)} "
                         f"processes its workers started: {sorted(p.pid for p in left)}\n")
        sys.stderr.flush()
        terminate(left, grace)
    return 0


if __name__ == "__main__":
    sys.exit(_watch(sys.argv[1], float(sys.argv[2])))
