"""``etcd-v3://`` and ``etcd3://``: etcd's v3 gRPC API, clients ``grpcio`` and ``python3-etcd3``'s stubs.

This module holds only the plugin's :class:`~rdzv_core.plugins.BackendSpec`; the backend
(:mod:`.backend`) and gRPC are imported when a URL is opened. ``docs/backends/etcd-v3.md`` describes the
mapping onto v3, the leases, the failure handling and the measured numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rdzv_core.kv import KVBackend
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL

from .._etcd.settings import DEFAULT_PORT, QUERY_KEYS, V3_CAPABILITIES, EtcdSettings

if TYPE_CHECKING:
    from .backend import REFRESH_CONCURRENCY, EtcdV3Backend

__all__ = ["EtcdV3Backend", "REFRESH_CONCURRENCY", "open_etcd_v3", "plugin"]


def open_etcd_v3(url: RendezvousURL) -> KVBackend:
    """Open an ``etcd-v3://`` URL (validated first, then gRPC is imported)."""
    settings = EtcdSettings.from_url(url)
    from .backend import EtcdV3Backend

    return EtcdV3Backend(settings)


def __getattr__(name: str) -> Any:
    """The backend's public names, imported on first use (PEP 562): they pull in gRPC."""
    if name in ("EtcdV3Backend", "REFRESH_CONCURRENCY"):
        from . import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Registers ``etcd://`` and ``etcd-v2://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    BackendSpec(
        schemes=("etcd-v3", "etcd3"),
        open=open_etcd_v3,
        capabilities=V3_CAPABILITIES,
        default_port=DEFAULT_PORT,
        query_keys=QUERY_KEYS,
        requires_host=True,
        description="etcd v3 gRPC API, one lease per key, python3-etcd3",
    )
)
