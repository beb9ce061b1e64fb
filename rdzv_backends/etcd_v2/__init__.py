"""``etcd://`` and ``etcd-v2://``: etcd's v2 API (servers started with ``--enable-v2``), client ``python-etcd``.

This module holds only the plugin's :class:`~rdzv_core.plugins.BackendSpec`; the backend
(:mod:`.backend`) and its client library are imported when a URL is opened. ``docs/backends/etcd-v2.md``
describes the mapping onto v2, the failure handling and the measured numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rdzv_core.kv import KVBackend
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL

from .._etcd.settings import DEFAULT_PORT, QUERY_KEYS, V2_CAPABILITIES, EtcdSettings

if TYPE_CHECKING:
    from .backend import POOL_CONNECTIONS, EtcdV2Backend

__all__ = ["EtcdV2Backend", "POOL_CONNECTIONS", "open_etcd_v2", "plugin"]


def open_etcd_v2(url: RendezvousURL) -> KVBackend:
    """Open an ``etcd-v2://`` URL (validated first, then ``python-etcd`` is imported)."""
    settings = EtcdSettings.from_url(url)
    from .backend import EtcdV2Backend

    return EtcdV2Backend(settings)


def __getattr__(name: str) -> Any:
    """The backend's public names, imported on first use (PEP 562): they pull in ``python-etcd``."""
    if name in ("EtcdV2Backend", "POOL_CONNECTIONS"):
        from . import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Registers ``etcd://`` and ``etcd-v2://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    BackendSpec(
        schemes=("etcd-v2", "etcd"),
        open=open_etcd_v2,
        capabilities=V2_CAPABILITIES,
        default_port=DEFAULT_PORT,
        query_keys=QUERY_KEYS,
        requires_host=True,
        description="etcd v2 API (servers started with --enable-v2), python-etcd",
    )
)
