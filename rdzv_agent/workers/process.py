"""One worker subprocess: started in its own session, stopped with its whole process tree.

Each worker runs in a new session (``start_new_session=True``), so it leads its
own process group: a Ctrl-C on the launcher's terminal reaches only the
launcher, which forwards it, and stopping a worker reaches every process the
worker started. :func:`stop_processes` sends the signal to each worker's
process group and to every descendant found with psutil (which catches those
that left the group, e.g. in a session of their own), and -- given the node's
:class:`~rdzv_agent.workers.reaper.NodeReaper` (``rdzv-run``) -- to every process the
workers left behind (their parent exited: re-parented to the launcher, a
subreaper); waits up to a grace period, then SIGKILLs what is left.

If the agent itself dies without stopping its workers (``kill -9``, OOM
killer), Linux delivers :data:`PARENT_DEATH_SIGNAL` (SIGKILL) to each worker:
the child sets ``prctl(PR_SET_PDEATHSIG)`` between ``fork`` and ``exec``
(``preexec_fn``), then checks that its parent is still the agent (the agent may
have died before the ``prctl``). Two limits of ``PR_SET_PDEATHSIG``: it fires
when the *thread* that started the worker exits (start workers from a thread
that outlives them, e.g. the main thread, as ``rdzv-run`` does), and it reaches
only the worker itself, not processes the worker started (under ``rdzv-run``
the reaper's watch process stops those, :mod:`rdzv_agent.workers.reaper`). Elsewhere
than Linux nothing is set.

A worker's output is read from pipes (:class:`~rdzv_agent.workers.streams.StreamPump`).
A process the worker started inherits them and may hold them open after the
worker exited: reports and stops wait until what the worker wrote was read
(:meth:`~rdzv_agent.workers.streams.StreamPump.drain`), not for the pipes to close.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from typing import IO, TYPE_CHECKING, Callable, Mapping, Sequence

import psutil

from .reaper import NodeReaper, alive, libc_prctl
from .streams import StreamPump, error_excerpt, stderr_console, stdout_console

if TYPE_CHECKING:
    from .log_specs import WorkerStreams
    from .warm import WarmProcess

__all__ = ["WorkerProcess", "stop_processes", "parent_death_hook", "PARENT_DEATH_SIGNAL"]

log = logging.getLogger(__name__)

#: Signal a worker gets when the agent process dies without stopping it (Linux only).
PARENT_DEATH_SIGNAL = signal.SIGKILL

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with the agent, or ``None`` off Linux.

    ``prctl`` is looked up here, before ``fork``, so the child only makes the
    system call and reads its parent pid (no imports, no locks).
    """
    prctl = libc_prctl()
    if prctl is None:
        return None
    agent_pid = os.getpid()
    death_signal = int(PARENT_DEATH_SIGNAL)

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != agent_pid:  # the agent died before prctl: the signal will never come
            os.kill(os.getpid(), death_signal)

    return set_parent_death_signal


