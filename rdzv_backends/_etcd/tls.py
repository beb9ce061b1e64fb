"""TLS for the etcd backends: the URL's TLS files checked with Python's ``ssl``, and one handshake at open.

:func:`tls_context` runs when the URL is parsed; :func:`check_tls` at open names a ``cacert`` that does not
sign the server's certificate, or a ``cert`` the server refuses, as :class:`~rdzv_core.errors.InvalidURLError`
at once (gRPC would retry such a handshake until ``operation_timeout``; urllib3's error names neither file).
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING, Protocol

from rdzv_core.errors import InvalidURLError

if TYPE_CHECKING:
    from .budget import Deadline

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


class _PassphraseAsked(Exception):
    """OpenSSL asked for the passphrase of an encrypted key (never prompt on the terminal)."""


def _no_passphrase() -> bytes:
    raise _PassphraseAsked


def _read_pem(field_name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidURLError(field_name, path, f"cannot read the file: {exc.strerror}") from None


def _load_certificates(context: ssl.SSLContext, field_name: str, path: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise InvalidURLError(field_name, path, f"holds no PEM certificate (-----BEGIN CERTIFICATE-----): "
                                                f"{exc.reason or exc}") from None


def tls_context(ca_cert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A client ``SSLContext`` from the TLS query values, each file checked (``ssl`` module).

    Raises:
        InvalidURLError: naming ``cacert``, ``cert`` or ``key`` and the file: it
            cannot be read, is not PEM, the certificate has no private key (in
            its own file or in ``key``), the key does not match it, or the key
            is encrypted (gRPC and urllib3 take no passphrase).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server and its host name
    if ca_cert is None:
        context.load_default_certs()
    else:
        _read_pem("cacert", ca_cert)
        _load_certificates(context, "cacert", ca_cert)  # only these, as gRPC's root_certificates
    if cert is None:
        return context
    _read_pem("cert", cert)
    _load_certificates(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), "cert", cert)
    if key is None:
        if b"PRIVATE KEY-----" not in _read_pem("cert", cert):
            raise InvalidURLError("key", None, f"the client certificate cert={cert} holds no private key: add "
                                               "key=PATH (its PEM private key), or give one PEM file with both")
    elif b"PRIVATE KEY-----" not in _read_pem("key", key):
        raise InvalidURLError("key", key, "holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)")
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except _PassphraseAsked:
        raise InvalidURLError("key", key or cert, "the private key is encrypted, and no passphrase can be "
                                                  "given: decrypt it (openssl pkey -in KEY -out PLAIN)") from None
    except ssl.SSLError as exc:
        why = (f"does not match the certificate cert={cert}" if exc.reason == "KEY_VALUES_MISMATCH"
               else f"is not a usable private key for cert={cert}: {exc.reason or exc}")
        raise InvalidURLError("key", key or cert, why) from None
    return context


#: TLS alerts (``ssl`` reasons ``..._ALERT_...``) by which a server refuses the client's certificate or its lack.
_CERT_REFUSED = ("BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_REQUIRED", "CERTIFICATE_UNKNOWN",
                 "UNSUPPORTED_CERTIFICATE", "CERTIFICATE_EXPIRED", "CERTIFICATE_REVOKED")


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


def check_tls(settings: TLSSettings, deadline: Deadline) -> None:
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
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            raw = socket.create_connection((host, port), timeout=seconds)
        except OSError:
            continue  # not reachable now: the backend's requests report it
        try:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                # TLS 1.3 servers judge the client certificate after the client's handshake: ask for an answer.
                tls.sendall(f"GET /version HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n".encode())
                tls.recv(1)
        except ssl.SSLCertVerificationError as exc:
            detail = exc.verify_message or exc.reason
            if exc.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
                raise InvalidURLError("host", host, f"the TLS certificate of the server at {where} is not for "
                                                    f"this host ({detail})") from None
            trusted = f"by cacert={settings.ca_cert}" if settings.ca_cert else "by the system's CAs (add cacert=PATH)"
            raise InvalidURLError("cacert", settings.ca_cert, f"the TLS certificate of the server at {where} is not "
                                                              f"signed {trusted}: {detail}") from None
        except (ssl.SSLError, ConnectionError) as exc:
            reason = str(getattr(exc, "reason", None) or exc)
            if "ALERT_" in reason.upper() and any(r in reason.upper() for r in _CERT_REFUSED):
                if settings.cert is None:
                    raise InvalidURLError("cert", None, f"the server at {where} demands a client certificate "
                                                        f"({reason}): add cert=PATH&key=PATH") from None
                raise InvalidURLError("cert", settings.cert, f"the server at {where} refused this client certificate "
                                                             f"({reason}): is it signed by a CA the server trusts "
                                                             "(etcd's --trusted-ca-file)?") from None
            if _plain_http(host, port, where, deadline.attempt()):
                raise InvalidURLError("protocol", "https", f"the server at {where} does not speak TLS ({reason}): "
                                                           "use protocol=http, or start etcd with TLS") from None
        except OSError:
            pass  # silent (a paused server): the backend's requests report it
        finally:
            raw.close()
        return
