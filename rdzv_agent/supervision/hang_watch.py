"""Agent side of progress reporting: read the workers' progress files, publish them, catch hung workers.

Each start of the group gets a fresh directory of progress files (``RDZV_PROGRESS_FILE``, see
:mod:`rdzv_agent.progress`) and a stack file per worker (``RDZV_STACK_FILE``, in the worker's log
directory). :class:`ProgressMonitor.poll` (every monitor pass) reads the files; a worker that
reported progress once and then none for ``hang_timeout`` seconds (agent's monotonic clock) is
*hung*: :func:`dump_stacks` writes every worker's Python stacks to its stack file and the log,
and the agent counts a failure (:class:`WorkerHang`). A :class:`Publisher` thread writes the
node's progress to the rendezvous backend through the handler's ``publish_progress`` (rdzv's
handlers; others have none) at most every ``RDZV_PROGRESS_INTERVAL`` seconds. See
``docs/operations.md`` ("Progress and hangs").
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping

import psutil

from ..api import WorkerFailure
from ..elastic import elastic_handler
from .health import positive_seconds
from ..progress import DUMP_SIGNAL, FILE_ENV, STACK_ENV

__all__ = ["HangWatch", "ProgressMonitor", "Publisher", "WorkerHang", "dump_stacks", "interval_from_env",
           "INTERVAL_ENV", "DEFAULT_INTERVAL", "STACK_FILE_NAME"]

log = logging.getLogger(__name__)

INTERVAL_ENV = "RDZV_PROGRESS_INTERVAL"
#: Seconds between two progress writes of a node (1,000 nodes: 200 writes/s).
DEFAULT_INTERVAL = 5.0
#: The stack file's name in the worker's log directory.
STACK_FILE_NAME = "stacks.log"
#: Seconds :func:`dump_stacks` waits for a dump (py-spy, or faulthandler's output to settle).
DUMP_WAIT = 10.0


def interval_from_env(environ: Mapping[str, str]) -> float:
    """``RDZV_PROGRESS_INTERVAL`` in seconds (default :data:`DEFAULT_INTERVAL`).

    Raises:
        ConfigError: not a finite number > 0.
    """
    raw = environ.get(INTERVAL_ENV)
    return DEFAULT_INTERVAL if raw is None or not raw.strip() else positive_seconds(INTERVAL_ENV, raw)


class WorkerHang(WorkerFailure):
    """A worker that made no progress for ``hang_timeout`` seconds (still running when reported)."""


@dataclass
class _Watched:
    local_rank: int
    global_rank: int
    pid: int
    progress_file: str
    stack_file: str
    signature: tuple[int, int, bytes] | None = None  # (mtime ns, size, content) of the last read
    step: int | None = None
    wall: float = 0.0  # Unix seconds of the last report (the file's mtime)
    changed: float = 0.0  # time.monotonic() when the agent last saw the file change


class ProgressMonitor:
    """The workers' progress files of one agent, and its hang check.

    Args:
        hang_timeout: seconds without progress after a first report before a worker is hung; ``None``: off.
    """

    def __init__(self, hang_timeout: float | None = None) -> None:
        self.hang_timeout = hang_timeout
        self._dir: str | None = None
        self._watched: dict[int, _Watched] = {}
        self._lock = threading.Lock()

    def prepare(self, envs: Mapping[int, MutableMapping[str, str]], log_dirs: Mapping[int, str | None]) -> None:
        """Before a start: a fresh progress directory; set both variables in each local rank's ``envs``.

        ``log_dirs``: local rank -> its log directory (the stack file goes there), or ``None`` (the
        progress directory then).
        """
        self.close()
        self._dir = tempfile.mkdtemp(prefix="rdzv-progress-")
        for lr, env in envs.items():
            env[FILE_ENV] = os.path.join(self._dir, f"{lr}.step")
            stack_dir = log_dirs.get(lr) or self._dir
            os.makedirs(stack_dir, exist_ok=True)
            env[STACK_ENV] = os.path.join(stack_dir, STACK_FILE_NAME if log_dirs.get(lr) else f"{lr}.{STACK_FILE_NAME}")
            if os.path.exists(env[STACK_ENV]):
                os.remove(env[STACK_ENV])  # its existence tells that the worker registered the dump signal

    def started(self, workers: Mapping[int, tuple[int, int]], envs: Mapping[int, Mapping[str, str]]) -> None:
        """The workers started: local rank -> ``(global rank, pid)``."""
        with self._lock:
            self._watched = {lr: _Watched(lr, rank, pid, envs[lr][FILE_ENV], envs[lr][STACK_ENV])
                             for lr, (rank, pid) in workers.items()}

    def poll(self, running: set[int]) -> list[int]:
        """Read the progress files; return the local ranks among ``running`` that are hung."""
        now = time.monotonic()
        hung = []
        with self._lock:
            for w in self._watched.values():
                self._read(w, now)
                if self.hang_timeout is not None and w.step is not None and w.local_rank in running \
                        and now - w.changed > self.hang_timeout:
                    hung.append(w.local_rank)
        return hung

    @staticmethod
    def _read(w: _Watched, now: float) -> None:
        try:
            with open(w.progress_file, "rb") as f:
                st = os.fstat(f.fileno())
                content = f.read(64)
        except OSError:
            return
        signature = (st.st_mtime_ns, st.st_size, content)
        if signature == w.signature:
            return
        try:
            step = int(content.split()[0])
        except (ValueError, IndexError):
            return  # being rewritten (truncated, not yet written): read again next time
        w.signature, w.step, w.wall, w.changed = signature, step, st.st_mtime_ns / 1e9, now

    def snapshot(self) -> dict[int, tuple[int, int, float]]:
        """Global rank -> ``(local rank, last step, Unix seconds of it)`` of the workers that reported."""
        with self._lock:
            return {w.global_rank: (w.local_rank, w.step, w.wall) for w in self._watched.values() if w.step is not None}

    def seconds_since(self, local_rank: int) -> float:
        """Seconds since the agent last saw ``local_rank``'s progress change (``inf`` if never)."""
        w = self._watched.get(local_rank)
        return math.inf if w is None or w.step is None else time.monotonic() - w.changed

    def stack_files(self) -> dict[int, tuple[int, str]]:
        """Local rank -> ``(pid, stack file)`` of the current workers."""
        return {lr: (w.pid, w.stack_file) for lr, w in self._watched.items()}

    def close(self) -> None:
        """Forget the workers and remove the progress directory (idempotent)."""
        with self._lock:
            self._watched = {}
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def dump_stacks(pid: int, stack_file: str) -> tuple[str, str]:
    """Write the Python stacks of process ``pid`` to ``stack_file``; return ``(how, why)``: how is
    ``"py-spy"``, ``"faulthandler"`` or ``"none"``, why says what failed when it is ``"none"``.

    py-spy (``py-spy dump --pid PID``) first when it is on ``PATH``; else, if the worker created
    ``stack_file`` (it imported :mod:`rdzv_agent.progress`), :data:`~rdzv_agent.progress.DUMP_SIGNAL`,
    then up to :data:`DUMP_WAIT` seconds for the file to stop growing. A stopped worker (SIGSTOP, a frozen
    cgroup) cannot handle the signal: it is not waited for.
    """
    py_spy = shutil.which("py-spy")
    if py_spy is not None:
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=DUMP_WAIT)
            if done.returncode == 0 and done.stdout.strip():
                with open(stack_file, "a", encoding="utf-8") as f:
                    f.write(done.stdout)
                return "py-spy", ""
            log.warning("py-spy dump of pid %d failed (%s); trying faulthandler", pid, done.stderr.strip()[:200])
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("py-spy dump of pid %d failed (%s); trying faulthandler", pid, exc)
    if not os.path.exists(stack_file):
        return "none", "no py-spy on PATH and the worker did not import rdzv_agent.progress"
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return "none", "the worker is gone"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "none", f"the worker is stopped ({status}): it cannot write its stacks"
    before = os.path.getsize(stack_file)
    try:
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return "none", "the worker is gone"
    deadline, size, steady_since = time.monotonic() + DUMP_WAIT, before, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now_size = os.path.getsize(stack_file)
        if now_size != size:
            size, steady_since = now_size, time.monotonic()
        elif size > before and time.monotonic() - steady_since >= 0.2:
            break
    if size > before:
        return "faulthandler", ""
    return "none", f"the worker wrote no stacks within {DUMP_WAIT:g} s of {DUMP_SIGNAL.name}"


