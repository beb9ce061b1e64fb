"""Real servers for tests: start on a free loopback port, kill -9, restart, pause.

:class:`ServerProcess` is the controller the ``faults`` group drives; the
project's Redis and etcd controllers subclass it (``redis_server.py``,
``etcd_server.py``) and the fixtures ``rdzv_server_redis`` / ``rdzv_server_etcd``
below start one per test session. A third-party backend's author can subclass
it the same way and expose a ``rdzv_server_NAME`` fixture.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

import pytest

__all__ = ["ServerProcess", "Placement", "LOOPBACK", "free_port", "wait_for_port", "rdzv_server_redis",
           "rdzv_server_etcd", "rdzv_server_sentinel"]

T = TypeVar("T")


def _call_here(fn: Callable[[], T]) -> T:
    return fn()


@dataclass(frozen=True)
class Placement:
    """Where a server runs: the address it binds and how its command and checks reach that place.

    Attributes:
        bind_host: the address the server listens on (and clients use), e.g. ``"127.0.0.1"``.
        command_prefix: argv put before the server's command (e.g. ``ip netns exec NS ...`` to run
            it on a :class:`~conformance_tests.multihost.Host`); ``()`` runs it here.
        call: ``call(fn)`` runs ``fn()`` where ``bind_host`` is reachable and returns its result
            (the readiness checks go through it); the default calls ``fn`` in this thread.
    """

    bind_host: str = "127.0.0.1"
    command_prefix: tuple[str, ...] = ()
    call: Callable[[Callable[[], Any]], Any] = _call_here


#: The default placement: this machine's loopback interface.
LOOPBACK = Placement()


_issued: set[int] = set()
_issued_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it) and that this process
    has not handed out before: the OS may offer a just-released port again, and a cluster
    that needs several ports at once must not get one twice.

    Raises:
        OSError: no fresh port after 100 tries.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _issued_lock:
            if port not in _issued:
                _issued.add(port)
                return port
    raise OSError(f"no fresh free port on {host} after 100 tries")


def wait_for_port(host: str, port: int, deadline: float) -> bool:
    """Poll until ``host:port`` accepts a TCP connection or ``deadline`` (monotonic) passes."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class ServerProcess:
    """A server process on ``127.0.0.1:port`` (or a :class:`Placement`'s address) with its own data directory.

    Subclasses implement :meth:`command` (the argv) and may override
    :meth:`ready` (default: the port accepts connections). The port and data
    directory stay the same across :meth:`kill` / :meth:`start`, so a restart
    is the same server coming back.

    Args:
        placement: where the server runs (default :data:`LOOPBACK`: here, on ``127.0.0.1``).

    Attributes:
        host: the address it listens on (``placement.bind_host``).
        port: the TCP port (int).
        data_dir: a private temporary directory (str).
    """

    name = "server"
    start_timeout = 30.0

    def __init__(self, placement: Placement = LOOPBACK) -> None:
        self.placement = placement
        self.host = placement.bind_host
        self.port = free_port()  # a port free here is free in a fresh namespace too
        self.data_dir = tempfile.mkdtemp(prefix=f"rdzv-{self.name}-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.data_dir, "server.log")

    @property
    def address(self) -> str:
        """``"HOST:PORT"`` for URLs."""
        return f"{self.host}:{self.port}"

    def command(self) -> Sequence[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        return wait_for_port(self.host, self.port, time.monotonic() + 0.5)

    def start(self) -> None:
        """Start (or restart) the server and wait until it serves, or raise ``RuntimeError``."""
        if self.proc is not None and self.proc.poll() is None:
            return
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.placement.command_prefix, *self.command()], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.placement.call(self.ready):
                return
        raise RuntimeError(f"{self.name} did not start on {self.address}; log: {self.tail_log()}")

    def kill(self) -> None:
        """SIGKILL the server and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP the server and wait (at most 10 s) until every one of its threads has stopped.

        ``kill -STOP`` is asynchronous: until the kernel has stopped each thread, a
        multi-threaded server may still answer a request or two (seen with etcd on a
        loaded 2-core machine). Afterwards it keeps its sockets but answers nothing.
        """
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and not _all_threads_stopped(self.proc.pid):
                time.sleep(0.005)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server for good and remove its data directory."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def tail_log(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"


def _all_threads_stopped(pid: int) -> bool:
    """True if every thread of ``pid`` is in state ``T``/``t`` (stopped), per ``/proc``."""
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return True  # gone, or no /proc: nothing to wait for
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"T", b"t"):
            return False
    return True


def _session_server(cls: type[Any]) -> Iterator[Any]:
    server = cls()
    try:
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        server.stop()
        pytest.fail(f"could not start {cls.name}: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def rdzv_server_redis() -> Iterator[ServerProcess]:
    """A real ``redis-server`` for the session (``{server:redis}``)."""
    from .redis_server import RedisServer

    yield from _session_server(RedisServer)


@pytest.fixture(scope="session")
def rdzv_server_etcd() -> Iterator[ServerProcess]:
    """A real ``etcd`` (3.5, v2 API enabled) for the session (``{server:etcd}``)."""
    from .etcd_server import EtcdServer

    yield from _session_server(EtcdServer)


@pytest.fixture(scope="session")
def rdzv_server_sentinel() -> Iterator[Any]:
    """A Redis Sentinel group for the session (``{server:sentinel}``: the three sentinels; a master and
    a replica behind them): :class:`~conformance_tests.redis_sentinel.SentinelGroup`."""
    from .redis_sentinel import SentinelGroup

    yield from _session_server(SentinelGroup)
