"""What an elastic agent uses from a rendezvous handler beyond torch's ``RendezvousHandler``: the
:class:`ElasticHandler` protocol (:class:`~rdzv_core.torch_api.handler.RdzvHandler` implements it; the agent asks
for it in one place, ``rdzv_agent.elastic``). Imports no torch."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..rendezvous import RendezvousParams
from .address import Endpoint

__all__ = ["ElasticHandler"]


@runtime_checkable
class ElasticHandler(Protocol):
    """What an elastic agent (``rdzv-run``'s) uses from a rendezvous handler beyond torch's
    ``RendezvousHandler``. :class:`RdzvHandler` implements it; torch's own handlers (c10d, static, etcd)
    do not, and an agent then does without each of these. Test with ``isinstance(handler, ElasticHandler)``.
    """

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The backend's ``(host, port)`` endpoints (``()`` without a network endpoint): the route to them
        picks the address published as ``MASTER_ADDR``."""
        ...

    @property
    def params(self) -> RendezvousParams:
        """The rendezvous settings (``min_nodes``, ``max_nodes``, ``timeout`` in seconds, ...)."""
        ...

    def round_version(self) -> int | None:
        """The version of the round this node is in (its last completed rendezvous), ``None`` outside one."""
        ...

    def publish_progress(self, workers: dict[int, tuple[int, float]], ttl: float,
                         hang_timeout: float | None = None) -> bool:
        """Publish this node's workers' progress (global rank -> ``(step, Unix seconds)``) for ``ttl``
        seconds; ``False`` when it was not written (never raises on a backend error)."""
        ...

    def release(self, finished: bool = False) -> None:
        """Leave the round and release the backend, leaving the run open for the others."""
        ...

    def report_failure(self, at: float, detail: str, settle: float, peer: bool = False) -> dict[str, Any] | None:
        """This node's workers failed at Unix time ``at`` (``detail``: one line; ``peer``: because a peer was
        lost, never the culprit): record it in the run's node ledger and say who failed first, waiting up to
        ``settle`` s after ``at`` for earlier reports: ``{"culprit": NAME, "first": bool, "node": this node's
        name, "quarantined": bool, "until": UNIX_TIME | None, "why": str}``; ``None`` when unknown (outside a
        round, backend unreachable: never raises)."""
        ...

    def node_excluded(self, name: str) -> bool:
        """Whether node ``name`` is quarantined and the run goes on without it (it was not admitted fail-open);
        ``False`` when unknown (never raises)."""
        ...
