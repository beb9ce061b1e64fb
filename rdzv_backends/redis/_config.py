"""The settings of a Redis URL that need no client: its TLS files (checked when the URL is opened,
before redis-py is imported) and the key prefix of a namespace."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any, Mapping

from rdzv_backends._tls import tls_context
from rdzv_core.errors import InvalidURLError

__all__ = ["TLSFiles", "namespace_prefix", "tls_files"]


class TLSFiles:
    """Validated TLS settings of a ``rediss://`` URL (checked as etcd's: :func:`rdzv_backends._tls.tls_context`).

    Args:
        cacert: CA bundle (PEM path) to verify the server against; ``None`` uses the system's CAs.
        cert: client certificate (PEM path), or ``None``; its private key is in ``key``, or in
            this file too (one PEM file with both).
        key: the client certificate's private key (PEM path), or ``None``; needs ``cert``.

    Raises:
        InvalidURLError: naming ``cacert``, ``cert`` or ``key`` when a file is missing,
            unreadable or not PEM, the certificate has no private key (in ``key`` or its own
            file), the key does not match it or is encrypted, or ``key`` comes without ``cert``.
    """

    def __init__(self, cacert: str | None = None, cert: str | None = None, key: str | None = None) -> None:
        if key is not None and cert is None:
            raise InvalidURLError("cert", None, "'key' needs 'cert' (the client certificate file)")
        for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
            if path is not None and not os.path.isfile(path):
                raise InvalidURLError(name, path, "no such file")
        self.context = tls_context(cacert, cert, key)
        self.cacert, self.cert, self.key = cacert, cert, key

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``redis.Redis``: TLS on, certificate and host name verified."""
        return {"ssl": True, **self.connection_kwargs()}

    def connection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``redis.SSLConnection`` (a pool's): certificate and host name verified."""
        return {
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": True,
            "ssl_ca_certs": self.cacert,
            "ssl_certfile": self.cert,
            "ssl_keyfile": self.key,  # None with a cert file that holds its key too
        }


_TLS_KEYS = ("cacert", "cert", "key")


def tls_files(scheme: str, params: Mapping[str, Any]) -> TLSFiles | None:
    """The checked :class:`TLSFiles` of a ``rediss://`` URL's query, ``None`` for ``redis://``.

    Raises:
        InvalidURLError: a TLS option on a ``redis://`` URL (never a silent plain-text connection);
            a TLS file problem (see :class:`TLSFiles`).
    """
    if scheme == "rediss":
        return TLSFiles(params.get("cacert"), params.get("cert"), params.get("key"))
    for name in _TLS_KEYS:
        if name in params:
            raise InvalidURLError(name, params[name], "TLS options need the rediss:// scheme")
    return None


def namespace_prefix(namespace: str | None) -> str:
    """The Redis key prefix of a namespace: ``"rdzv:"``, or ``"rdzv:" + quote(namespace) + ":"``."""
    if namespace is None:
        return "rdzv:"
    return "rdzv:" + urllib.parse.quote(namespace, safe="") + ":"
