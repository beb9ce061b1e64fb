"""``etcd-v3://`` and ``etcd3://``: etcd's v3 gRPC API, clients ``grpcio`` and ``python3-etcd3``'s stubs.

This module holds only the plugin: its :class:`~rdzv_core.plugins.BackendSpec`, whose ``open`` imports the
backend (:mod:`.backend`) and gRPC when a URL is opened. ``docs/backends/etcd-v3.md`` describes the mapping
onto v3, the leases, the failure handling and the measured numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdzv_core.plugins import backend_plugin

from .._etcd.plugin import etcd_spec
from .._lazy import lazy_attributes
from .._etcd.settings import V3_CAPABILITIES

if TYPE_CHECKING:
    from .backend import REFRESH_CONCURRENCY, EtcdV3Backend

__all__ = ["EtcdV3Backend", "REFRESH_CONCURRENCY", "plugin"]

#: The backend's public names, imported on first use: they pull in gRPC.
__getattr__ = lazy_attributes(__name__, dict.fromkeys(("EtcdV3Backend", "REFRESH_CONCURRENCY"), __name__ + ".backend"))

#: Registers ``etcd-v3://`` and ``etcd3://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    etcd_spec(("etcd-v3", "etcd3"), V3_CAPABILITIES, "etcd v3 gRPC API, one lease per key, python3-etcd3",
              __name__, ".backend:EtcdV3Backend")
)
