"""What the ``protocol`` tests share: waits on a watch with deadlines, contract-naming ``raises`` and the time
bounds of a loaded 2-core machine. A module, not a test module: ``test_protocol.py`` and
``test_protocol_ttl_watch.py`` use it."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import pytest

from rdzv_core import Event, EventType, KVBackend

PUT, DELETE = EventType.PUT, EventType.DELETE
#: Slack (seconds) on top of ``ttl_resolution`` for a loaded 2-core machine.
MARGIN = 1.0
#: Upper bound (seconds) for anything that should happen "promptly".
PATIENCE = 15.0
#: A short TTL (seconds) for keys that must lapse during a test.
TTL = 0.4
#: Threads of the concurrency tests.
THREADS = 8


@contextlib.contextmanager
def raises(expected: type[BaseException], contract: str) -> Iterator[Any]:
    """``pytest.raises(expected)`` whose failure names the broken ``contract`` (str)."""
    try:
        with pytest.raises(expected) as info:
            yield info
        return
    except pytest.fail.Exception:  # pytest's "DID NOT RAISE"
        pass
    except Exception as other:
        raise AssertionError(f"{contract} (raised {type(other).__name__}: {other})") from other
    pytest.fail(f"{contract} (nothing was raised)")


def collect(kv: KVBackend, prefix: str, after: int, count: int, timeout: float = PATIENCE) -> list[Event]:
    """Watch until ``count`` events arrived (or ``timeout``); check each batch's ordering rules."""
    deadline = time.monotonic() + timeout
    out: list[Event] = []
    while len(out) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        batch = kv.watch(prefix, after, remaining)
        for event in batch:
            assert event.revision > after, f"watch returned {event} at or below after_revision={after}"
            assert event.key.startswith(prefix), f"watch({prefix!r}) returned {event}"
            after = event.revision
        out += batch
    return out


def wait_deleted(kv: KVBackend, key: str, after: int, timeout: float) -> float | None:
    """Watch ``key``'s parent prefix until a ``DELETE`` of ``key``; the monotonic time seen, or ``None``."""
    prefix = key.rsplit("/", 1)[0] + "/"
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        for event in kv.watch(prefix, after, remaining):
            after = event.revision
            if event.key == key and event.type is DELETE:
                return time.monotonic()
    return None


def head(kv: KVBackend, prefix: str) -> int:
    """The keyspace revision now (read through ``list``)."""
    return kv.list(prefix)[1]


def ttl_deadline(capabilities: Any, ttl: float) -> float:
    """Latest acceptable time (seconds after the write began) to observe an expiry."""
    return ttl + capabilities.ttl_resolution + MARGIN
