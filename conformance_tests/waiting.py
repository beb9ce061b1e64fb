"""The one polling helper of the conformance suite (shipped: it cannot import the project's ``tests/``, which
re-exports it as ``tests.support.waiting.eventually``)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: Seconds between two checks of a condition.
EVERY = 0.02


def eventually(condition: Callable[[], T], timeout: float, what: str, detail: Callable[[], str] | None = None,
               *, every: float = EVERY) -> T:
    """Check ``condition()`` every ``every`` s until it returns something truthy, and return that.

    After ``timeout`` s (the condition is checked once more at the deadline) fail with an ``AssertionError``
    naming ``what`` was waited for, for how long, the last value seen and ``detail()`` (e.g. a process's
    output), if given.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"waited {timeout:g} s for {what}; last value {value!r}{extra}")
        time.sleep(max(0.0, min(every, deadline - time.monotonic())))
