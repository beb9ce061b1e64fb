"""torch elastic's environment-driven operations hooks, read once: health check, watchdog, stuck-process check.

Modules: :mod:`rdzv_agent.supervision.health` (``TORCHELASTIC_HEALTH_CHECK_PORT``),
:mod:`rdzv_agent.supervision.watchdog` (``TORCHELASTIC_ENABLE_FILE_TIMER``, ``TORCHELASTIC_TIMER_FILE``),
:mod:`rdzv_agent.supervision.stuck` (``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from . import health, stuck, watchdog

__all__ = ["OpsHooks", "ops_from_env"]


@dataclass(frozen=True)
class OpsHooks:
    """The hooks' settings (defaults: all off).

    Attributes:
        health_check_port: serve the health check on this port, or ``None``.
        health_check_timeout: seconds without progress before it answers 503.
        file_timer: run torch's ``FileTimerServer`` for the workers.
        timer_file: its pipe's path, or ``None`` (a new one per start of the group).
        uninterruptible_state_timeout: seconds a worker may stay in ``D`` state (0: no check).
    """

    health_check_port: int | None = None
    health_check_timeout: float = health.DEFAULT_TIMEOUT
    file_timer: bool = False
    timer_file: str | None = None
    uninterruptible_state_timeout: float = 0.0


def ops_from_env(environ: Mapping[str, str]) -> OpsHooks:
    """Read the hooks' variables.

    Raises:
        ConfigError: a bad value (names the variable and the value).
    """
    file_timer, timer_file = watchdog.settings_from_env(environ)
    return OpsHooks(
        health_check_port=health.port_from_env(environ),
        health_check_timeout=health.timeout_from_env(environ),
        file_timer=file_timer,
        timer_file=timer_file,
        uninterruptible_state_timeout=stuck.timeout_from_env(environ),
    )
