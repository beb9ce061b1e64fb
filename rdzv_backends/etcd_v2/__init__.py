"""``etcd://`` and ``etcd-v2://``: etcd's v2 API (servers started with ``--enable-v2``), client ``python-etcd``.

This module holds only the plugin: its :class:`~rdzv_core.plugins.BackendSpec`, whose ``open`` imports the
backend (:mod:`.backend`) and ``python-etcd`` when a URL is opened. ``docs/backends/etcd-v2.md`` describes
the mapping onto v2, the failure handling and the measured numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdzv_core.plugins import backend_plugin

from .._etcd.plugin import etcd_spec
from .._lazy import lazy_attributes
from .._etcd.settings import V2_CAPABILITIES

if TYPE_CHECKING:
    from .backend import POOL_CONNECTIONS, EtcdV2Backend

__all__ = ["EtcdV2Backend", "POOL_CONNECTIONS", "plugin"]

#: The backend's public names, imported on first use: they pull in ``python-etcd``.
__getattr__ = lazy_attributes(__name__, dict.fromkeys(("EtcdV2Backend", "POOL_CONNECTIONS"), __name__ + ".backend"))

#: Registers ``etcd-v2://`` and ``etcd://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    etcd_spec(("etcd-v2", "etcd"), V2_CAPABILITIES, "etcd v2 API (servers started with --enable-v2), python-etcd",
              __name__, ".backend:EtcdV2Backend")
)
