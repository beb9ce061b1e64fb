"""Agent processes for the fault matrix: start ``agent.py``, drive it over stdin, read its JSON lines.

:class:`AgentProcess` wraps one ``agent.py`` subprocess (its own session, so a
signal reaches it alone). A reader thread timestamps every JSON line with
``time.monotonic()`` as it arrives; :meth:`AgentProcess.wait_for` waits on a
condition variable until a matching event arrives or a deadline passes (then
fails with the agent's output). :class:`AgentGroup` kills every agent it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.py")

__all__ = ["AGENT", "Event", "AgentProcess", "AgentGroup"]


@dataclass(frozen=True)
class Event:
    """One JSON line of an agent: ``at`` (monotonic seconds when read) and ``data`` (the object)."""

    at: float
    data: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.data.get("event"))


class AgentProcess:
    """One ``agent.py`` process.

    Args:
        name: label for messages.
        url: full rendezvous URL (run id and parameters in the query).
        stderr_path: file receiving the agent's stderr (its logs and tracebacks).
        block_at: the agent's ``--block-at`` phase, or ``None``.
    """

    def __init__(self, name: str, url: str, stderr_path: str, block_at: str | None = None) -> None:
        self.name = name
        self.stderr_path = stderr_path
        argv = [sys.executable, AGENT, url] + (["--block-at", block_at] if block_at else [])
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
            )
        self.events: list[Event] = []
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, name=f"agent-{name}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                data = json.loads(raw)
            except ValueError:
                data = {"event": "garbage", "line": raw.decode(errors="replace")}
            with self._cond:
                self.events.append(Event(time.monotonic(), data))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def send(self, command: str) -> None:
        """Write one command line (``round`` or ``exit``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> float:
        """Send ``sig``; return the monotonic time it was sent."""
        self.proc.send_signal(sig)
        return time.monotonic()

    @property
    def ended(self) -> bool:
        """The agent's output has ended (it exited or was killed)."""
        with self._cond:
            return self._eof

    def wait_for(self, kind: str, deadline: float, after: int = 0,
                 match: Callable[[dict[str, Any]], bool] | None = None,
                 give_up: Callable[[], bool] | None = None) -> tuple[int, Event]:
        """The first event of ``kind`` (and ``match``) at index >= ``after``: ``(index, event)``.

        ``give_up`` is asked every 0.2 s at most; when true, waiting stops (as at the deadline).

        Raises:
            AssertionError: none arrived by ``deadline`` (monotonic) or before ``give_up``, with
                the agent's output.
        """
        with self._cond:
            while True:
                for i in range(after, len(self.events)):
                    e = self.events[i]
                    if e.kind == kind and (match is None or match(e.data)):
                        return i, e
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._eof or (give_up is not None and give_up()):
                    break
                self._cond.wait(remaining if give_up is None else min(remaining, 0.2))
        raise AssertionError(f"agent {self.name}: no {kind!r} event in time\n{self.describe()}")

    def wait_exit(self, timeout: float) -> int:
        """The exit status; ``AssertionError`` (with the output) if it has not exited in time."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # the agent dumps its threads' stacks on stderr
            time.sleep(1.0)  # for the dump to reach stderr: diagnostics only, the test has failed already
            raise AssertionError(f"agent {self.name} did not exit within {timeout} s\n{self.describe()}") from None

    def describe(self) -> str:
        """The agent's events and the tail of its stderr, for failure messages."""
        with self._cond:
            lines = [f"  +{e.at:.3f} {json.dumps(e.data)}" for e in self.events]
        try:
            with open(self.stderr_path, encoding="utf-8", errors="replace") as f:
                err = f.read()[-8000:]
        except OSError:
            err = "(no stderr)"
        return f"--- {self.name} (pid {self.proc.pid}, exit {self.proc.poll()}) events ---\n" + "\n".join(lines) + \
            f"\n--- {self.name} stderr ---\n{err}"

    def kill(self) -> None:
        """SIGKILL the agent (if alive) and reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(5)  # it ends at end of output; then the pipes can be closed under nobody
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class AgentGroup:
    """Starts :class:`AgentProcess` es in ``workdir``; :meth:`kill_all` ends every one (test teardown)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.agents: list[AgentProcess] = []

    def start(self, name: str, url: str, block_at: str | None = None) -> AgentProcess:
        agent = AgentProcess(name, url, os.path.join(self.workdir, f"{name}.err"), block_at)
        self.agents.append(agent)
        return agent

    def describe(self) -> str:
        return "\n".join(a.describe() for a in self.agents)

    def kill_all(self) -> None:
        for agent in self.agents:
            agent.kill()
