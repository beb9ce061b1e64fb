"""What the two etcd plugin packages share: the ``BackendSpec`` fields and the lazy import of the backend."""

from __future__ import annotations

import importlib
from typing import Callable

from rdzv_core.kv import Capabilities, KVBackend
from rdzv_core.plugins import BackendSpec
from rdzv_core.url import RendezvousURL

from .settings import DEFAULT_PORT, QUERY_KEYS, EtcdSettings

__all__ = ["etcd_spec"]


def etcd_spec(
    schemes: tuple[str, ...], capabilities: Capabilities, description: str, package: str, backend: str
) -> BackendSpec:
    """The ``BackendSpec`` of an etcd backend whose ``open`` validates the URL, then imports the backend.

    Args:
        package: the plugin package (``__name__``); ``backend`` is ``"MODULE:CLASS"`` relative to it
            (``".backend:EtcdV2Backend"``), imported (with its client library) when a URL is opened.
    """
    module, _, name = backend.partition(":")

    def open_etcd(url: RendezvousURL) -> KVBackend:
        settings = EtcdSettings.from_url(url)
        cls: Callable[[EtcdSettings], KVBackend] = getattr(importlib.import_module(module, package), name)
        return cls(settings)

    open_etcd.__qualname__ = open_etcd.__name__ = f"open_{schemes[0].replace('-', '_')}"
    return BackendSpec(schemes=schemes, open=open_etcd, capabilities=capabilities, default_port=DEFAULT_PORT,
                       query_keys=QUERY_KEYS, requires_host=True, description=description, server_endpoints="many")
