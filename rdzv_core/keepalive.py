"""Keep-alive: a daemon thread that refreshes one key's TTL until stopped.

Unlike the seed's ``setup_lease_renewal`` it does not die on an unexpected error:
transient backend errors are retried with a short jittered backoff (well within
TTL/3), anything else is logged and retried the same way. A key found gone (it
lapsed, e.g. while the server was paused for longer than the TTL) is recreated
with its value, so a member outlives a stall instead of vanishing for good; the
rendezvous then tells the agent if its round was destroyed meanwhile (see
``Rendezvous.num_nodes_waiting``). Only :meth:`KeepAlive.stop` or a closed
backend ends the thread.
"""

from __future__ import annotations

import logging
import random
import threading

from .errors import BackendClosed, KeyExists, KeyNotFound
from .kv import KVBackend

__all__ = ["KeepAlive"]

log = logging.getLogger(__name__)


class KeepAlive:
    """Refresh ``key`` every ``ttl / 3`` seconds on a daemon thread.

    Args:
        kv: the backend.
        key: the key to keep alive (written with a TTL by the caller).
        ttl: the TTL in seconds to restart at every refresh.
        value: the key's value (bytes), written again with ``create`` if the key
            is found gone; ``None`` to stop refreshing instead.
        name: the thread name.

    Attributes:
        lapsed: ``threading.Event`` set once the key was found gone (expired or deleted).
        recreated: how many times the key was written again after it lapsed (int).
    """

    def __init__(
        self, kv: KVBackend, key: str, ttl: float, value: bytes | None = None, name: str = "rdzv-keepalive"
    ) -> None:
        self.kv, self.key, self.ttl, self.value = kv, key, ttl, value
        self.lapsed = threading.Event()
        self.recreated = 0
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
                self.lapsed.set()
                if self.value is None:
                    log.warning("keep-alive key %s lapsed before it was refreshed", self.key)
                    return
                log.warning("keep-alive key %s lapsed before it was refreshed; writing it again", self.key)
                wait = self._recreate(interval)
            except BackendClosed:
                return
            except Exception as exc:  # keep trying until stopped; never die silently
                wait = random.uniform(0.25, 0.5) * interval
                log.warning("keep-alive refresh of %s failed (retrying in %.2f s): %s", self.key, wait, exc)

    def _recreate(self, interval: float) -> float:
        """Write the lapsed key again; return the wait before the next refresh (seconds)."""
        if self.value is None:
            return interval
        try:
            self.kv.create(self.key, self.value, ttl=self.ttl)
        except KeyExists:
            pass  # written again meanwhile (by a stop/start race): refresh it next time
        except BackendClosed:
            self._stop.set()
        except Exception as exc:  # as for a failed refresh: retry soon, never die silently
            log.warning("keep-alive key %s could not be written again (retrying): %s", self.key, exc)
            return random.uniform(0.25, 0.5) * interval
        else:
            self.recreated += 1
        return interval

    def stop(self) -> None:
        """Stop refreshing (the key is left to the caller) and wait for the thread."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
