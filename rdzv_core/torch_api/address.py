"""The address rank 0 publishes for its workers' peers (``MASTER_ADDR``): one the other hosts can reach.

One rule, used by the handler (the bootstrap store address torch's agent hands the workers) and by
``rdzv-run``'s agent (its own ``MASTER_ADDR``), first match wins:

1. an address given by the user (``--local-addr``, the handler's ``local_addr``);
2. this host's name (``socket.getfqdn()``, then ``socket.gethostname()``) if it resolves to an
   address that is not loopback: torch's choice, right on clusters whose names resolve;
3. the local address of the route to the rendezvous backend (a UDP ``connect()`` to an endpoint of
   the URL picks the route's source address and sends no packet): the interface through which this
   host reaches the backend, which the other nodes reach too (they reach the same backend);
4. the name (backends without endpoints, ``memory://`` and ``file://``, whose nodes share a host;
   a backend reached over loopback; or no route).

The choice and its reason are logged at INFO. docs/networking.md explains the rule and its limits.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from typing import Sequence

__all__ = ["choose_address", "published_address", "route_source", "name_resolves", "interface_of"]

log = logging.getLogger(__name__)

#: A backend endpoint: ``(host, port)``, port ``None`` when unknown.
Endpoint = tuple[str, int | None]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _resolves_beyond_loopback(name: str) -> str | None:
    """The first non-loopback address ``name`` resolves to here, or ``None`` (unresolvable or loopback only)."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    for info in infos:
        address = str(info[4][0])
        if not _is_loopback(address):
            return address
    return None


def name_resolves() -> bool:
    """Whether this host's name (``getfqdn()``, then ``gethostname()``) resolves to a non-loopback address."""
    return any(_resolves_beyond_loopback(n) is not None for n in dict.fromkeys((socket.getfqdn(),
                                                                                    socket.gethostname())))


def interface_of(address: str) -> str | None:
    """The name of the local network interface that holds ``address`` (``psutil.net_if_addrs``), or ``None``."""
    import psutil

    wanted = address.split("%", 1)[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(str(a.address).split("%", 1)[0] == wanted for a in addrs):
            return str(name)
    return None


def route_source(host: str, port: int | None) -> str | None:
    """The local address this host would use to reach ``host:port`` (``None``: unresolvable, no route).

    A UDP socket's ``connect()`` selects the route and its source address without sending anything.
    An IPv6 link-local source keeps its zone (``fe80::1%eth0``).
    """
    try:
        infos = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                local = sock.getsockname()
        except OSError:
            continue
        address = str(local[0])
        if family == socket.AF_INET6 and len(local) > 3 and local[3] and "%" not in address:
            try:
                address = f"{address}%{socket.if_indextoname(local[3])}"
            except OSError:
                pass
        return address
    return None


def choose_address(configured: str | None, endpoints: Sequence[Endpoint] = ()) -> tuple[str, str]:
    """``(address, reason)`` by the rule of this module's docstring.

    Args:
        configured: the user's address (wins when not empty).
        endpoints: the backend's ``(host, port)`` pairs (``()`` for backends without a server).
    """
    if configured:
        return configured, "given by --local-addr / local_addr"
    name = socket.getfqdn()
    for candidate in dict.fromkeys((name, socket.gethostname())):
        resolved = _resolves_beyond_loopback(candidate)
        if resolved is not None:
            return candidate, f"this host's name resolves to {resolved}"
    if not endpoints:
        return name, f"this host's name {name!r} resolves to no non-loopback address, and the backend has no " \
                     "network endpoint (its nodes share this host)"
    seen = []
    for host, port in endpoints:
        source = route_source(host, port)
        if source is not None and not _is_loopback(source):
            return source, (f"this host's name {name!r} resolves to no non-loopback address; {source} is the "
                            f"local address of the route to the rendezvous backend {host}:{port}")
        seen.append(f"{host}:{port} ({'loopback' if source else 'no route'})")
    return name, (f"this host's name {name!r} resolves to no non-loopback address, and no backend endpoint is "
                  f"reached over a network interface: {', '.join(seen)}")


_last_logged: list[tuple[str, str]] = []
_log_lock = threading.Lock()


def published_address(configured: str | None, endpoints: Sequence[Endpoint] = ()) -> str:
    """The address to publish as ``MASTER_ADDR`` (:func:`choose_address`); logs it and why at INFO
    (once per process until the choice or its reason changes: rank 0 publishes every round)."""
    address, reason = choose_address(configured, endpoints)
    with _log_lock:
        if _last_logged != [(address, reason)]:
            _last_logged[:] = [(address, reason)]
            log.info("publishing %s as this node's address for its peers (MASTER_ADDR): %s", address, reason)
    return address
