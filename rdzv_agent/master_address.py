"""MASTER_ADDR / MASTER_PORT: chosen by group rank 0, shared through the round's store.

Group rank 0 picks a port the OS reports free, checks that it can still bind it,
and writes ``{"addr": ..., "port": ...}`` under :data:`MASTER_KEY` in the store
that ``next_rendezvous()`` returned. That store is scoped to the rendezvous
round, so every round has its own value and a re-rendezvous re-publishes.
Every node (rank 0 too) then reads the value back.

The key is the agent's own (not ``MASTER_ADDR``/``MASTER_PORT``), so the value
never races with what a handler may itself publish under torch's keys.

A port can still be taken between choosing and binding; a worker that fails
for that reason shows an error that :func:`is_port_in_use_error` recognises,
and the agent then re-rendezvouses (a new round, a new port) without spending
a restart.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import socket
from typing import Any, Mapping

from rdzv_core.torch_api import address
from rdzv_core.torch_api.address import published_address

from .elastic import elastic_handler

__all__ = [
    "MASTER_KEY",
    "choose_port",
    "port_is_free",
    "local_address",
    "worker_network_env",
    "publish",
    "read",
    "decode",
    "is_port_in_use_error",
]

log = logging.getLogger(__name__)

MASTER_KEY = "rdzv_agent/master"

_PORT_IN_USE = re.compile(r"EADDRINUSE|address already in use|\[Errno 98\]", re.IGNORECASE)


def choose_port() -> int:
    """A TCP port that is free on every IPv4 interface right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    """True if a listening socket could bind ``port`` on all IPv4 (and IPv6) interfaces now.

    Conservative: a port in TIME_WAIT counts as taken (no ``SO_REUSEADDR``).
    """
    families = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # family not supported here
        with sock:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                if exc.errno != errno.EADDRNOTAVAIL:  # e.g. IPv6 disabled: not a conflict
                    raise
    return True


def local_address(configured: str | None = None, handler: Any = None) -> str:
    """The address to publish as MASTER_ADDR: ``configured``, else by :mod:`rdzv_core.torch_api.address`'s rule
    with the backend endpoints of ``handler`` (its ``endpoints``; none for a handler without them)."""
    return published_address(configured, _endpoints(handler))


def _endpoints(handler: Any) -> tuple[address.Endpoint, ...]:
    """The backend endpoints of rdzv's ``handler`` (:class:`~rdzv_core.torch_api.handler.ElasticHandler`);
    ``()`` for others."""
    elastic = elastic_handler(handler)
    return () if elastic is None else elastic.endpoints


#: The variable gloo reads for the interface it binds and announces (torch's ``ProcessGroupGloo``).
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def worker_network_env(parent_env: Mapping[str, str], configured: str | None = None,
                       handler: Any = None) -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": IFACE}`` for the workers when gloo would otherwise announce loopback, else ``{}``.

    gloo announces the address this host's name resolves to and falls back to loopback when it resolves to
    none (torch's "Unable to resolve hostname ... Using the loopback address as fallback"); peers on other
    hosts then cannot connect. So when the name does not resolve beyond loopback and the user set no
    ``GLOO_SOCKET_IFNAME``, the workers get the interface of this node's own address by
    :mod:`rdzv_core.torch_api.address`'s rule (``--local-addr`` or the route to the backend). torchrun sets nothing.
    """
    if GLOO_IFNAME_ENV in parent_env or address.name_resolves():
        return {}
    chosen, _ = address.choose_address(configured, _endpoints(handler))
    interface = address.interface_of(chosen)
    if interface is None or interface == "lo":
        return {}
    log.info("workers get %s=%s (this host's name does not resolve; %s is on %s)", GLOO_IFNAME_ENV, interface,
             chosen, interface)
    return {GLOO_IFNAME_ENV: interface}


def publish(store: Any, addr: str, port: int) -> None:
    """Write the master endpoint into the round's ``store`` (c10d ``Store.set``)."""
    store.set(MASTER_KEY, json.dumps({"addr": addr, "port": int(port)}).encode("utf-8"))


def read(store: Any) -> tuple[str, int]:
    """Read the endpoint group rank 0 published; blocks up to the store's timeout.

    Raises:
        torch ``RendezvousStateError``: the stored value is malformed.
        whatever the store raises when the key does not appear in time
        (``torch.distributed.DistStoreError`` for c10d stores).
    """
    return decode(store.get(MASTER_KEY))


def decode(raw: Any) -> tuple[str, int]:
    """``(addr, port)`` from the value :func:`publish` wrote.

    Raises:
        torch ``RendezvousStateError``: the value is malformed.
    """
    try:
        value = json.loads(bytes(raw).decode("utf-8"))
        addr, port = value["addr"], value["port"]
        if not isinstance(addr, str) or not addr or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"bad address {addr!r} or port {port!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        from torch.distributed.elastic.rendezvous.api import RendezvousStateError

        raise RendezvousStateError(f"malformed master endpoint in the rendezvous store: {exc}") from None
    return addr, port


def is_port_in_use_error(text: str) -> bool:
    """True if a worker's error output says a port was already in use (EADDRINUSE)."""
    return bool(_PORT_IN_USE.search(text or ""))
