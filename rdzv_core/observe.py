"""Process-wide observers of backend requests and keep-alive refreshes, for metrics (none by default).

An observer (e.g. ``rdzv-run --metrics-port``'s, :mod:`rdzv_agent.reporting.prometheus_metrics`) is added with
:func:`add`; handlers created while one is added time their backend's requests
(:class:`~rdzv_core.metered.MeteredKV`), and every :class:`~rdzv_core.rendezvous.keepalive.KeepAlive` reports
its refreshes. Observers are called on the calling thread; what they raise is logged and ignored.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

__all__ = ["Observer", "add", "remove", "active", "backend_request", "keepalive_refresh", "keepalive_lapse"]

log = logging.getLogger(__name__)


class Observer(Protocol):
    def backend_request(self, op: str, seconds: float, error: BaseException | None) -> None:
        """One call of a backend's ``op`` (``get``, ``put``, ``watch``, ...) took ``seconds``; ``error``: what it
        raised (``None``: it returned)."""

    def keepalive_refresh(self, seconds: float, error: BaseException | None) -> None:
        """One keep-alive refresh took ``seconds``; ``error``: why it failed (``None``: it worked)."""

    def keepalive_lapse(self) -> None:
        """A keep-alive key was found gone (expired or deleted) at its refresh."""


_lock = threading.Lock()
_observers: tuple[Observer, ...] = ()


def add(observer: Observer) -> None:
    global _observers
    with _lock:
        _observers = (*_observers, observer)


def remove(observer: Observer) -> None:
    global _observers
    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)


def active() -> bool:
    """Whether an observer is added."""
    return bool(_observers)


def _each(method: str, *args: object) -> None:
    for observer in _observers:
        try:
            getattr(observer, method)(*args)
        except Exception:  # an observer's bug must not break the rendezvous
            log.exception("rdzv observer %r failed in %s", observer, method)


def backend_request(op: str, seconds: float, error: BaseException | None = None) -> None:
    if _observers:
        _each("backend_request", op, seconds, error)


def keepalive_refresh(seconds: float, error: BaseException | None = None) -> None:
    if _observers:
        _each("keepalive_refresh", seconds, error)


def keepalive_lapse() -> None:
    if _observers:
        _each("keepalive_lapse")
