"""Caller deadlines for backend calls: a thread's bound on every request a backend sends for it.

A caller with a tighter bound than the backends' ``operation_timeout`` (the c10d
Store: its timeout) wraps its calls in :func:`deadline`; a backend gives each
request :func:`call_budget` seconds. Part of the KV protocol (:mod:`rdzv_core.kv`
re-exports these names).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from .errors import BackendTimeoutError, InvalidArgumentError

__all__ = ["deadline", "call_budget", "budget_text", "check_timeout"]

_call_deadline = threading.local()  # .at: the calling thread's deadline (time.monotonic()), or absent


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Bound every backend call this thread makes inside the block to end within ``seconds`` from now.

    Backends that honour it (every built-in one) give each request ``call_budget(...)``
    seconds and raise :class:`~rdzv_core.errors.BackendTimeoutError` when the time is up.
    Nested blocks keep the earlier deadline; ``None`` adds no bound.

    Raises:
        InvalidArgumentError: ``seconds`` is not a number >= 0.
    """
    outer = getattr(_call_deadline, "at", None)
    at = None if seconds is None else time.monotonic() + check_timeout(seconds)
    if outer is not None and (at is None or outer < at):
        at = outer
    _call_deadline.at = at
    try:
        yield
    finally:
        _call_deadline.at = outer


def call_budget(operation_timeout: float) -> float:
    """Seconds a backend request started now may take: ``operation_timeout``, or less inside
    :func:`deadline` (the time left to the calling thread's deadline).

    Raises:
        BackendTimeoutError: that deadline has passed.
    """
    at: float | None = getattr(_call_deadline, "at", None)
    if at is None:
        return operation_timeout
    left = at - time.monotonic()
    if left <= 0:
        raise BackendTimeoutError("the caller's deadline passed before the request was sent", None)
    return min(operation_timeout, left)


def budget_text(operation_timeout: float) -> str:
    """For an error message: the time a request that just ran out had -- ``operation_timeout=10s``,
    or ``the caller's deadline`` when the calling thread's :func:`deadline` (nearly) passed."""
    at: float | None = getattr(_call_deadline, "at", None)
    if at is not None and time.monotonic() >= at - 0.05:
        return "the caller's deadline"
    return f"operation_timeout={operation_timeout:g}s"


def check_timeout(timeout: float) -> float:
    """``timeout`` as a float number of seconds >= 0 (deadlines, watch timeouts).

    Raises:
        InvalidArgumentError: on ``timeout``: not a number, NaN, or negative.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout or timeout < 0:
        raise InvalidArgumentError("timeout", timeout, "a timeout is a number of seconds >= 0")
    return float(timeout)
