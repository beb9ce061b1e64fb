"""What ``memory://`` can do (its :class:`~rdzv_core.kv.Capabilities`): read by the package's registration and
by :mod:`rdzv_backends.memory.backend`."""

from __future__ import annotations

from rdzv_core.kv import Capabilities

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    multi_host=False, server_side_ttl=False, native_watch=True, persistent=False, multi_process=False,
    ttl_resolution=0.05
)
