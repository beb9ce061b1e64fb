"""Blocked ``watch`` calls indexed by prefix, shared by the memory and file backends.

A backend registers one :class:`Waiter` per blocked watch; an event on a key concerns exactly
the waiters registered under one of :func:`~rdzv_core.kv.watch_prefixes` of the key (a dict
lookup each), so an event costs O(key depth + matching waiters), not O(all waiters). The
registry holds no lock: its owner calls it under its own. (Redis groups its waiters per
subscribed channel instead, beside each channel's subscription state, and a message names
its channel: see :mod:`rdzv_backends.redis._listener`.)
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from rdzv_core.kv import Event, KVBackend, watch_prefixes

__all__ = ["Waiter", "WaiterRegistry"]


class Waiter:
    """One blocked watch of ``owner`` on ``prefix``; ``events`` are the events handed to it."""

    __slots__ = ("prefix", "owner", "events")

    def __init__(self, prefix: str, owner: KVBackend) -> None:
        self.prefix = prefix
        self.owner = owner
        self.events: list[Event] = []


W = TypeVar("W", bound=Waiter)


class WaiterRegistry(Generic[W]):
    """Waiters by prefix (not thread-safe: the owner's lock guards it); ``len()`` counts them."""

    __slots__ = ("_groups", "_count")

    def __init__(self) -> None:
        self._groups: dict[str, set[W]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[W]:
        """Every registered waiter (do not add or discard while iterating)."""
        for group in self._groups.values():
            yield from group

    def add(self, waiter: W) -> None:
        self._groups.setdefault(waiter.prefix, set()).add(waiter)
        self._count += 1

    def discard(self, waiter: W) -> bool:
        """Unregister ``waiter``; whether it was registered."""
        group = self._groups.get(waiter.prefix)
        if group is None or waiter not in group:
            return False
        group.discard(waiter)
        if not group:
            del self._groups[waiter.prefix]
        self._count -= 1
        return True

    def matching(self, key: str) -> Iterator[W]:
        """The waiters an event on ``key`` concerns (do not add or discard while iterating)."""
        for prefix in watch_prefixes(key):
            yield from self._groups.get(prefix, ())

    def pop_matching(self, key: str) -> Iterator[W]:
        """Unregister and yield the waiters an event on ``key`` concerns."""
        for prefix in watch_prefixes(key):
            group = self._groups.pop(prefix, None)
            if group is not None:
                self._count -= len(group)
                yield from group

    def first(self) -> W | None:
        """Some registered waiter, or ``None``."""
        return next(iter(self), None)

    def of_owner(self, owner: KVBackend) -> list[W]:
        """The waiters of ``owner`` (a backend being closed)."""
        return [waiter for waiter in self if waiter.owner is owner]
