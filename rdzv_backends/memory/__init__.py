"""``memory://[NAME]/RUN_ID`` — an in-process, thread-safe keyspace shared by name (docs/backends/memory.md).

This package holds the registration only; :mod:`rdzv_backends.memory.backend` is imported when a
URL is opened (or a name of it is asked for: ``from rdzv_backends.memory import MemoryBackend``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdzv_backends._lazy import lazy_attributes
from rdzv_backends.memory._settings import CAPABILITIES
from rdzv_core.errors import InvalidURLError
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL

if TYPE_CHECKING:
    from rdzv_backends.memory.backend import HISTORY_LIMIT, WAKE_TOKENS, WATCH_BATCH, MemoryBackend

__all__ = ["CAPABILITIES", "HISTORY_LIMIT", "MemoryBackend", "WAKE_TOKENS", "WATCH_BATCH", "plugin"]



def _open(url: RendezvousURL) -> MemoryBackend:
    if len(url.hosts) > 1:
        raise InvalidURLError("host", url.redacted(), "memory:// takes at most one keyspace name")
    from rdzv_backends.memory.backend import MemoryBackend

    return MemoryBackend(url.hosts[0][0] if url.hosts else "default")


#: Registers ``memory://`` through the ``rdzv`` entry point, like any plugin.
plugin = backend_plugin(
    BackendSpec(
        schemes=("memory",),
        open=_open,
        capabilities=CAPABILITIES,
        description="in-process keyspace shared by name (tests, simulations)",
        server_endpoints="none",
        default_endpoint="torchrun",  # torchrun's rdzv-memory without --rdzv-endpoint
    )
)


_BACKEND = "rdzv_backends.memory.backend"
__getattr__ = lazy_attributes(__name__, dict.fromkeys(("MemoryBackend", "HISTORY_LIMIT", "WATCH_BATCH", "WAKE_TOKENS"),
                                                      _BACKEND))
