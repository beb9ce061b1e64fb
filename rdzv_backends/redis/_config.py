"""The settings of a Redis URL that need no client: its TLS files (checked when the URL is opened)
and the key prefix of a namespace."""

from __future__ import annotations

import os
import ssl
import urllib.parse
from typing import Any

from rdzv_core.errors import InvalidURLError

__all__ = ["TLSFiles", "namespace_prefix"]


class TLSFiles:
    """Validated TLS settings of a ``rediss://`` URL.

    Args:
        cacert: CA bundle (PEM path) to verify the server against; ``None`` uses the system's CAs.
        cert: client certificate (PEM path), or ``None``; needs ``key``.
        key: the client certificate's private key (PEM path), or ``None``; needs ``cert``.

    Raises:
        InvalidURLError: naming ``cacert``, ``cert`` or ``key`` when a file is missing,
            unreadable or not what it should be, or ``cert``/``key`` comes without the other.
    """

    def __init__(self, cacert: str | None = None, cert: str | None = None, key: str | None = None) -> None:
        if cert is not None and key is None:
            raise InvalidURLError("key", None, "'cert' needs 'key' (the client certificate's private key file)")
        if key is not None and cert is None:
            raise InvalidURLError("cert", None, "'key' needs 'cert' (the client certificate file)")
        for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
            if path is not None and not os.path.isfile(path):
                raise InvalidURLError(name, path, "no such file")
            if path is not None and not os.access(path, os.R_OK):
                raise InvalidURLError(name, path, "file not readable")
        context = ssl.create_default_context()
        if cacert is not None:
            try:
                context.load_verify_locations(cafile=cacert)
            except (ssl.SSLError, ValueError) as exc:
                raise InvalidURLError("cacert", cacert, f"not a PEM CA bundle ({exc})") from None
        if cert is not None and key is not None:
            with open(cert, "rb") as f:
                if b"-----BEGIN CERTIFICATE-----" not in f.read():
                    raise InvalidURLError("cert", cert, "no PEM certificate in this file")
            try:
                context.load_cert_chain(cert, key)
            except (ssl.SSLError, ValueError) as exc:
                raise InvalidURLError("key", key, f"not the private key of 'cert' ({exc})") from None
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
            "ssl_keyfile": self.key,
        }


def namespace_prefix(namespace: str | None) -> str:
    """The Redis key prefix of a namespace: ``"rdzv:"``, or ``"rdzv:" + quote(namespace) + ":"``."""
    if namespace is None:
        return "rdzv:"
    return "rdzv:" + urllib.parse.quote(namespace, safe="") + ":"
