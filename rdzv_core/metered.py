"""``MeteredKV``: any :class:`~rdzv_core.kv.KVBackend`, each call timed for :mod:`rdzv_core.observe`.

Backend-neutral: it wraps the public methods of the protocol, so every backend (plugins too) is
measured the same way. ``watch`` is timed as well; its time includes the wait for a change.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from . import observe
from .kv import Entry, Event, KVBackend

__all__ = ["MeteredKV"]

T = TypeVar("T")


class MeteredKV(KVBackend):
    """Delegates to ``inner`` (validated again there: cheap) and reports each call's time and error.

    Args:
        inner: the backend; closed by :meth:`close`.
    """

    def __init__(self, inner: KVBackend) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities

    def _timed(self, op: str, call: Callable[..., T], *args: Any) -> T:
        started = time.perf_counter()
        try:
            result = call(*args)
        except Exception as exc:
            observe.backend_request(op, time.perf_counter() - started, exc)
            raise
        observe.backend_request(op, time.perf_counter() - started, None)
        return result

    def _do_get(self, key: str) -> Entry | None:
        return self._timed("get", self.inner.get, key)

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        return self._timed("list", self.inner.list, prefix)

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._timed("create", self.inner.create, key, value, ttl)

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._timed("put", self.inner.put, key, value, ttl)

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        return self._timed("compare_and_swap", self.inner.compare_and_swap, key, value, expected_revision, ttl)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        self._timed("compare_and_delete", self.inner.compare_and_delete, key, expected_revision)

    def _do_delete(self, key: str) -> bool:
        return self._timed("delete", self.inner.delete, key)

    def _do_refresh(self, key: str, ttl: float) -> None:
        self._timed("refresh", self.inner.refresh, key, ttl)

    def _do_expire_tree(self, prefix: str, ttl: float) -> int:
        return self._timed("expire_tree", self.inner.expire_tree, prefix, ttl)

    def _do_add(self, key: str, delta: int) -> int:
        return self._timed("add", self.inner.add, key, delta)

    def _do_take_ticket(self, key: str) -> int:
        return self._timed("take_ticket", self.inner.take_ticket, key)

    def _do_tickets(self, key: str) -> int:
        return self._timed("tickets", self.inner.tickets, key)

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        return self._timed("watch", self.inner.watch, prefix, after_revision, timeout)

    def _do_ttl_remaining(self, key: str) -> float | None:
        return self._timed("ttl_remaining", self.inner.ttl_remaining, key)

    def _do_close(self) -> None:
        self.inner.close()
