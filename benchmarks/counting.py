"""A ``KVBackend`` proxy that counts what the rendezvous asks of its backend.

Every public operation of the wrapped backend is counted once per call, by
*phase* (``round`` while ``next_round`` runs, ``bootstrap`` for the handler's
MASTER_ADDR exchange, ``keepalive`` for calls made on a keep-alive thread), and
so are the outcomes that mean "lost a race": ``CompareFailedError`` (compare-and-swap,
compare-and-delete), ``KeyExistsError`` (create) and ``KeyNotFoundError`` (compare-and-*,
refresh). The proxy forwards to the wrapped backend's *public* methods, so the
counts are exactly the calls the state machine makes — not estimates. What a
backend does underneath one call (etcd's ``add`` is a read/transaction loop) is
not visible here; :mod:`benchmarks.servers` reads the servers' own counters for that.

Many proxies may share one wrapped client (one connection per process, one
proxy per agent thread), so each agent has its own counts.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from rdzv_core.errors import CompareFailedError, KeyExistsError, KeyNotFoundError
from rdzv_core.kv import Entry, Event, KVBackend

__all__ = ["CountingKV", "READ_OPS", "WRITE_OPS", "KEEPALIVE_THREAD_PREFIX"]

#: Operations that only read (``watch`` is a read that may block).
READ_OPS = ("get", "list", "watch", "tickets")
#: Operations that write (every one of them advances etcd's/Redis's revision or a TTL).
WRITE_OPS = ("create", "put", "compare_and_swap", "compare_and_delete", "delete", "refresh", "add", "take_ticket")
#: Thread-name prefix of the keep-alive scheduler's refresh threads (:mod:`rdzv_core.rendezvous.keepalive`).
KEEPALIVE_THREAD_PREFIX = "rdzv-keepalive"


class CountingKV(KVBackend):
    """Count every call to ``inner`` (a :class:`KVBackend`), then forward it unchanged.

    Args:
        inner: the backend that does the work.
        owns_inner: close ``inner`` when this proxy is closed (``False`` for a
            client shared with other proxies).

    Attributes:
        phase: the phase calls of the *agent* thread are counted under
            (``"round"`` by default; the benchmark sets ``"bootstrap"`` once
            ``next_round`` returned). Calls from keep-alive threads always count
            under ``"keepalive"``.
        counts: ``Counter`` of ``(phase, op)`` -> calls, and
            ``(phase, "conflict:" + op)`` -> ``CompareFailedError``/``KeyExistsError``
            outcomes, ``(phase, "not_found:" + op)`` -> ``KeyNotFoundError`` outcomes.
    """

    def __init__(self, inner: KVBackend, owns_inner: bool = False) -> None:
        self.inner = inner
        self.owns_inner = owns_inner
        self.capabilities = inner.capabilities
        self.phase = "round"
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CountingKV({self.inner!r})"

    def snapshot(self) -> dict[str, dict[str, int]]:
        """The counts so far as ``{phase: {op: n}}`` (a copy)."""
        with self._lock:
            items = list(self.counts.items())
        out: dict[str, dict[str, int]] = {}
        for (phase, op), n in items:
            out.setdefault(phase, {})[op] = n
        return out

    # -- counting --------------------------------------------------------------
    def _phase(self) -> str:
        name = threading.current_thread().name
        return "keepalive" if name.startswith(KEEPALIVE_THREAD_PREFIX) else self.phase

    def _count(self, op: str, outcome: str | None = None) -> str:
        phase = self._phase()
        with self._lock:
            self.counts[(phase, op)] += 1
            if outcome is not None:
                self.counts[(phase, f"{outcome}:{op}")] += 1
        return phase

    def _call(self, op: str, *args: Any) -> Any:
        phase = self._count(op)
        try:
            return getattr(self.inner, op)(*args)
        except (CompareFailedError, KeyExistsError):
            self._outcome(phase, op, "conflict")
            raise
        except KeyNotFoundError:
            self._outcome(phase, op, "not_found")
            raise

    def _outcome(self, phase: str, op: str, outcome: str) -> None:
        with self._lock:
            self.counts[(phase, f"{outcome}:{op}")] += 1

    # -- the protocol, forwarded ------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        return self._call("get", key)

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        return self._call("list", prefix)

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._call("create", key, value, ttl)

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._call("put", key, value, ttl)

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        return self._call("compare_and_swap", key, value, expected_revision, ttl)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        self._call("compare_and_delete", key, expected_revision)

    def _do_delete(self, key: str) -> bool:
        return self._call("delete", key)

    def _do_refresh(self, key: str, ttl: float) -> None:
        self._call("refresh", key, ttl)

    def _do_add(self, key: str, delta: int) -> int:
        return self._call("add", key, delta)

    def _do_take_ticket(self, key: str) -> int:
        return self._call("take_ticket", key)

    def _do_tickets(self, key: str) -> int:
        return self._call("tickets", key)

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        return self._call("watch", prefix, after_revision, timeout)

    def _do_close(self) -> None:
        if self.owns_inner:
            self.inner.close()
