"""The pub/sub listener of :mod:`rdzv_backends.redis`: how waiting watches are woken.

One :class:`_Notifier` per process and connection settings, shared and reference-counted by
the backends that use it: a thread with a connection of its own, subscribed to the channel of
each watched prefix, that wakes the :class:`_Waiter` objects of a channel whose revision a
message passes, and sweeps due TTL expiries while any watch waits. ``RedisBackend._do_watch``
drives it (``begin``, ``add``, ``covers``/``take_hint``, ``remove``); why no event is missed:
docs/backends/redis.md, "Watch" and "The listener".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import threading
import time
from typing import Any, cast

import redis

from rdzv_backends.redis._errors import _copy_error, _ErrorMap
from rdzv_backends.redis._lua import _INT64, _PRELUDE, _SWEEP, HISTORY_LIMIT
from rdzv_core.errors import BackendClosedError, BackendConnectionError, BackendTimeoutError, InvalidKeyError, RdzvError
from rdzv_core.forksafe import PerProcess
from rdzv_core.kv import Event, EventType, KVBackend, check_key

log = logging.getLogger(__name__)

#: Seconds the listener thread lives on without waiters (and a channel stays subscribed without).
_LISTENER_IDLE = 30.0
#: Revisions a channel remembers having announced (so a new watch need not scan the log for them).
_HEARD = 64


class _Waiter:
    """One watch call of ``owner``, waiting for an event under a prefix after ``after`` (set by the listener)."""

    __slots__ = ("owner", "channel", "after", "hint", "heard", "wake", "error")

    def __init__(self, owner: KVBackend, channel: _Channel, after: int) -> None:
        self.owner = owner
        self.channel = channel
        self.after = after
        self.hint: int | None = None  # the least revision > after heard since the watch last took it (0: unknown)
        # The events those messages carried (with their history's first revision), in order; None
        # when one carried only its revision.
        self.heard: list[tuple[int, Event]] | None = []
        self.wake = threading.Event()
        self.error: RdzvError | None = None


class _Channel:
    """One subscribed prefix: its waiters, when the subscription took effect, the last revision heard."""

    __slots__ = ("name", "waiters", "confirmed_at", "last_rev", "heard", "covered_from", "idle_since")

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.waiters: set[_Waiter] = set()
        self.confirmed_at: float | None = None  # time.monotonic() when the SUBSCRIBE reply was read
        self.last_rev = 0
        self.heard: collections.deque[int] = collections.deque(maxlen=_HEARD)  # the last revisions announced
        # Every event under the prefix after this revision has been announced (a poll that began after
        # the subscription took effect read the log to its end there); None: not known yet.
        self.covered_from: int | None = None
        self.idle_since = time.monotonic()


class _Notifiers:
    """This process's notifiers by key (:meth:`_Notifier.of`), and the lock guarding them and their user counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[tuple[Any, ...], _Notifier] = {}


#: A forked child starts with none: the parent's listener threads are gone, their sockets are the parent's.
_NOTIFIERS: PerProcess[_Notifiers] = PerProcess(_Notifiers)