def read_dump(stack_file: str, offset: int = 0) -> str:
    """The stack file's text from byte ``offset`` (``""`` if unreadable)."""
    try:
        with open(stack_file, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class Publisher:
    """A daemon thread that hands the latest progress to ``publish(workers)`` at most every ``interval`` s.

    Args:
        publish: called on the thread with global rank -> ``(step, Unix seconds)``; what it raises is logged.
        interval: seconds between two calls (> 0).
    """

    def __init__(self, publish: Callable[[dict[int, tuple[int, float]]], Any], interval: float) -> None:
        self._publish = publish
        self.interval = interval
        self._latest: dict[int, tuple[int, float]] | None = None
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rdzv-progress-publisher", daemon=True)
        self._thread.start()

    def offer(self, workers: dict[int, tuple[int, float]]) -> None:
        """The latest progress (replaces one not yet published); empty: nothing to publish."""
        with self._cond:
            self._latest = workers or None
            self._cond.notify()

    def pause(self) -> None:
        """Drop what was not published yet (the workers are being stopped)."""
        with self._cond:
            self._latest = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._latest is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                workers = self._latest
            try:
                self._publish(dict(workers or {}))
            except Exception:  # a publishing bug must not end the agent; the next offer tries again
                log.exception("publishing the workers' progress failed")
            with self._cond:
                self._cond.wait_for(lambda: self._stopped, self.interval)


class HangWatch:
    """One agent's progress reporting: a :class:`ProgressMonitor`, a :class:`Publisher` through the handler's
    ``publish_progress`` (none for handlers without it), and the stack dumps of a hang.

    Args:
        handler: the rendezvous handler.
        hang_timeout: seconds (``None``: no hang check; progress is still published).
        interval: seconds between two progress writes (:data:`INTERVAL_ENV`).
    """

    def __init__(self, handler: Any, hang_timeout: float | None = None, interval: float = DEFAULT_INTERVAL) -> None:
        self.monitor = ProgressMonitor(hang_timeout)
        self._interval = interval
        elastic = elastic_handler(handler)
        self._publish = None if elastic is None else elastic.publish_progress
        self._publisher: Publisher | None = None

    def prepare(self, envs: Mapping[int, MutableMapping[str, str]], log_dirs: Mapping[int, str | None]) -> None:
        """See :meth:`ProgressMonitor.prepare`."""
        self.monitor.prepare(envs, log_dirs)

    def started(self, workers: Mapping[int, tuple[int, int]], envs: Mapping[int, Mapping[str, str]]) -> None:
        """See :meth:`ProgressMonitor.started`."""
        self.monitor.started(workers, envs)

    def check(self, running: set[int]) -> list[int]:
        """Poll the progress files, hand them to the publisher; return the hung local ranks."""
        hung = self.monitor.poll(running)
        if self._publish is not None:
            snapshot = {rank: (step, wall) for rank, (_, step, wall) in self.monitor.snapshot().items()}
            if snapshot:
                if self._publisher is None:
                    self._publisher = Publisher(self._write, self._interval)
                self._publisher.offer(snapshot)
        return hung

    def _write(self, workers: dict[int, tuple[int, float]]) -> None:
        if self._publish is not None:  # the publisher exists only with it
            self._publish(workers, ttl=3 * self._interval, hang_timeout=self.monitor.hang_timeout)

    def failures(self, hung: list[int], workers: Mapping[int, tuple[int, int, str | None]],
                 role: str) -> dict[int, Exception]:
        """Dump the stacks of every worker in ``workers`` (local rank -> ``(global rank, pid, stderr log)``,
        the running ones) to their stack files and the log; return a :class:`WorkerHang` per ``hung`` rank."""
        timeout = self.monitor.hang_timeout
        files = self.monitor.stack_files()
        since = {lr: self.monitor.seconds_since(lr) for lr in hung}  # before the dumps take their time
        offsets = {lr: os.path.getsize(files[lr][1]) if os.path.exists(files[lr][1]) else 0 for lr in workers}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(workers)),
                                                   thread_name_prefix="rdzv-stack-dump") as pool:
            dumps = {lr: pool.submit(dump_stacks, pid, files[lr][1]) for lr, (_, pid, _) in workers.items()}
        out: dict[int, Exception] = {}
        for lr, (rank, pid, stderr_path) in sorted(workers.items()):
            stack_file = files[lr][1]
            how, why = dumps[lr].result()
            state = "hung" if lr in hung else "running"
            if how == "none":
                log.error("[%s] worker rank %d (pid %d, %s): no stack dump (%s)", role, rank, pid, state, why)
            else:
                log.error("[%s] worker rank %d (pid %d, %s): Python stacks (%s, also in %s):\n%s", role, rank, pid,
                          state, how, stack_file, read_dump(stack_file, offsets[lr]).rstrip())
            if lr in hung:
                out[rank] = WorkerHang(
                    global_rank=rank, local_rank=lr, exit_code=None, log_path=stderr_path, pid=pid,
                    error=f"hung: no progress for {since[lr]:.1f} s > --hang-timeout {timeout:g} s; stacks "
                          f"({how}): {stack_file if how != 'none' else 'none: ' + why}")
        return out

    def stopping(self) -> None:
        """The workers are being stopped: publish nothing more of them."""
        if self._publisher is not None:
            self._publisher.pause()

    def close(self) -> None:
        """Stop the publisher and remove the progress files (idempotent)."""
        if self._publisher is not None:
            self._publisher.stop()
            self._publisher = None
        self.monitor.close()