class WorkerProcess:
    """A started worker process and its output pumps.

    Args:
        argv: the command (``argv[0]`` is looked up on ``PATH``).
        env: the complete environment of the worker.
        streams: where stdout and stderr go, the console prefix and the error file
            (``TORCHELASTIC_ERROR_FILE``), from the logs spec (:func:`rdzv_agent.workers.log_specs.worker_streams`).
        on_exit: called from a pump thread when the worker closes its stderr.
        warm: a warm process (:mod:`rdzv_agent.workers.warm`) to become the worker instead of starting ``argv``.

    Raises:
        OSError: the program cannot be executed (e.g. not found), or ``warm`` cannot take the round.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        streams: WorkerStreams,
        on_exit: threading.Event | None = None,
        warm: WarmProcess | None = None,
    ) -> None:
        for path in (streams.stdout, streams.stderr, streams.error_file):
            if path and path != os.devnull:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.stderr_path = streams.stderr
        self.stdout_path = streams.stdout
        self.error_file = streams.error_file
        env = dict(env)
        env["TORCHELASTIC_ERROR_FILE"] = "" if streams.error_file == os.devnull else streams.error_file

        self.warm = warm is not None
        if warm is not None:
            stdout_pipe, stderr_pipe = self._activate(warm, env, streams)
        else:
            stdout_pipe, stderr_pipe = self._spawn(argv, env, streams)
        self.pid = self.popen.pid
        self.started_at = time.monotonic()
        notify = on_exit.set if on_exit is not None else None
        self._stderr = StreamPump(
            stderr_pipe, streams.stderr, stderr_console if streams.stderr_console else None, streams.prefix,
            notify, streams.stderr_filter,
        )
        self._stdout = None
        if stdout_pipe is not None:
            self._stdout = StreamPump(stdout_pipe, streams.stdout, stdout_console, streams.prefix,
                                      None, streams.stdout_filter)
        self._seen_exit: float | None = None
        self._tree: list[psutil.Process] = []
        self._agent_signals: set[int] = set()

    def _spawn(self, argv: Sequence[str], env: Mapping[str, str],
               streams: WorkerStreams) -> tuple[IO[bytes] | None, IO[bytes]]:
        """Start the worker cold; return its stdout pipe (``None``: not piped) and stderr pipe."""
        stdout_target: int | None = None
        stdout_file = None
        if streams.stdout is not None and streams.stdout_console:
            stdout_target = subprocess.PIPE
        elif streams.stdout is not None:
            stdout_file = open(streams.stdout, "ab")
        try:
            self.popen = subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout_file if stdout_file is not None else stdout_target,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                preexec_fn=parent_death_hook(),
            )
        finally:
            if stdout_file is not None:
                stdout_file.close()
        if self.popen.stderr is None:  # cannot happen with stderr=PIPE
            raise RuntimeError("worker started without a stderr pipe")
        return (self.popen.stdout if stdout_target is subprocess.PIPE else None), self.popen.stderr

    def _activate(self, warm: WarmProcess, env: Mapping[str, str],
                  streams: WorkerStreams) -> tuple[IO[bytes] | None, IO[bytes]]:
        """Make ``warm`` the worker, its stdout/stderr wired as :meth:`_spawn` wires a cold one's.

        Raises:
            OSError: the warm process cannot take the round (every fd opened here is closed again).
        """
        opened: list[int] = []
        try:
            err_read, err_write = os.pipe()
            opened += [err_read, err_write]
            out_read = None
            if streams.stdout is not None and streams.stdout_console:
                out_read, out_write = os.pipe()
                opened += [out_read, out_write]
            elif streams.stdout is not None:
                out_write = os.open(streams.stdout, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                opened.append(out_write)
            else:  # not redirected: the launcher's own stdout, as a cold worker inherits it
                out_write = 1
            warm.activate(env, out_write, err_write)
        except OSError:
            for fd in opened:
                os.close(fd)
            raise
        for fd in opened:
            if fd not in (err_read, out_read):
                os.close(fd)
        self.popen = warm.popen
        return (open(out_read, "rb") if out_read is not None else None), open(err_read, "rb")

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal), or ``None`` while running."""
        code = self.popen.poll()
        if code is not None and self._seen_exit is None:
            self._seen_exit = time.monotonic()
        return code

    @property
    def stopped_by_agent(self) -> bool:
        """True if the worker died of a signal that :meth:`send` delivered while it was running.

        A worker that exited with its own status (an exit code, or a signal the
        agent did not send) ended on its own, even if the agent was stopping it
        at that moment: e.g. a rank that fails because its peer failed, at the
        same time as the agent stops the group.
        """
        code = self.popen.poll()
        return code is not None and code < 0 and -code in self._agent_signals

    @property
    def exited_at(self) -> float:
        """Monotonic time the worker closed its stderr (about when it exited), else when :meth:`poll` first saw
        it exited (a process it started may hold its stderr open), else +inf."""
        if self._stderr.eof_at is not None:
            return self._stderr.eof_at
        return self._seen_exit if self._seen_exit is not None else float("inf")

    @property
    def exited_wall_time(self) -> float | None:
        """:attr:`exited_at` as wall-clock time (seconds since the epoch), or ``None`` while running."""
        at = self.exited_at
        return None if at == float("inf") else time.time() - (time.monotonic() - at)

    def error(self, max_lines: int = 5) -> str:
        """The first lines of the worker's error.

        From ``TORCHELASTIC_ERROR_FILE`` if the worker wrote one (torch's ``@record``),
        otherwise from the end of its stderr. Waits up to 2 s for stderr to drain (not for it to close: a
        process the worker started may hold it open).
        """
        self._stderr.drain(2.0)
        message = _read_error_file(self.error_file)
        if message:
            return "\n".join(message.strip().splitlines()[:max_lines])
        return error_excerpt(self._stderr.tail(), max_lines)

    def send(self, sig: int) -> list[psutil.Process]:
        """Send ``sig`` to the worker's process group and to descendants outside it.

        Returns:
            The process tree found (leader first; the last one found if the
            worker already exited), for waiting on it.
        """
        targets: list[psutil.Process] = []
        if self.popen.poll() is None:  # not reaped yet, so the pid is still our worker's
            self._agent_signals.add(int(sig))
            try:
                leader = psutil.Process(self.pid)
                targets = [leader, *leader.children(recursive=True)]
            except psutil.Error:
                pass
        self._tree = targets or self._tree
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in self._tree[1:]:  # descendants that left the group (killpg missed them)
            try:
                if os.getpgid(proc.pid) != self.pid:
                    proc.send_signal(sig)
            except (OSError, psutil.Error):
                pass
        return list(self._tree)

    def close(self, timeout: float = 2.0) -> None:
        """Reap the process and wait up to ``timeout`` seconds each for its output pumps to drain (after it
        exited); a pump whose pipe another process still holds keeps copying in the background."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self._stderr.drain(timeout)
        if self._stdout is not None:
            self._stdout.drain(timeout)


def _read_error_file(path: str) -> str:
    """The message of a torchelastic error file (``{"message": {"message": ...}}``), or ``""``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return message if isinstance(message, str) else ""


