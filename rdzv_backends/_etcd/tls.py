"""TLS for the etcd backends: the URL's TLS files checked with Python's ``ssl``, and one handshake at open.

:func:`tls_context` (backend-neutral: :mod:`rdzv_backends._tls`, shared with ``rediss://``) runs when the
URL is parsed; :func:`check_tls` at open names a ``cacert`` that does not sign the server's certificate, or a
``cert`` the server refuses, as :class:`~rdzv_core.errors.InvalidURLError` at once (gRPC would retry such a
handshake until ``operation_timeout``; urllib3's error names neither file).
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING, Protocol

from rdzv_core.errors import InvalidURLError

from .._tls import certificate_error, handshake, refused_certificate, tls_context, where as _where

if TYPE_CHECKING:
    from .budget import AttemptDeadline

__all__ = ["TLSSettings", "tls_context", "check_tls"]


class TLSSettings(Protocol):
    """What :func:`check_tls` reads of :class:`~.settings.EtcdSettings`."""

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]: ...
    @property
    def protocol(self) -> str: ...
    @property
    def ca_cert(self) -> str | None: ...
    @property
    def cert(self) -> str | None: ...
    @property
    def key(self) -> str | None: ...


def _plain_http(host: str, port: int, where: str, seconds: float) -> bool:
    """Whether ``host:port`` answers a plain-text HTTP request (asked after a failed TLS handshake)."""
    if seconds <= 0:
        return False
    answer = b""
    try:
        with socket.create_connection((host, port), timeout=seconds) as raw:
            raw.sendall(f"GET /version HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n".encode())
            while len(answer) < 4096 and (chunk := raw.recv(4096)):
                answer += chunk
    except OSError:
        pass
    # Go's TLS servers answer plain HTTP with "400 ... Client sent an HTTP request to an HTTPS server".
    return answer.startswith(b"HTTP/") and b"to an HTTPS server" not in answer


def check_tls(settings: TLSSettings, deadline: AttemptDeadline) -> None:
    """At open, for ``protocol=https``: one TLS handshake (and ``GET /version``) with Python's ``ssl``.

    The first endpoint that answers decides; endpoints that cannot be reached
    (refused, silent until the attempt's time) are left to the backend's own
    requests, which report them.

    Raises:
        InvalidURLError: ``cacert`` does not sign the server's certificate;
            the certificate is not for the URL's ``host``; the server refused
            ``cert`` (or demands one); ``protocol=https`` against a server
            without TLS.
    """
    if settings.protocol != "https":
        return
    context = tls_context(settings.ca_cert, settings.cert, settings.key)
    for host, port in settings.endpoints:
        seconds = deadline.attempt()
        if seconds <= 0:
            return
        where = _where(host, port)
        try:
            raw = socket.create_connection((host, port), timeout=seconds)
        except OSError:
            continue  # not reachable now: the backend's requests report it
        try:
            # TLS 1.3 servers judge the client certificate after the client's handshake: ask for an answer.
            handshake(context, raw, host,
                      f"GET /version HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n".encode())
        except ssl.SSLCertVerificationError as exc:
            detail = exc.verify_message or exc.reason
            if exc.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
                raise InvalidURLError("host", host, f"the TLS certificate of the server at {where} is not for "
                                                    f"this host ({detail})") from None
            trusted = f"by cacert={settings.ca_cert}" if settings.ca_cert else "by the system's CAs (add cacert=PATH)"
            raise InvalidURLError("cacert", settings.ca_cert, f"the TLS certificate of the server at {where} is not "
                                                              f"signed {trusted}: {detail}") from None
        except (ssl.SSLError, ConnectionError) as exc:
            reason = refused_certificate(exc, settings.cert is not None)
            if reason is not None:
                raise certificate_error(where, settings.cert, reason, "etcd's --trusted-ca-file") from None
            if _plain_http(host, port, where, deadline.attempt()):
                raise InvalidURLError("protocol", "https", f"the server at {where} does not speak TLS "
                                                           f"({getattr(exc, 'reason', None) or exc}): "
                                                           "use protocol=http, or start etcd with TLS") from None
        except OSError:
            pass  # silent (a paused server): the backend's requests report it
        return
