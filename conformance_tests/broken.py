"""Deliberately broken backends: the suite's own test fixtures (never registered by this project).

Each is :class:`~rdzv_backends.memory.MemoryBackend` with ONE contract of
:mod:`rdzv_core.kv` broken, under its own scheme. ``tests/project/test_conformance_catches_bugs.py``
registers :data:`plugin` through a throwaway distribution (an ``rdzv`` entry
point on ``PYTHONPATH``), runs the relevant conformance tests against each scheme
in a subprocess, and asserts they fail with a message naming that contract —
proof that the suite catches the bug, not just that correct backends pass.

=======================  ==================================================================
scheme                   the bug
=======================  ==================================================================
``broken-cas``           ``compare_and_swap`` ignores the expected revision (still ``KeyNotFoundError``
                         on an absent key)
``broken-ttl``           TTLs never expire (``ttl`` is dropped; ``refresh`` does nothing)
``broken-watch``         ``watch`` drops ``DELETE`` events
``broken-multiprocess``  declares ``multi_process=True`` and ``persistent=True`` but keeps its
                         keyspace in the process, like ``memory://``
=======================  ==================================================================

URL: ``SCHEME://NAME/RUN_ID`` (``NAME`` as for ``memory://``).
"""

from __future__ import annotations

import dataclasses

from rdzv_core.errors import KeyNotFoundError
from rdzv_core.kv import Entry, Event, EventType
from rdzv_core.plugins import BackendSpec, hookimpl
from rdzv_core.url import RendezvousURL
from rdzv_backends.memory import MemoryBackend

__all__ = ["CasIgnoresRevision", "TtlNeverExpires", "WatchDropsDeletes", "ClaimsMultiProcess", "BROKEN", "plugin"]


class CasIgnoresRevision(MemoryBackend):
    """``compare_and_swap`` writes whatever revision the caller expected."""

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        with self._ks.guard:
            if self._ks.live(key) is None:
                raise KeyNotFoundError(f"key {key!r} not found", key)
            return self._ks.write(key, value, ttl)  # BUG: no revision check


class TtlNeverExpires(MemoryBackend):
    """Every TTL is dropped: keys live until deleted."""

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return super()._do_create(key, value, None)  # BUG

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return super()._do_put(key, value, None)  # BUG

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        return super()._do_compare_and_swap(key, value, expected_revision, None)  # BUG

    def _do_refresh(self, key: str, ttl: float) -> None:
        with self._ks.guard:
            if self._ks.live(key) is None:
                raise KeyNotFoundError(f"key {key!r} not found", key)  # BUG: the TTL is not set


class WatchDropsDeletes(MemoryBackend):
    """``watch`` never returns ``DELETE`` events (deletes, compare-and-deletes, expiries)."""

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        return [e for e in super()._do_watch(prefix, after_revision, timeout) if e.type is not EventType.DELETE]


class ClaimsMultiProcess(MemoryBackend):
    """Declares ``multi_process`` and ``persistent``, yet its keyspace lives in the process."""

    capabilities = dataclasses.replace(MemoryBackend.capabilities, multi_process=True, persistent=True)


#: scheme -> broken backend class.
BROKEN: dict[str, type[MemoryBackend]] = {
    "broken-cas": CasIgnoresRevision,
    "broken-ttl": TtlNeverExpires,
    "broken-watch": WatchDropsDeletes,
    "broken-multiprocess": ClaimsMultiProcess,
}


def _opener(cls: type[MemoryBackend]):
    def open_(url: RendezvousURL) -> MemoryBackend:
        return cls(f"{url.scheme}:{url.hosts[0][0] if url.hosts else 'default'}")

    return open_


class plugin:  # noqa: N801 - entry-point object, named like a module attribute
    """Registers the broken schemes; only the throwaway distribution of the bug-catching test uses it."""

    @staticmethod
    @hookimpl
    def rdzv_register_backends() -> list[BackendSpec]:
        return [
            BackendSpec(schemes=(scheme,), open=_opener(cls), capabilities=cls.capabilities,
                        description=f"deliberately broken: {cls.__doc__}")
            for scheme, cls in BROKEN.items()
        ]