def _group_alive(pgid: int) -> bool:
    """True if any process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_processes(workers: Sequence[WorkerProcess], sig: int = signal.SIGTERM, grace: float = 10.0,
                   reaper: NodeReaper | None = None) -> None:
    """Stop ``workers`` and their process trees: ``sig``, up to ``grace`` seconds, then SIGKILL.

    Safe for workers that already exited (what is left of their process group
    is stopped too). With ``reaper``, also every process the workers left
    behind (:meth:`~rdzv_agent.workers.reaper.NodeReaper.adopted`: those of earlier
    groups included), reaped afterwards. Waits until the workers, their process
    groups and their known descendants are gone, at most ``grace`` seconds
    before the SIGKILL; then reaps the workers and waits up to 5 s for their
    output pumps to drain.
    """
    descendants: list[psutil.Process] = []
    for w in workers:
        descendants += w.send(sig)[1:]
    pids = {w.pid for w in workers}
    adopted = reaper.adopted(pids) if reaper is not None else []
    for proc in adopted:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass
    if adopted:
        log.info("stopping %d processes the workers left behind: %s", len(adopted), sorted(p.pid for p in adopted))
    descendants += adopted
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if reaper is not None:  # what died after its worker is our zombie: it would keep the group "alive"
            reaper.reap(pids, force=True)
        if (
            all(w.poll() is not None for w in workers)
            and not any(alive(p) for p in descendants)
            and not any(_group_alive(w.pid) for w in workers)
        ):
            break
        time.sleep(0.05)
    for w in workers:  # whatever is left
        if w.poll() is None or _group_alive(w.pid):
            w.send(signal.SIGKILL)
    for p in descendants:
        try:
            p.kill()
        except psutil.Error:
            pass
    if reaper is not None:
        psutil.wait_procs(adopted, timeout=5.0)  # reaps our children; the others' zombies re-parent to us
        reaper.reap(pids, force=True)
    for w in workers:
        w.close(timeout=5.0)
