"""The stuck-process check: a worker in uninterruptible sleep past a timeout makes the group UNHEALTHY.

torch 2.13's ``LocalElasticAgent`` (``_check_uninterruptible_state_timeout``): with
``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT`` seconds > 0, each monitor pass while
the workers run samples every worker's state; a worker seen continuously in Linux
uninterruptible sleep (``D``; psutil's ``disk-sleep``) for at least the timeout,
measured from the first pass that saw it, makes the group UNHEALTHY and the agent
fails the job without restarting (a wedged worker holds a kernel resource a new
one would conflict with). Unset or <= 0: off (torch's default). Only the worker
processes are checked, not their children, as torch does.

Differences: a value that is not a number is a :class:`ConfigError` here (torch
silently turns the check off); torch disables restarts by zeroing the remaining
restarts (the reported restart count then claims all were spent), here the
failure itself is marked not restartable (``MonitorResult.restart``).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Mapping

import psutil

from rdzv_core.errors import ConfigError

__all__ = ["UninterruptibleCheck", "TIMEOUT_ENV", "timeout_from_env", "in_uninterruptible_sleep"]

TIMEOUT_ENV = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"


def timeout_from_env(environ: Mapping[str, str]) -> float:
    """Seconds from ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``; 0 (off) when unset, empty or <= 0.

    Raises:
        ConfigError: not a number (or NaN).
    """
    raw = environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise ConfigError(TIMEOUT_ENV, raw, "expected a number of seconds (<= 0 turns the check off)")
    return max(0.0, value)


def in_uninterruptible_sleep(pid: int) -> bool | None:
    """Whether ``pid`` is in uninterruptible sleep (``D``); ``None`` if its state cannot be read."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_DISK_SLEEP)
    except psutil.Error:
        return None


class UninterruptibleCheck:
    """How long each worker has been in ``D`` state, over successive :meth:`check` calls.

    Args:
        timeout: seconds (> 0; 0 turns :meth:`check` into a no-op).
        clock: monotonic seconds (``time.monotonic``).
        sample: ``pid -> in D?`` (:func:`in_uninterruptible_sleep`).
    """

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic,
                 sample: Callable[[int], bool | None] = in_uninterruptible_sleep) -> None:
        self.timeout = float(timeout)
        self._clock = clock
        self._sample = sample
        self._since: dict[int, float] = {}

    def check(self, pids: Mapping[int, int]) -> dict[int, float]:
        """The workers (``local rank -> pid``) in ``D`` state for >= timeout: ``local rank -> seconds``.

        Forgets pids not in ``pids`` (exited, or a new start of the group).
        """
        if self.timeout <= 0:
            return {}
        live = set(pids.values())
        for pid in list(self._since):
            if pid not in live:
                del self._since[pid]
        stuck: dict[int, float] = {}
        now = self._clock()
        for local_rank, pid in pids.items():
            if not self._sample(pid):
                self._since.pop(pid, None)
                continue
            dwell = now - self._since.setdefault(pid, now)
            if dwell >= self.timeout:
                stuck[local_rank] = dwell
        return stuck
