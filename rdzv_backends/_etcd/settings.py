"""The settings of an etcd rendezvous URL, shared by ``etcd-v2://`` and ``etcd-v3://``.

``etcd[-v2|-v3]://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/RUN_ID?protocol=https&cacert=...&cert=...&key=...``;
the query keys are described in ``docs/backends/etcd-v2.md``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from rdzv_core.errors import InvalidURLError
from rdzv_core.kv import Capabilities
from rdzv_core.url import Converter, RendezvousURL, to_str

from .tls import tls_context

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_OPERATION_TIMEOUT",
    "MAX_VALUE_BYTES",
    "QUERY_KEYS",
    "EtcdSettings",
    "V2_CAPABILITIES",
    "V3_CAPABILITIES",
    "ttl_seconds",
]

#: etcd's client port, for hosts given without one.
DEFAULT_PORT = 2379
#: Seconds an operation may take before it fails with ``BackendUnavailableError``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Largest value either etcd backend accepts (bytes). Fits etcd's default
#: ``--max-request-bytes`` (1.5 MiB) even base64-encoded in a v2 form body.
MAX_VALUE_BYTES = 1024 * 1024


def _protocol(field_name: str, raw: str) -> str:
    value = raw.lower()
    if value not in ("http", "https"):
        raise InvalidURLError(field_name, raw, "must be 'http' or 'https'")
    return value


def _path(field_name: str, raw: str) -> str:
    return to_str(field_name, raw)


#: Query keys of the etcd backends (``operation_timeout`` is common to every backend).
QUERY_KEYS: dict[str, Converter] = {"protocol": _protocol, "cacert": _path, "cert": _path, "key": _path}


def _capabilities(ttl_resolution: float, tickets_in_value: bool = True) -> Capabilities:
    return Capabilities(
        multi_host=True,
        server_side_ttl=True,
        native_watch=True,
        persistent=True,
        tls=True,
        auth=True,
        max_value_bytes=MAX_VALUE_BYTES,
        ttl_resolution=ttl_resolution,
        tickets_in_value=tickets_in_value,
    )


#: What ``etcd-v2://`` declares. TTLs are whole seconds (rounded up) and the leader deletes expired keys on
#: a 500 ms tick: an expiry is seen up to about 1.5 s after the requested TTL.
V2_CAPABILITIES = _capabilities(ttl_resolution=1.5)
#: What ``etcd-v3://`` declares. etcd's shortest lease is 1.5 election timeouts (2 s by default) and leases
#: are checked every 500 ms: an expiry is seen up to 2.5 s after the requested TTL.
V3_CAPABILITIES = _capabilities(ttl_resolution=2.5, tickets_in_value=False)  # a ticket is the key's version


def ttl_seconds(ttl: float) -> int:
    """etcd TTLs are whole seconds: round ``ttl`` (float seconds > 0) up, to at least 1.

    A key never expires earlier than asked; it may live up to one second longer
    (part of the backends' ``ttl_resolution``).
    """
    return max(1, math.ceil(ttl))


@dataclass(frozen=True)
class EtcdSettings:
    """Connection settings taken from a rendezvous URL.

    Attributes:
        endpoints: ``((host, port), ...)``, at least one.
        scheme: the URL's scheme as given (``"etcd"``, ``"etcd-v2"``, ...), for messages.
        protocol: ``"http"`` or ``"https"``.
        ca_cert: path of the CA bundle, or ``None`` (system CAs for https).
        cert: path of the client certificate (PEM), or ``None``.
        key: path of the client certificate's private key (PEM), or ``None``.
        username: etcd user, or ``None``.
        password: its password (never shown by ``repr``), or ``None``.
        operation_timeout: seconds per operation (float > 0).
    """

    endpoints: tuple[tuple[str, int], ...]
    scheme: str = "etcd"
    protocol: str = "http"
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    operation_timeout: float = DEFAULT_OPERATION_TIMEOUT

    @classmethod
    def from_url(cls, url: RendezvousURL) -> "EtcdSettings":
        """Validate ``url`` for an etcd backend.

        Raises:
            InvalidURLError: no host; ``cacert``/``cert``/``key`` without
                ``protocol=https``; ``key`` without ``cert``; a TLS file that
                does not exist, cannot be read or is not PEM; a ``cert`` without
                a private key (in it or in ``key``), or a ``key`` that does not
                match it (see :func:`~.tls.tls_context`); a password without a user.
        """
        if not url.hosts:
            raise InvalidURLError("host", url.redacted(), f"{url.scheme}:// needs at least one HOST[:PORT]")
        endpoints = tuple((host, port if port is not None else DEFAULT_PORT) for host, port in url.hosts)
        params = url.params
        protocol = params.get("protocol", "http")
        for name in ("cacert", "cert", "key"):
            path = params.get(name)
            if path is None:
                continue
            if protocol != "https":
                raise InvalidURLError(name, path, "only used with TLS: add protocol=https to the URL")
            if not os.path.isfile(path):
                raise InvalidURLError(name, path, "no such file")
        if "key" in params and "cert" not in params:
            raise InvalidURLError("key", params["key"], "a client key needs its certificate: add cert=PATH")
        if url.password is not None and not url.username:
            raise InvalidURLError("username", "", "a password was given without a user name (USER:PASSWORD@HOST)")
        if protocol == "https":
            tls_context(params.get("cacert"), params.get("cert"), params.get("key"))
        return cls(
            endpoints=endpoints,
            scheme=url.scheme,
            protocol=protocol,
            ca_cert=params.get("cacert"),
            cert=params.get("cert"),
            key=params.get("key"),
            username=url.username,
            password=url.password,
            operation_timeout=float(params.get("operation_timeout", DEFAULT_OPERATION_TIMEOUT)),
        )

    def describe(self) -> str:
        """``"http://h1:p1,h2:p2"`` for messages (no credentials)."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"{self.protocol}://{hosts}"
