"""A gate in front of real clients: the backend away from every node at once, for any backend.

:class:`Gate` closes and opens; :class:`GatedBackend` wraps a real client of any backend and,
while its gate is closed, holds each call for up to ``operation_timeout`` seconds and then raises
:class:`~rdzv_core.errors.BackendTimeoutError` -- what a paused or partitioned server looks like to
its clients -- or lets it through once the gate opens. A watch waits out its own timeout instead
and returns ``[]``, as on a quiet server. The backend itself keeps running meanwhile: its TTLs
run out as they would while its clients cannot reach it. Server-less backends (``memory://``,
``file://``) have no server to pause; the gate gives them the same outage as the others.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

from rdzv_core.errors import BackendTimeoutError
from rdzv_core.kv import Entry, Event, KVBackend

__all__ = ["Gate", "GatedBackend"]

T = TypeVar("T")


class Gate:
    """Open (calls pass) or closed (calls wait); starts open. Thread-safe."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the gate to be open: whether it is."""
        return self._open.wait(seconds)


class GatedBackend(KVBackend):
    """``inner`` (a real client, owned: closed with this one) behind ``gate``.

    Args:
        inner: the client.
        gate: the :class:`Gate`.
        operation_timeout: seconds a call waits at a closed gate before it raises ``BackendTimeoutError``.
    """

    def __init__(self, inner: KVBackend, gate: Gate, operation_timeout: float) -> None:
        self.inner, self.gate, self.operation_timeout = inner, gate, operation_timeout
        self.capabilities = inner.capabilities

    def __repr__(self) -> str:
        return f"GatedBackend({self.inner!r})"

    def _through(self, call: Callable[[], T]) -> T:
        if not self.gate.wait(self.operation_timeout):
            raise BackendTimeoutError(f"{self.inner!r}: no answer within {self.operation_timeout} s (gate closed)")
        return call()

    def _do_get(self, key: str) -> Entry | None:
        return self._through(lambda: self.inner.get(key))

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        return self._through(lambda: self.inner.list(prefix))

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._through(lambda: self.inner.create(key, value, ttl))

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._through(lambda: self.inner.put(key, value, ttl))

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        return self._through(lambda: self.inner.compare_and_swap(key, value, expected_revision, ttl))

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        self._through(lambda: self.inner.compare_and_delete(key, expected_revision))

    def _do_delete(self, key: str) -> bool:
        return self._through(lambda: self.inner.delete(key))

    def _do_refresh(self, key: str, ttl: float) -> None:
        self._through(lambda: self.inner.refresh(key, ttl))

    def _do_add(self, key: str, delta: int) -> int:
        return self._through(lambda: self.inner.add(key, delta))

    def _do_take_ticket(self, key: str) -> int:
        return self._through(lambda: self.inner.take_ticket(key))

    def _do_tickets(self, key: str) -> int:
        return self._through(lambda: self.inner.tickets(key))

    def _do_ttl_remaining(self, key: str) -> float | None:
        return self._through(lambda: self.inner.ttl_remaining(key))

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        started = time.monotonic()
        if not self.gate.wait(timeout):
            return []
        return self.inner.watch(prefix, after_revision, max(0.0, timeout - (time.monotonic() - started)))

    def _do_close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # backend extras (endpoints, ...) of the real client
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
