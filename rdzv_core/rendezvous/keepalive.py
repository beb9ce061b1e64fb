"""Keep-alive: refresh keys' TTLs from one scheduler per process until stopped.

Every :class:`KeepAlive` of a process is driven by one daemon thread holding a heap of due
refreshes, which hands each to a thread pool of at most :data:`REFRESH_WORKERS` threads; a
refresh that blocks holds one pool thread, not the scheduler, and each key has at most one
refresh in flight. Errors are retried with a jittered backoff; a key found gone is written
again. Only :meth:`KeepAlive.stop` or a closed backend ends a key's refreshing. After
``fork()`` the child starts with no scheduler; keep-alives made in the parent are not
refreshed there. Why, and the pool's size: ``docs/design.md`` ("Keep-alive").
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .. import observe
from ..backoff import Backoff
from ..errors import BackendClosedError, ConfigError, KeyExistsError, KeyNotFoundError
from ..forksafe import PerProcess
from ..kv import KVBackend
from ..outage import OutageLog, Responsiveness

__all__ = ["KeepAlive", "REFRESH_WORKERS", "STOP_WAIT"]

log = logging.getLogger(__name__)

#: Most refreshes run at once per process (threads of the refresh pool, started only when none is
#: idle; ``docs/design.md`` gives the load that sized it). It also bounds the threads held by
#: refreshes blocked on a silent server (each up to its backend's ``operation_timeout``).
REFRESH_WORKERS = 1024
#: Seconds :meth:`KeepAlive.stop` waits for an in-flight refresh of its key to return.
STOP_WAIT = 5.0
#: Thread-name prefix of the scheduler and refresh threads (``benchmarks.counting`` counts
#: calls made on such threads as keep-alive traffic).
THREAD_PREFIX = "rdzv-keepalive"


class KeepAlive:
    """Refresh ``key`` every ``ttl / 3`` seconds on the process's keep-alive scheduler.

    The first refresh is ``ttl / 3`` seconds after construction; each next one
    ``ttl / 3`` seconds after the previous returned. A refresh that fails with
    anything but :class:`~rdzv_core.errors.KeyNotFoundError` or
    :class:`~rdzv_core.errors.BackendClosedError` is logged (WARNING) and retried after
    ``0 .. 0.5 * ttl / 3`` seconds (full jitter, :class:`~rdzv_core.backoff.Backoff`).
    ``KeyNotFoundError``: ``lapsed`` is set and the key is written again with
    ``kv.create(key, value, ttl)`` (or, with ``value`` ``None``, refreshing ends).
    ``BackendClosedError`` ends refreshing.

    Args:
        kv: the backend.
        key: the key to keep alive (written with a TTL by the caller).
        ttl: the TTL in seconds to restart at every refresh (> 0).
        value: the key's value (bytes), written again with ``create`` if the key
            is found gone; ``None`` to stop refreshing instead.
        name: a label for logs and ``repr``.
        on_refresh: called after each refresh on the refresh's thread, with ``None`` when it worked or the
            exception when it failed (inside the ``except``: ``traceback.format_exc()`` shows it); what it
            raises is logged and ignored.
        on_lapse: called on the refresh's thread each time the key is found gone, before it is written
            again; what it raises is logged and ignored.

    Attributes:
        lapsed: ``threading.Event`` set once the key was found gone (expired or deleted).
        recreated: how many times the key was written again after it lapsed (int).
        responsiveness: :class:`~rdzv_core.outage.Responsiveness` of the refreshes: since when they
            answered on time (a refresh slower than ``ttl / 3``, a failure, or a refresh started -- or
            still not started -- more than ``2 ttl / 3`` after the previous one restarts it).

    Raises:
        ConfigError: ``ttl`` is not a positive number.
    """

    def __init__(
        self, kv: KVBackend, key: str, ttl: float, value: bytes | None = None, name: str = "rdzv-keepalive",
        on_refresh: Callable[[BaseException | None], object] | None = None,
        on_lapse: Callable[[], object] | None = None,
    ) -> None:
        if not ttl > 0:
            raise ConfigError("ttl", ttl, "a keep-alive TTL must be a positive number of seconds")
        self.kv, self.key, self.ttl, self.value, self.name = kv, key, ttl, value, name
        self.interval = ttl / 3  #: seconds between refreshes
        self._retry = Backoff(base=self.interval / 2, cap=self.interval / 2)  # a failed refresh or write: retry
        self.on_refresh = on_refresh
        self.on_lapse = on_lapse
        self.lapsed = threading.Event()
        self.recreated = 0
        self._outage = OutageLog(log.log)  # one WARNING per streak of failed refreshes
        self.responsiveness = Responsiveness(slow=self.interval, max_gap=2 * self.interval)
        self._lock = threading.Lock()
        self._stopped = False  # stop() was called
        self._ended = False  # no more refreshes: stopped, backend closed, or lapsed without a value
        self._idle = threading.Event()  # no refresh of this key in flight
        self._idle.set()
        self._worker: threading.Thread | None = None  # the pool thread running this key's refresh
        self._scheduler = _SCHEDULER.get()  # the one of the process this key is refreshed in
        self._scheduler.add(self, time.monotonic() + self.interval)

    def __repr__(self) -> str:
        return f"KeepAlive({self.name!r}, key={self.key!r}, ttl={self.ttl}, alive={self.is_alive()})"

    def is_alive(self) -> bool:
        """Whether the key is still being refreshed (not stopped, backend not closed) in this process."""
        return not self._ended and self._here()

    def _here(self) -> bool:
        """Whether this process is the one the key was made in (not a forked child)."""
        return _SCHEDULER.current() is self._scheduler

    def stop(self) -> None:
        """Stop refreshing (the key is left to the caller).

        Waits up to :data:`STOP_WAIT` seconds for an in-flight refresh of this key
        to return, so no refresh of it starts or runs after ``stop`` returned
        (unless that refresh is blocked longer). Safe to call more than once, and
        from a refresh thread (then it does not wait for itself). The key's heap
        entry is dropped unrefreshed when it comes due.
        """
        with self._lock:
            self._stopped = self._ended = True
        self.responsiveness.idle()
        if self._here() and self._worker is not threading.current_thread():
            if not self._idle.wait(STOP_WAIT):
                log.warning("keep-alive %s: a refresh of %s still runs %.0f s after stop()",
                            self.name, self.key, STOP_WAIT)

    # -- on the scheduler and its pool -------------------------------------------------------
    def _claim(self) -> bool:
        """Mark a refresh in flight (scheduler thread); ``False`` if the key has ended."""
        with self._lock:
            if self._ended:
                return False
            self._idle.clear()
            return True

    def _release(self, wait: float | None) -> None:
        """The refresh returned: schedule the next one ``wait`` seconds from now (``None``: end)."""
        with self._lock:
            if wait is None:
                self._ended = True
                self.responsiveness.idle()
            elif not self._ended:
                self._scheduler.add(self, time.monotonic() + wait)
            self._idle.set()

    def _tick(self) -> None:
        """One refresh of the key, run on a pool thread; then the next one is scheduled."""
        self._worker = threading.current_thread()
        wait: float | None = None
        try:
            if not self._ended:  # stopped while queued for a pool thread: no refresh after stop()
                wait = self._refresh()
        except BaseException:  # a bug here must not silently end the key's refreshing
            log.exception("keep-alive %s of %s failed unexpectedly; refreshing it ends", self.name, self.key)
            wait = None
        finally:
            self._worker = None
            self._release(wait)

    def _refresh(self) -> float | None:
        """Refresh the key once; return the wait before the next refresh (seconds), ``None`` to end."""
        started = self.responsiveness.begin()
        try:
            self.kv.refresh(self.key, self.ttl)
            self.responsiveness.record(started, ended := time.monotonic(), ok=True)
            observe.keepalive_refresh(ended - started)
            self._outage.recovered("keep-alive refresh of %s works again", self.key)
            self._notify(None)
            return self.interval
        except KeyNotFoundError:
            self.responsiveness.record(started, time.monotonic(), ok=True)  # it answered: only a slow answer counts
            observe.keepalive_lapse()
            self.lapsed.set()
            self._call(self.on_lapse, "on_lapse")
            if self.value is None:
                log.warning("keep-alive key %s lapsed before it was refreshed", self.key)
                return None
            log.warning("keep-alive key %s lapsed before it was refreshed; writing it again", self.key)
            return self._recreate()
        except BackendClosedError:
            self.responsiveness.record(started, time.monotonic(), ok=False)
            return None
        except Exception as exc:  # keep trying until stopped; never end silently
            self.responsiveness.record(started, ended := time.monotonic(), ok=False)
            observe.keepalive_refresh(ended - started, exc)
            wait = self._retry.delay()
            # a server down for a minute is one WARNING line, not hundreds
            self._outage.failed("keep-alive refresh of %s failed (retrying at most %.1f s apart until it works): %s",
                                self.key, self._retry.cap, exc)
            self._notify(exc)
            return wait

    def _notify(self, error: BaseException | None) -> None:
        self._call(self.on_refresh, "on_refresh", error)

    def _call(self, callback: Callable[..., object] | None, what: str, *args: object) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # a listener's bug must not end the refreshing
            log.exception("keep-alive %s: the %s callback failed", self.name, what)

    def _recreate(self) -> float | None:
        """Write the lapsed key again; return the wait before the next refresh (seconds), ``None`` to end."""
        if self.value is None:
            return None
        try:
            self.kv.create(self.key, self.value, ttl=self.ttl)
        except KeyExistsError:
            pass  # written again meanwhile (by a stop/start race): refresh it next time
        except BackendClosedError:
            return None
        except Exception as exc:  # as for a failed refresh: retry soon, never end silently
            self.responsiveness.broken()
            wait = self._retry.delay()
            log.warning("keep-alive key %s could not be written again (retrying in %.2f s): %s", self.key, wait, exc)
            return wait
        else:
            self.recreated += 1
        return self.interval


class _Scheduler:
    """One per process: a heap of due refreshes, a daemon thread that pops them, a pool that runs them."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, KeepAlive]] = []
        self._seq = itertools.count()  # tie-breaker: KeepAlives do not compare
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=REFRESH_WORKERS, thread_name_prefix=THREAD_PREFIX)

    def add(self, ka: KeepAlive, due: float) -> None:
        """Refresh ``ka`` at ``due`` (``time.monotonic()`` seconds)."""
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), ka))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{THREAD_PREFIX}-scheduler", daemon=True)
                self._thread.start()
            if self._heap[0][2] is ka:  # a new earliest entry: the scheduler's wait is too long
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > (now := time.monotonic()):
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                due: list[KeepAlive] = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for ka in due:
                if not ka._claim():
                    continue  # stopped meanwhile: dropped
                try:
                    self._pool.submit(ka._tick)
                except RuntimeError:  # the interpreter is shutting down: no more refreshes
                    ka._release(None)


#: This process's scheduler, made on first use (a forked child makes its own: the parent's threads are gone).
_SCHEDULER: PerProcess[_Scheduler] = PerProcess(_Scheduler)
