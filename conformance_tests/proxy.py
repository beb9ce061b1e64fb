"""A loopback TCP proxy for network-fault tests: pass, drop, black-hole or slow down traffic.

Put a :class:`TCPProxy` between clients and a real server (give the clients the
proxy's :attr:`~TCPProxy.address` instead of the server's) and switch its
:class:`Mode` while they work:

=========  ============================================================================
mode       what the clients see
=========  ============================================================================
pass       a normal connection: bytes are forwarded both ways as they come
drop       every open connection is reset (RST, ``SO_LINGER`` 0: "connection reset by
           peer"), and new ones are refused ("connection refused"): the listening socket
           stops listening but keeps its port, so the kernel refuses at once, however
           late this proxy's thread gets to run on a loaded machine
blackhole  connections stay open, new ones are accepted, but nothing is forwarded in
           either direction (a silent network partition). Bytes already read are held,
           not lost: back in ``pass``/``slow`` they flow on, as TCP retransmission would
           deliver them once a partition heals
slow       as ``pass``, each chunk delayed by ``delay`` seconds (per direction, in order)
=========  ============================================================================

:meth:`TCPProxy.set_mode` returns once the mode is in effect (for ``drop``: once
every connection was reset and the port refuses). The proxy runs an ``asyncio`` loop on one daemon
thread; every public method is thread-safe. Counters of forwarded chunks
(:meth:`TCPProxy.chunks`) let a test see traffic happen (e.g. a keep-alive's
refresh) without reaching into the client.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct
import threading
from typing import Any, Coroutine, TypeVar, cast

__all__ = ["Mode", "TCPProxy"]

T = TypeVar("T")

_CHUNK = 65536  #: bytes read at most per chunk
_CONTROL_TIMEOUT = 10.0  #: seconds a control call (start, set_mode, close) may take


class Mode(str, enum.Enum):
    """What the proxy does with traffic (see the module docstring)."""

    PASS = "pass"
    DROP = "drop"
    BLACKHOLE = "blackhole"
    SLOW = "slow"


class _Connection:
    """One proxied connection: the client's stream, the upstream's, and the task that serves them."""

    def __init__(self, client: asyncio.StreamWriter, task: asyncio.Task[Any]) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task = task

    def reset(self) -> None:
        """Reset both sides (RST, not FIN) and stop serving."""
        for writer in (self.client, self.upstream):
            if writer is not None:
                _reset(writer)
        self.task.cancel()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s socket with an RST: ``SO_LINGER`` on with a timeout of 0, then abort."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed
    writer.transport.abort()


class TCPProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``, with faults on demand.

    Args:
        upstream_host: the server's host (str).
        upstream_port: the server's TCP port (int).
        host: the address to listen on (default ``"127.0.0.1"``).
        port: the port to listen on; 0 (default) lets the OS pick a free one.

    Use as a context manager, or call :meth:`start` and :meth:`close`.

    Raises:
        OSError: from :meth:`start` if the port cannot be bound.
        ValueError: from :meth:`set_mode` for an unknown mode or a negative delay.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = port
        self._mode = Mode.PASS
        self._delay = 0.0
        self._counts = {"to_server": 0, "to_client": 0, "accepted": 0}
        self._changed = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None  # None while dropping
        self._holder: socket.socket | None = None  # keeps the port bound (not listening) while dropping
        self._connections: set[_Connection] = set()
        self._flowing = asyncio.Event()  # set while traffic flows (pass, slow); bound to the loop at first use
        self._flowing.set()

    # -- control (any thread) --------------------------------------------------------------
    @property
    def address(self) -> str:
        """``"HOST:PORT"`` the clients should connect to."""
        return f"{self.host}:{self.port}"

    @property
    def mode(self) -> Mode:
        """The current :class:`Mode`."""
        return self._mode

    def start(self) -> "TCPProxy":
        """Start listening (on a daemon thread); return ``self``."""
        if self._thread is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._thread.start()
        try:
            self._run(self._listen())
        except BaseException:
            self.close()
            raise
        return self

    def set_mode(self, mode: Mode | str, delay: float = 0.0) -> None:
        """Switch to ``mode``; return once it is in effect.

        Args:
            mode: a :class:`Mode` or its value (``"pass"``, ``"drop"``, ``"blackhole"``, ``"slow"``).
            delay: seconds each chunk is held in ``slow`` mode (float >= 0); ignored otherwise.
        """
        mode = Mode(mode)
        if not delay >= 0:
            raise ValueError(f"invalid value for 'delay': {delay!r}: must be a number of seconds >= 0")
        self._run(self._apply(mode, float(delay) if mode is Mode.SLOW else 0.0))

    def chunks(self, direction: str) -> int:
        """Chunks forwarded so far: ``direction`` is ``"to_server"``, ``"to_client"`` or ``"accepted"``
        (connections accepted)."""
        with self._changed:
            return self._counts[direction]

    def wait_for_chunks(self, direction: str, above: int, timeout: float) -> bool:
        """Block until :meth:`chunks` of ``direction`` exceeds ``above``; ``False`` after ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: self._counts[direction] > above, timeout)

    def close(self) -> None:
        """Reset every connection, stop listening and stop the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if thread.is_alive():
            try:
                self._run(self._shutdown())
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(_CONTROL_TIMEOUT)
        if not thread.is_alive():
            # A connection accepted during the shutdown (a client reconnecting) has a task still pending: end it
            # here, or its garbage collection logs "task destroyed but pending" with a traceback from any thread.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
        self._loop, self._thread = None, None

    def __enter__(self) -> "TCPProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TCPProxy({self.address} -> {self.upstream[0]}:{self.upstream[1]}, mode={self._mode.value})"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            raise RuntimeError(f"{self!r} is not started: call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CONTROL_TIMEOUT)

    # -- the loop's side ---------------------------------------------------------------------
    def _bound_socket(self) -> socket.socket:
        """A TCP socket bound to (host, port) with ``SO_REUSEADDR``: it can share the port with a
        bound socket that is not listening (the holder) and with connections accepted earlier."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def _listen(self) -> None:
        """Listen on (host, port) (port 0 at the first start: the OS picks one); then drop the holder."""
        sock = self._bound_socket()
        try:
            sock.listen(128)
            self._server = await asyncio.start_server(self._serve, sock=sock)
        except BaseException:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        if self._holder is not None:
            self._holder.close()
            self._holder = None

    def _refuse(self) -> None:
        """Stop listening, keeping the port: new connections are refused by the kernel at once.

        ``shutdown(SHUT_RD)`` of a listening socket ends the listen on Linux (connections still
        in its backlog are reset) and leaves it bound; a holder socket bound to the port (not
        listening) then keeps the port ours while the server closes that socket, so no other
        program takes it before :meth:`_listen` listens on it again.
        """
        if self._server is None:
            return
        for sock in self._server.sockets:
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass  # not listening any more
        self._holder = self._bound_socket()
        self._server.close()
        self._server = None

    async def _apply(self, mode: Mode, delay: float) -> None:
        self._mode, self._delay = mode, delay
        if mode in (Mode.PASS, Mode.SLOW):
            self._flowing.set()
        else:
            self._flowing.clear()
        if mode is Mode.DROP:
            self._refuse()
            for conn in list(self._connections):
                conn.reset()
            self._connections.clear()
        elif self._server is None:
            await self._listen()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        tasks = [conn.task for conn in self._connections]
        for conn in list(self._connections):
            conn.reset()
        self._connections.clear()
        if tasks:  # let them end before the loop stops (no "task destroyed but pending")
            await asyncio.wait(tasks, timeout=_CONTROL_TIMEOUT / 2)

    def _count(self, direction: str) -> None:
        with self._changed:
            self._counts[direction] += 1
            self._changed.notify_all()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one accepted connection until either side closes or the proxy resets it."""
        task = cast("asyncio.Task[Any]", asyncio.current_task())
        self._count("accepted")
        conn = _Connection(writer, task)
        if self._mode is Mode.DROP:  # accepted just before the listen ended
            _reset(writer)
            return
        self._connections.add(conn)
        pumps: list[asyncio.Task[None]] = []
        try:
            await self._flowing.wait()  # a black hole accepts, but does not even connect upstream
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            conn.upstream = up_writer
            pumps = [asyncio.create_task(self._pump(reader, up_writer, "to_server")),
                     asyncio.create_task(self._pump(up_reader, writer, "to_client"))]
            await asyncio.gather(*pumps)
        except OSError:
            pass  # one side went away (or the upstream refused): close both below
        except asyncio.CancelledError:
            pass  # reset by drop/close; ending normally keeps asyncio's stream callback from logging it
        finally:
            for pump in pumps:
                pump.cancel()
            self._connections.discard(conn)
            for w in (writer, conn.upstream):
                if w is not None:
                    w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Copy ``reader`` to ``writer`` chunk by chunk, holding chunks while the proxy is not flowing."""
        while True:
            await self._flowing.wait()
            data = await reader.read(_CHUNK)
            if not data:  # EOF: pass the half-close on
                if writer.can_write_eof():
                    writer.write_eof()
                return
            await self._flowing.wait()  # switched to blackhole while reading: hold the chunk
            if self._delay:
                await asyncio.sleep(self._delay)
                await self._flowing.wait()
            writer.write(data)
            await writer.drain()
            self._count(direction)
