"""The process's one asyncio event loop for gRPC streams (``grpc.aio``): watch and lease keep-alive streams.

gRPC's synchronous API gives every open stream a dispatcher thread that wakes every 0.1 s and a channel spin
thread that wakes every 0.2 s, each for the GIL: 512 backend objects with one idle watch each cost 0.41 cores
and 2,055 threads; the same streams on ``grpc.aio`` cost 0.00 cores and 9 threads (docs/backends/etcd-v3.md,
"Streams"). Each backend object keeps channels of its own (:class:`AioEndpoint`); only the loop is shared.
Unary RPCs stay synchronous, on the caller's thread. A forked child starts a loop of its own when it needs one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from rdzv_core.forksafe import PerProcess

from .client import etcdrpc, grpc

__all__ = ["AioEndpoint", "LOOP_THREAD", "StreamError", "loop", "requests_from", "run"]

T = TypeVar("T")

#: Name of the thread that runs the process's stream loop.
LOOP_THREAD = "rdzv-etcd-v3-streams"


def _start_loop() -> asyncio.AbstractEventLoop:
    new = asyncio.new_event_loop()
    threading.Thread(target=new.run_forever, name=LOOP_THREAD, daemon=True).start()
    return new


#: The process's stream loop; a forked child starts its own (the parent's loop thread is gone).
_LOOP: PerProcess[asyncio.AbstractEventLoop] = PerProcess(_start_loop)


class StreamError(Exception):
    """A failed stream as one waiting call sees it; read like ``grpc.RpcError`` by ``Transport.call``."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> Any:
        return self._code

    def details(self) -> str:
        return self._details


def loop() -> asyncio.AbstractEventLoop:
    """The process's stream loop, started on a daemon thread (:data:`LOOP_THREAD`) at the first call."""
    return _LOOP.get()


def run(make: Callable[[], Awaitable[T]], timeout: float) -> T:
    """Run the coroutine ``make()`` on the stream loop and wait for its result, at most ``timeout`` seconds.

    Raises:
        StreamError: ``DEADLINE_EXCEEDED`` if no result came in time (the coroutine is cancelled);
            what the coroutine raised otherwise (``grpc.aio.AioRpcError`` is a ``grpc.RpcError``).
    """
    async def wrapped() -> T:
        return await make()

    future = asyncio.run_coroutine_threadsafe(wrapped(), loop())
    try:
        return future.result(max(timeout, 0.0))
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded on the stream loop") from None


async def requests_from(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """A stream's requests: what ``queue`` yields (on the loop) until ``None``, which ends the stream's writes."""
    while True:
        request = await queue.get()
        if request is None:
            return
        yield request


class AioEndpoint:
    """One endpoint's ``grpc.aio`` channel and the stubs the streams use; made and closed on the stream loop.

    Args:
        target: ``HOST:PORT``.
        credentials: ``grpc.ssl_channel_credentials(...)``, or ``None`` for a plain channel.
        options: gRPC channel options (as the endpoint's synchronous channel's).
    """

    def __init__(self, target: str, credentials: Any, options: tuple[tuple[str, Any], ...]) -> None:
        async def make() -> Any:
            if credentials is not None:
                channel = grpc.aio.secure_channel(target, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(target, options=options)
            channel.get_state(try_to_connect=True)  # connect now, not at the first stream
            return channel

        self.channel = run(make, 10.0)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)

    def close(self) -> None:
        """Close the channel (its streams fail with ``CANCELLED``); waits at most 1 s."""
        try:
            run(lambda: self.channel.close(), 1.0)
        except (StreamError, RuntimeError):
            pass  # the loop is gone (interpreter exit) or busy: the channel dies with the process


