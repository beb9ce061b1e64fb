"""rdzv_agent: torchelastic's elastic agent over any ``RendezvousHandler``, and ``rdzv-run``.

The agent knows only torch's ``RendezvousHandler`` interface; ``rdzv-run``
(:mod:`rdzv_agent.launch.launcher`) builds the handler with
:func:`rdzv_core.create_handler`.

Public names: the agent API (:mod:`rdzv_agent.api`), :class:`SimpleElasticAgent`
(:mod:`rdzv_agent.simple`) and :class:`LocalElasticAgent` (:mod:`rdzv_agent.local`).
Importing this package imports torch.
"""

from __future__ import annotations

from .api import (
    DEFAULT_ROLE,
    ElasticAgent,
    MonitorResult,
    SignalException,
    Worker,
    WorkerFailure,
    WorkerGroup,
    WorkerGroupFailureException,
    WorkerSpec,
    WorkerState,
)
from .local import LocalElasticAgent
from .simple import AgentEvent, SimpleElasticAgent
from .workers.streams import Std

__all__ = [
    "DEFAULT_ROLE",
    "WorkerSpec",
    "Worker",
    "WorkerState",
    "WorkerGroup",
    "MonitorResult",
    "WorkerFailure",
    "WorkerGroupFailureException",
    "SignalException",
    "ElasticAgent",
    "SimpleElasticAgent",
    "AgentEvent",
    "LocalElasticAgent",
    "Std",
]
