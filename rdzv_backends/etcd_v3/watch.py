"""The multiplexed etcd v3 watch stream: one gRPC ``Watch`` stream per endpoint for every caller.

:class:`WatchStream` holds the stream (a ``grpc.aio`` call on the process's stream loop, :mod:`.streams`)
and the per-call subscribers; calls of one key range and revision share one server watch
(``docs/backends/etcd-v3.md``, "Watch").
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Callable

from rdzv_core.errors import HistoryCompactedError, KVError
from rdzv_core.kv import Event

from . import streams
from .client import etcdrpc, grpc
from .keys import watch_event
from .streams import StreamError

__all__ = ["StreamError", "WatchStream"]


class _Subscriber:
    """One waiting ``watch`` call, woken by the dispatcher with its events or an error."""

    __slots__ = ("watch", "woken", "events", "error")

    def __init__(self, watch: _ServerWatch) -> None:
        self.watch = watch
        self.woken = threading.Event()
        self.events: list[Event] = []
        self.error: BaseException | None = None


class _ServerWatch:
    """One watch on the server (one ``WatchCreateRequest``); every call of its range and revision shares it."""

    __slots__ = ("key", "watch_id", "subscribers", "done")

    def __init__(self, key: tuple[bytes, bytes, int]) -> None:
        self.key = key  # (start, end, after_revision)
        self.watch_id: int | None = None  # known once etcd answered ``created``
        self.subscribers: set[_Subscriber] = set()
        self.done = False  # delivered, failed or given up: it takes no new subscribers


class WatchStream:
    """ONE bidirectional gRPC ``Watch`` stream on an endpoint, carrying the watches of all its callers.

    etcd answers each ``WatchCreateRequest`` on a stream with a ``created`` response carrying the watch's ID,
    in request order (``api/etcdserverpb/rpc.proto``, ``Watch``), so pending creates are matched first in,
    first out; events and cancellations carry the ID. Calls of one key range and ``after_revision`` share one
    server watch while it has delivered nothing; a daemon thread reads the responses and wakes the callers
    (:class:`_Subscriber`); a watch nobody waits on is cancelled on the server. When the stream fails, every
    caller on it is woken with a :class:`StreamError` and retries on a new stream. State is guarded by ``lock``;
    the stream's reads and writes run on the stream loop, the callers wait on their own threads.

    Args:
        stub: an ``etcdrpc.WatchStub`` on the endpoint's ``grpc.aio`` channel.
        target: the endpoint (``HOST:PORT``), for messages and the thread's name.
        metadata: gRPC metadata (the auth token) the stream is opened with.
    """

    def __init__(self, stub: Any, target: str, metadata: Any) -> None:
        self.target = target
        self.metadata = metadata
        self.lock = threading.Lock()
        self.failure: StreamError | None = None  # set once the stream ended
        self.retired = False  # takes no new watches; ended once idle
        self._loop = streams.loop()
        self._requests: asyncio.Queue[Any] = asyncio.Queue()  # used on the loop only (_send); None ends it
        self._call: Any = None  # the grpc.aio call, once the loop opened it
        self._cancelled = False  # the stream is to end (set on the loop)
        self._pending: collections.deque[_ServerWatch] = collections.deque()  # creates not yet answered
        self._active: dict[int, _ServerWatch] = {}  # watch ID -> watch
        self._shared: dict[tuple[bytes, bytes, int], _ServerWatch] = {}  # watches that take subscribers
        asyncio.run_coroutine_threadsafe(self._dispatch(stub), self._loop)

    # -- the callers' side (any thread) ------------------------------------------------------
    def subscribe(self, start: bytes, end: bytes, after: int) -> _Subscriber | None:
        """Wait for the events after revision ``after`` in ``[start, end)``; ``None`` if the stream takes no more."""
        key = (start, end, after)
        with self.lock:
            if self.failure is not None or self.retired:
                return None
            watch = self._shared.get(key)
            if watch is None:
                watch = self._shared[key] = _ServerWatch(key)
                self._pending.append(watch)  # in the order of the requests: etcd answers creates in order
                create = etcdrpc.WatchCreateRequest(key=start, range_end=end, start_revision=after + 1)
                self._send(etcdrpc.WatchRequest(create_request=create))
            sub = _Subscriber(watch)
            watch.subscribers.add(sub)
            return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        """``sub``'s call returns: cancel its server watch if no other call waits on it."""
        with self.lock:
            watch = sub.watch
            watch.subscribers.discard(sub)
            if not watch.subscribers and not watch.done:
                self._give_up(watch)
            self._end_if_idle()

    def retire(self) -> None:
        """Take no new watches; end the stream once its last watch is over."""
        with self.lock:
            self.retired = True
            self._end_if_idle()

    # -- the stream loop's side -------------------------------------------------------------
    async def _dispatch(self, stub: Any) -> None:
        try:
            self._call = stub.Watch(streams.requests_from(self._requests), metadata=self.metadata)
            if self._cancelled:
                self._call.cancel()
            async for answer in self._call:
                with self.lock:
                    self._route(answer)
            failure = StreamError(grpc.StatusCode.UNAVAILABLE, f"etcd at {self.target} ended the watch stream")
        except grpc.RpcError as exc:  # grpc.aio.AioRpcError
            failure = StreamError(exc.code(), exc.details() or "")
        except asyncio.CancelledError:  # _end_if_idle, or the channel was closed
            failure = StreamError(grpc.StatusCode.CANCELLED, f"the watch stream to {self.target} was cancelled")
        except Exception as exc:  # noqa: BLE001 -- ends the stream; its callers must be woken, not left hanging
            failure = StreamError(grpc.StatusCode.UNKNOWN, f"watch stream failed: {exc!r}")
        with self.lock:
            self.failure = failure
            watches = [*self._pending, *self._active.values(), *self._shared.values()]
            self._pending.clear()
            self._active.clear()
            self._shared.clear()
            for watch in watches:
                self._wake(watch, lambda: StreamError(failure.code(), failure.details()))
        self._requests.put_nowait(None)  # ends the request stream
        if self._call is not None:
            self._call.cancel()

    def _cancel_call(self) -> None:
        """End the stream (on the loop): the dispatcher sees the cancellation and wakes nobody left."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def _route(self, answer: Any) -> None:
        """Hand one ``WatchResponse`` to the calls it concerns (``lock`` held)."""
        if answer.created:
            if not self._pending:
                return  # not ours: every create we send is pending until answered
            watch = self._pending.popleft()
            if answer.canceled or answer.compact_revision:  # refused at once (no watch on the server)
                self._wake(watch, self._refusal(answer, watch))
                return
            watch.watch_id = int(answer.watch_id)
            if watch.done:  # every caller gave up before the answer
                self._cancel(watch.watch_id)
            else:
                self._active[watch.watch_id] = watch
            return
        found = self._active.get(int(answer.watch_id))
        if found is None:
            return  # a watch we cancelled, or a progress notification
        if answer.canceled or answer.compact_revision:
            del self._active[int(answer.watch_id)]
            self._wake(found, self._refusal(answer, found))
            return
        after = found.key[2]
        events = [e for ev in answer.events if ev.kv.mod_revision > after and (e := watch_event(ev)) is not None]
        if events:
            for sub in found.subscribers:
                sub.events = list(events)
            self._give_up(found)
            self._wake(found, None)

    def _refusal(self, answer: Any, watch: _ServerWatch) -> Callable[[], BaseException]:
        """The error for a watch etcd cancelled (a new one per caller, as each raises its own)."""
        prefix = watch.key[0].decode("utf-8", "replace")[1:]
        if answer.compact_revision:
            return lambda: HistoryCompactedError(
                f"etcd compacted its history up to revision {answer.compact_revision}; events after "
                f"{watch.key[2]} are gone: re-read and watch from the revision read", prefix,
            )
        reason = answer.cancel_reason
        if "auth token" in reason or "Unauthenticated" in reason:
            self.retired = True  # a new stream carries the renewed token
            return lambda: StreamError(grpc.StatusCode.UNAUTHENTICATED, reason)
        return lambda: KVError(f"etcd at {self.target} cancelled the watch of {prefix!r}: {reason}")

    # -- helpers (``lock`` held) -------------------------------------------------------------
    def _wake(self, watch: _ServerWatch, error: Callable[[], BaseException] | None) -> None:
        watch.done = True
        if self._shared.get(watch.key) is watch:
            del self._shared[watch.key]
        for sub in watch.subscribers:
            if error is not None:
                sub.error = error()
            sub.woken.set()

    def _give_up(self, watch: _ServerWatch) -> None:
        """No call waits for (more of) ``watch``: cancel it on the server (once created)."""
        watch.done = True
        if self._shared.get(watch.key) is watch:
            del self._shared[watch.key]
        if watch.watch_id is not None and self._active.pop(watch.watch_id, None) is not None:
            self._cancel(watch.watch_id)

    def _send(self, request: Any) -> None:
        """Queue ``request`` on the stream (from any thread, the loop's too)."""
        self._loop.call_soon_threadsafe(self._requests.put_nowait, request)

    def _cancel(self, watch_id: int) -> None:
        if self.failure is None:
            self._send(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))

    def _end_if_idle(self) -> None:
        if self.retired and self.failure is None and not self._active and not self._pending:
            self._loop.call_soon_threadsafe(self._cancel_call)
