"""TLS checks shared by the backends that speak TLS (``etcd-v2://``, ``etcd-v3://``, ``rediss://``), with ``ssl``.

:func:`tls_context` checks a URL's TLS files when the URL is parsed (readable, PEM, a private key that matches
the certificate — in ``key`` or in the certificate's own file — and is not encrypted). :func:`handshake` runs
one TLS handshake and one request at open, and :func:`refused_certificate` reads from its failure whether the
server refused the client certificate (or demands one) with a TLS alert: a client library reports that as a
lost connection (or retries it until its deadline). No client library is imported here.
"""

from __future__ import annotations

import socket
import ssl

from rdzv_core.errors import InvalidURLError

__all__ = ["tls_context", "read_pem", "handshake", "refused_certificate", "certificate_error", "where"]


class _PassphraseAsked(Exception):
    """OpenSSL asked for the passphrase of an encrypted key (never prompt on the terminal)."""


def _no_passphrase() -> bytes:
    raise _PassphraseAsked


def read_pem(field_name: str, path: str) -> bytes:
    """The bytes of a TLS file; :class:`InvalidURLError` naming ``field_name`` if it cannot be read."""
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

    ``cert`` without ``key`` is one PEM file holding the certificate and its private key.

    Raises:
        InvalidURLError: naming ``cacert``, ``cert`` or ``key`` and the file: it
            cannot be read, is not PEM, the certificate has no private key (in
            its own file or in ``key``), the key does not match it, or the key
            is encrypted (no client here takes a passphrase).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server and its host name
    if ca_cert is None:
        context.load_default_certs()
    else:
        read_pem("cacert", ca_cert)
        _load_certificates(context, "cacert", ca_cert)  # only these, as gRPC's root_certificates
    if cert is None:
        return context
    read_pem("cert", cert)
    _load_certificates(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), "cert", cert)
    if key is None:
        if b"PRIVATE KEY-----" not in read_pem("cert", cert):
            raise InvalidURLError("key", None, f"the client certificate cert={cert} holds no private key: add "
                                               "key=PATH (its PEM private key), or give one PEM file with both")
    elif b"PRIVATE KEY-----" not in read_pem("key", key):
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


def where(host: str, port: int) -> str:
    """``host:port`` (``[host]:port`` for an IPv6 address), for messages."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def handshake(context: ssl.SSLContext, raw: socket.socket, host: str, request: bytes) -> bytes:
    """A TLS handshake on the connected socket ``raw``, then ``request`` sent; the first bytes answered.

    A TLS 1.3 server judges the client certificate after the client's part of the handshake, so its
    refusal (an alert) comes with the answer to the first request: that is read even when sending failed.

    Raises:
        ssl.SSLError, OSError: as the handshake, the request or the answer failed (see
            :func:`refused_certificate`); the socket is closed either way.
    """
    try:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            try:
                tls.sendall(request)
            except (ssl.SSLError, OSError):
                tls.recv(1)  # the alert that closed the connection, if it came: raises it
                raise
            return tls.recv(1)
    finally:
        raw.close()


#: TLS alerts (``ssl`` reasons ``..._ALERT_...``) by which a server refuses the client's certificate or its lack.
_CERT_REFUSED = ("BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_REQUIRED", "CERTIFICATE_UNKNOWN",
                 "UNSUPPORTED_CERTIFICATE", "CERTIFICATE_EXPIRED", "CERTIFICATE_REVOKED")


def refused_certificate(exc: BaseException | None, cert_given: bool = True) -> str | None:
    """The alert's reason if ``exc`` (or an exception it came from) is a TLS alert refusing the client certificate.

    Without a client certificate (``cert_given=False``) a ``handshake_failure`` alert counts too: OpenSSL
    servers (Redis) send it under TLS 1.2 to a client that sent no certificate when one is demanded.
    """
    refusals = _CERT_REFUSED if cert_given else (*_CERT_REFUSED, "HANDSHAKE_FAILURE")
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    # ssl's own errors first (their reason is the alert's name), then any message quoting one (redis-py's)
    for error in sorted(chain, key=lambda e: not isinstance(e, ssl.SSLError)):
        reason = str(getattr(error, "reason", None) or error)
        if "ALERT_" in reason.upper() and any(r in reason.upper() for r in refusals):
            return reason
    return None


def certificate_error(at: str, cert: str | None, reason: str, trusted_ca_option: str) -> InvalidURLError:
    """The error for a server at ``at`` that refused the client certificate ``cert`` (``None``: it demands one).

    Args:
        reason: the alert (:func:`refused_certificate`).
        trusted_ca_option: the server's option naming the CAs it trusts, e.g. ``"etcd's --trusted-ca-file"``.
    """
    if cert is None and "HANDSHAKE_FAILURE" in reason.upper():
        return InvalidURLError("cert", None, f"the server at {at} ended the TLS handshake ({reason}): it may demand "
                                             "a client certificate: add cert=PATH&key=PATH")
    if cert is None:
        return InvalidURLError("cert", None, f"the server at {at} demands a client certificate ({reason}): add "
                                             "cert=PATH&key=PATH")
    return InvalidURLError("cert", cert, f"the server at {at} refused this client certificate ({reason}): is it "
                                         f"signed by a CA the server trusts ({trusted_ca_option})?")
