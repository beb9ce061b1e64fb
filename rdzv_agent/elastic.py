"""The one place the agent asks whether its rendezvous handler is rdzv's: :func:`elastic_handler`.

What the agent uses beyond torch's ``RendezvousHandler`` API is the declared, typed protocol
:class:`rdzv_core.torch_api.handler.ElasticHandler`; torch's own handlers (c10d, static, etcd) lack it and the
agent then goes without each extra (no progress published, no ``release``, the address rule without
backend endpoints, no round version in the health check).
"""

from __future__ import annotations

from rdzv_core.torch_api.handler import ElasticHandler

__all__ = ["ElasticHandler", "elastic_handler"]


def elastic_handler(handler: object) -> ElasticHandler | None:
    """``handler`` if it implements :class:`~rdzv_core.torch_api.handler.ElasticHandler` (rdzv's does), else
    ``None``."""
    return handler if isinstance(handler, ElasticHandler) else None