class _Notifier:
    """The pub/sub listener of the ``RedisBackend`` objects of one process that share a
    server, database, user, TLS files, namespace and ``operation_timeout`` (:meth:`of`): a thread
    that wakes the waiters of a channel when a message passes their revision, and sweeps due TTL
    expiries while any waits (docs/backends/redis.md, "The listener"). Reference-counted by its
    backends; the last :meth:`release` ends it; the thread exits after :data:`_LISTENER_IDLE`
    seconds without waiters.
    """

    @classmethod
    def of(cls, key: tuple[Any, ...], errmap: _ErrorMap, index_keys: list[str], name: str,
           connection_args: tuple[type[Any], dict[str, Any]]) -> _Notifier:
        """The notifier of the backends of this process whose connection settings and namespace
        are ``key`` (a new one if there is none); counts the caller as a user.

        ``errmap`` maps the server's errors (and knows its prefix and ``operation_timeout``);
        ``index_keys`` are the namespace's bookkeeping keys (the scripts' KEYS); ``name`` names
        the backend in logs; ``connection_args`` is ``(connection class, its keyword arguments)``.
        """
        shared = _NOTIFIERS.get()
        with shared.lock:
            notifier = shared.by_key.get(key)
            if notifier is None:
                notifier = shared.by_key[key] = cls(key, errmap, index_keys, name, connection_args)
            notifier._users += 1
            return notifier

    def __init__(self, key: tuple[Any, ...], errmap: _ErrorMap, index_keys: list[str], name: str,
                 connection_args: tuple[type[Any], dict[str, Any]]) -> None:
        self._key = key
        self._users = 0  # backends that hold it (under its _Notifiers' lock)
        # What every user has in common (no reference to a backend: a forgotten one must stay collectable).
        self._errmap = errmap
        self._index_keys, self._prefix = index_keys, errmap.prefix
        self._name = name
        connection_class, connection_kwargs = connection_args
        self._client = redis.Redis(connection_pool=redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            max_connections=2, timeout=errmap.operation_timeout, connection_class=connection_class,
            **connection_kwargs))
        self._sweep_script = self._client.register_script(_PRELUDE + _SWEEP)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a subscription took effect, or the thread failed
        self._channels: dict[bytes, _Channel] = {}
        self._outbox: list[bytes] = []  # channels to SUBSCRIBE
        self._waiters = 0
        self._idle_since = time.monotonic()  # when the last waiter left
        self._need_sweep: float | None = None  # when NS#t said: a write set an earlier TTL deadline
        self._need_cover = False  # a channel's subscription took effect: sweep to learn its covered_from
        self._due_since: float | None = None  # when the NS#t subscription took effect
        self._sleep_until = 0.0  # when the thread wakes at the latest (time.monotonic())
        # (when it was learnt, the next TTL deadline or None for none) by a sweep after _due_since
        self._deadline: tuple[float, float | None] | None = None
        self._thread: threading.Thread | None = None
        self._wake_pair: tuple[socket.socket, socket.socket] | None = None
        self._closed = False
        self._watch = (errmap.prefix + "#w:").encode()
        self._due = (errmap.prefix + "#t").encode()

    def release(self, backend: KVBackend) -> None:
        """``backend`` is closed: its waits end now (they return ``[]``); the last user closes this."""
        with self._lock:
            for channel in self._channels.values():
                for waiter in channel.waiters:
                    if waiter.owner is backend:
                        waiter.wake.set()
            self._changed.notify_all()
        shared = _NOTIFIERS.get()
        with shared.lock:
            self._users -= 1
            last = self._users == 0
            if last and shared.by_key.get(self._key) is self:  # not so in a forked child: the parent's
                del shared.by_key[self._key]
        if last:
            self.close()

    # -- called by watches ---------------------------------------------------------------------
    def add(self, owner: KVBackend, prefix: str, after: int, polled_at: float, patience: float,
            next_deadline: float | None) -> _Waiter:
        """Register a waiter of ``owner`` for ``prefix``; its ``wake`` is already set when the watch
        must poll again.

        ``after`` and ``next_deadline`` (``time.monotonic()`` value, or ``None``: no TTLs) are
        what the poll sent at ``polled_at`` returned. Waits (at most ``operation_timeout``, or
        ``patience`` seconds, then asks for one more poll) for a new channel's subscription to
        take effect.

        Raises:
            BackendClosedError: ``owner`` was closed.
            BackendTimeoutError: the subscription did not take effect within ``operation_timeout``.
            BackendUnavailableError, KVError: the listener failed (mapped as every call's errors are).
        """
        with self._lock:
            channel = self._channel_locked(prefix)
            waiter = self._register_locked(owner, channel, after)
            if self._due_since is not None and self._due_since < polled_at and (
                    self._deadline is None or self._deadline[0] < polled_at):
                self._deadline = (polled_at, next_deadline)  # the poll swept: the listener need not
                if self._need_sweep is not None and self._need_sweep < polled_at:
                    self._need_sweep = None
            if self._deadline is not None and self._deadline[1] is not None and self._deadline[1] < self._sleep_until:
                self._start_locked()  # the thread sleeps too long now: a sweep is due sooner
            if channel.confirmed_at is None:
                limit = min(self._errmap.operation_timeout, patience)
                if not self._changed.wait_for(
                    lambda: channel.confirmed_at is not None or waiter.error is not None or owner._closed, limit
                ) and limit < patience:
                    self._remove_locked(waiter)
                    raise BackendTimeoutError(f"{self._errmap.where} did not confirm a "
                                         f"subscription within operation_timeout={limit}s", prefix)
            if channel.confirmed_at is None or channel.confirmed_at >= polled_at or channel.last_rev > after:
                # It may have missed an event: poll again, from `after` (hint 0: a message heard
                # before this waiter existed lies between `after` and any later hint).
                waiter.hint = 0
                waiter.wake.set()
        if waiter.error is not None or owner._closed:
            self.remove(waiter)
            if owner._closed:
                raise BackendClosedError("RedisBackend is closed", prefix)
            raise _copy_error(cast(RdzvError, waiter.error), prefix) from waiter.error
        return waiter

    def begin(self, owner: KVBackend, prefix: str, after: int) -> tuple[_Waiter | None, int | None]:
        """A watch of ``owner`` starts: subscribe to ``prefix``'s channel now (so that it may be in
        effect before the poll is sent, and :meth:`add` need not ask for a second one).

        Returns ``(None, after)`` (poll from ``after``, then :meth:`add`), or, when the channel has
        announced every event under the prefix after ``after``, a waiter registered at once and
        where to poll from: ``None`` if nothing was announced (no poll needed: wait), else just
        before the first revision announced.

        Raises:
            BackendClosedError: ``owner`` was closed.
        """
        with self._lock:
            channel = self._channel_locked(prefix)
            if owner._closed:
                raise BackendClosedError("RedisBackend is closed", prefix)
            covered_from = channel.covered_from
            # (From 0, an empty history: `after` may come from one the server lost; a poll tells.)
            if channel.confirmed_at is None or covered_from is None or after < covered_from or (
                    covered_from == 0 < after):
                return None, after
            heard = channel.heard
            first = next((rev for rev in heard if rev > after), None)
            if first is not None and len(heard) == heard.maxlen and heard[0] > after:
                first = after + 1  # older announcements were forgotten: scan from after
            waiter = self._register_locked(owner, channel, after)
        return waiter, None if first is None else first - 1

    def covers(self, waiter: _Waiter, polled_at: float, last: int) -> bool:
        """A poll that began at ``polled_at`` read the log to its end at ``last``: if the waiter's
        subscription took effect before, record that every event after ``last`` is announced; whether so."""
        channel = waiter.channel
        with self._lock:
            if not _before(channel.confirmed_at, polled_at):
                return False
            if channel.covered_from is None or last < channel.covered_from:
                channel.covered_from = last
            return True

    def _channel_locked(self, prefix: str) -> _Channel:
        if self._closed:
            raise BackendClosedError("RedisBackend is closed", prefix)
        name = self._watch + prefix.encode()
        channel = self._channels.get(name)
        if channel is None:
            channel = self._channels[name] = _Channel(name)
            self._outbox.append(name)
            self._start_locked()
        elif self._thread is None:
            self._start_locked()
        return channel

    def _register_locked(self, owner: KVBackend, channel: _Channel, after: int) -> _Waiter:
        waiter = _Waiter(owner, channel, after)
        channel.waiters.add(waiter)
        self._waiters += 1
        if self._waiters == 1:
            self._start_locked()  # the thread sweeps while someone waits
        return waiter

    def take_hint(self, waiter: _Waiter) -> tuple[int | None, list[tuple[int, Event]] | None]:
        """The least revision above ``waiter.after`` heard on its channel since the last call, if
        any, and the events heard since with their history's first revision (in order; ``None`` if
        a message carried only a revision)."""
        with self._lock:
            hint, waiter.hint = waiter.hint, None
            heard, waiter.heard = waiter.heard, []
        return hint, heard

    def remove(self, waiter: _Waiter) -> None:
        """Unregister ``waiter`` (idempotent)."""
        with self._lock:
            self._remove_locked(waiter)

    def _remove_locked(self, waiter: _Waiter) -> None:
        channel = waiter.channel
        if waiter in channel.waiters:
            channel.waiters.discard(waiter)
            self._waiters -= 1
            now = time.monotonic()
            if not channel.waiters:
                channel.idle_since = now
            if not self._waiters:
                self._idle_since = now

    def close(self) -> None:
        """End every wait now; the thread exits at once (it closes its own connection)."""
        with self._lock:
            self._closed = True
            for channel in self._channels.values():
                for waiter in channel.waiters:
                    waiter.wake.set()
            self._changed.notify_all()
            if self._thread is None and self._wake_pair is not None:
                for sock in self._wake_pair:
                    sock.close()
                self._wake_pair = None
        self._poke()
        self._client.connection_pool.disconnect(inuse_connections=True)  # ends a sweep in flight

    def _start_locked(self) -> None:
        """Start the thread, or poke it: it has something to send (or a sooner time to wake)."""
        if self._thread is not None:
            self._poke()
            return
        if self._wake_pair is None:
            self._wake_pair = socket.socketpair()
            for sock in self._wake_pair:
                sock.setblocking(False)
        self._idle_since = time.monotonic()  # a new thread lives _LISTENER_IDLE at least
        self._thread = threading.Thread(target=self._main, name=f"rdzv-redis-listener-{id(self):x}", daemon=True)
        self._thread.start()

    def _poke(self) -> None:
        pair = self._wake_pair
        if pair is not None:
            with contextlib.suppress(OSError):  # full (already poked) or closed
                pair[1].send(b"x")

    # -- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        conn = None
        try:
            pool = self._client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
            conn.connect()
            self._serve(conn)
        except Exception as exc:
            if not self._closed:
                mapped = exc if isinstance(exc, RdzvError) else self._errmap.map(exc, None)
                if mapped is None:  # a bug of ours or of redis-py: fail the waiters rather than hang them
                    log.warning("redis listener of %s failed", self._name, exc_info=True)
                    mapped = BackendConnectionError(f"the watch listener of {self._name} failed: {exc!r}")
                self._fail(mapped)
        finally:
            if conn is not None:
                conn.disconnect()
            self._client.connection_pool.disconnect()  # reconnects on demand; none held while idle
            with self._lock:
                if self._closed and self._wake_pair is not None:
                    for sock in self._wake_pair:
                        sock.close()
                    self._wake_pair = None

    def _sweep(self, started: float) -> float | None:
        """Record every due expiry (a sweep sent at ``started``); return when the next TTL deadline is
        due (``time.monotonic()`` value, ``None``: no key has a TTL). The revision it read covers every
        channel subscribed before: each later event under its prefix is announced."""
        ms, revision = self._sweep_script(keys=self._index_keys, args=[self._prefix, HISTORY_LIMIT])
        with self._lock:
            for channel in self._channels.values():
                if channel.covered_from is None and _before(channel.confirmed_at, started):
                    channel.covered_from = int(revision)
        return None if ms < 0 else time.monotonic() + ms / 1000

    def _serve(self, conn: Any) -> None:
        with selectors.DefaultSelector() as selector:  # epoll: select() fails for descriptors >= 1024
            pair = self._wake_pair
            if pair is None or conn._sock is None:  # redis-py keeps the socket in _sock
                raise redis.exceptions.ConnectionError("the listener's connection was closed")
            selector.register(conn._sock, selectors.EVENT_READ)
            selector.register(pair[0], selectors.EVENT_READ)
            self._loop(conn, selector, pair[0])

    def _loop(self, conn: Any, selector: selectors.BaseSelector, poked: socket.socket) -> None:
        timeout = self._errmap.operation_timeout
        heard = time.monotonic()  # when the server last said anything
        pinged: float | None = None
        conn.send_command("SUBSCRIBE", self._due)
        while True:
            now = time.monotonic()
            with self._lock:
                if self._closed:
                    return
                if self._waiters == 0 and now - self._idle_since > _LISTENER_IDLE:
                    self._thread = None
                    self._forget_locked()
                    return
                subscribe, self._outbox = self._outbox, []
                unsubscribe = [c.name for c in self._channels.values()
                               if not c.waiters and c.confirmed_at is not None and now - c.idle_since > _LISTENER_IDLE]
                for name in unsubscribe:
                    del self._channels[name]
                waiting = self._waiters > 0
                deadline = self._deadline
                next_sweep = deadline[1] if deadline is not None else None
                # Sweeps wait for the NS#t subscription, so that no earlier deadline goes unheard.
                sweep = self._need_cover or waiting and self._due_since is not None and (
                    deadline is None or self._need_sweep is not None or (next_sweep is not None and now >= next_sweep))
                if sweep:
                    self._need_cover = False
                    if waiting and self._due_since is not None:
                        self._need_sweep = None
            if unsubscribe:
                conn.send_command("UNSUBSCRIBE", *unsubscribe)
            if subscribe:
                conn.send_command("SUBSCRIBE", *subscribe)
            if sweep:
                next_sweep = self._sweep(now)
                with self._lock:
                    if _before(self._due_since, now) and (self._deadline is None or self._deadline[0] < now):
                        self._deadline = (now, next_sweep)
            if pinged is not None and now - pinged > timeout:
                raise redis.exceptions.TimeoutError(f"no answer to PING within {timeout}s")
            if pinged is None and waiting and now - heard > timeout / 2:
                conn.send_command("PING")
                pinged = now
            limits = [timeout / 2, _LISTENER_IDLE]
            if next_sweep is not None and waiting:
                limits.append(max(next_sweep - time.monotonic(), 0.001))
            with self._lock:
                # A waiter that comes while this thread sleeps pokes it if it must wake sooner.
                waiting = self._waiters > 0
                if waiting and self._deadline is not None and self._deadline[1] is not None:
                    limits.append(max(self._deadline[1] - time.monotonic(), 0.001))
                self._sleep_until = time.monotonic() + min(limits) if waiting else 0.0
            if self._readable(conn, selector, poked, max(0.0, min(limits))):
                while True:
                    self._handle(conn.read_response())
                    heard, pinged = time.monotonic(), None
                    if not conn.can_read(0):
                        break

    @staticmethod
    def _readable(conn: Any, selector: selectors.BaseSelector, poked: socket.socket, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the connection (or a poke); whether a message can be read."""
        if conn.can_read(0):  # buffered by the parser or TLS
            return True
        ready = {key.fileobj for key, _ in selector.select(timeout)}
        if poked in ready:
            with contextlib.suppress(OSError):
                while poked.recv(4096):
                    pass
        return len(ready - {poked}) > 0

    def _handle(self, message: Any) -> None:
        """Act on one pub/sub message."""
        kind, name = message[0], message[1]
        if kind == b"message" and name == self._due:
            with self._lock:
                self._need_sweep = time.monotonic()
        elif kind == b"message":
            rev, event = _parse_event(message[2], name[len(self._watch):])
            hint = rev
            if rev == 0:  # not ours: wake everyone (with no hint); they poll and find what is real
                rev = _INT64[1]
            with self._lock:
                channel = self._channels.get(name)
                if channel is not None:
                    channel.last_rev = max(channel.last_rev, rev)
                    if hint:
                        channel.heard.append(rev)
                    for waiter in channel.waiters:
                        if rev > waiter.after:
                            waiter.hint = hint if waiter.hint is None else min(waiter.hint, hint)
                            if waiter.heard is not None:
                                if event is None:
                                    waiter.heard = None
                                else:
                                    waiter.heard.append(event)
                            waiter.wake.set()
        elif kind == b"subscribe":
            with self._lock:
                channel = self._channels.get(name)
                if name == self._due:
                    self._due_since = time.monotonic()
                elif channel is not None and channel.confirmed_at is None:
                    channel.confirmed_at = time.monotonic()
                    self._need_cover = True  # a sweep now tells from which revision it announces all
                    self._changed.notify_all()

    def _forget_locked(self) -> None:
        self._channels.clear()
        self._outbox.clear()
        self._due_since = self._deadline = None
        self._changed.notify_all()

    def _fail(self, error: RdzvError) -> None:
        """The thread ends: every registered waiter gets ``error``; later watches start a new thread."""
        with self._lock:
            for channel in self._channels.values():
                for waiter in channel.waiters:
                    waiter.error = error
                    waiter.wake.set()
            self._thread = None
            self._forget_locked()


def _parse_event(data: bytes, prefix: bytes) -> tuple[int, tuple[int, Event] | None]:
    """A watch channel's message (see the ``notify`` function of :mod:`rdzv_backends.redis._lua`):
    ``(revision, (the first revision of its history, the event))``, or ``(revision, None)`` if it
    carries only the revision; ``(0, None)`` for one the scripts did not publish (or not about a
    key under ``prefix``)."""
    parts = data.split(b" ", 4)
    if not parts[0].isdigit():
        return 0, None
    rev = int(parts[0])
    if len(parts) == 1:
        return rev, None
    try:
        key = check_key(parts[3].decode("ascii")) if len(parts) >= 4 and parts[3].startswith(prefix) else None
    except (InvalidKeyError, UnicodeDecodeError):
        key = None
    if key is None or not parts[1].isdigit():
        return 0, None
    if parts[2] == b"p" and len(parts) == 5:
        return rev, (int(parts[1]), Event(EventType.PUT, key, rev, parts[4]))
    if parts[2] == b"d" and len(parts) == 4:
        return rev, (int(parts[1]), Event(EventType.DELETE, key, rev))
    return 0, None


def _before(moment: float | None, then: float) -> bool:
    """``moment`` (``time.monotonic()``, or ``None``: not yet) came before ``then``."""
    return moment is not None and moment < then
