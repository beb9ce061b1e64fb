"""Keep-alive: a daemon thread that refreshes one key's TTL until stopped.

Unlike the seed's ``setup_lease_renewal`` it does not die on an unexpected error:
transient backend errors are retried with a short jittered backoff (well within
TTL/3), anything else is logged and retried the same way; only a lapsed key
(``KeyNotFound``) or :meth:`KeepAlive.stop` ends it.
"""

from __future__ import annotations

import logging
import random
import threading

from .errors import BackendClosed, KeyNotFound
from .kv import KVBackend

__all__ = ["KeepAlive"]

log = logging.getLogger(__name__)


class KeepAlive:
    """Refresh ``key`` every ``ttl / 3`` seconds on a daemon thread.

    Args:
        kv: the backend.
        key: the key to keep alive (written with a TTL by the caller).
        ttl: the TTL in seconds to restart at every refresh.
        name: the thread name.

    Attributes:
        lapsed: ``threading.Event`` set if the key was found gone (expired or deleted).
    """

    def __init__(self, kv: KVBackend, key: str, ttl: float, name: str = "rdzv-keepalive") -> None:
        self.kv, self.key, self.ttl = kv, key, ttl
        self.lapsed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self.ttl / 3
        wait = interval
        while not self._stop.wait(wait):
            try:
                self.kv.refresh(self.key, self.ttl)
                wait = interval
            except KeyNotFound:
                log.warning("keep-alive key %s lapsed before it was refreshed", self.key)
                self.lapsed.set()
                return
            except BackendClosed:
                return
            except Exception as exc:  # keep trying until stopped; never die silently
                wait = random.uniform(0.25, 0.5) * interval
                log.warning("keep-alive refresh of %s failed (retrying in %.2f s): %s", self.key, wait, exc)

    def stop(self) -> None:
        """Stop refreshing (the key is left to the caller) and wait for the thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
