"""One plain ``GET /version`` per endpoint at open (``protocol=http``): is it etcd, and does it speak TLS?

etcd serves ``GET /version`` over HTTP/1 on its client port (for the v2 and the v3 API alike) and answers
``{"etcdserver": "3.5.1", ...}``. Without this probe, gRPC retries a TLS-only etcd ("Socket closed") or an
HTTP server that is not etcd ("Failed parsing HTTP/2") until ``operation_timeout``, and ``python-etcd``
meets a TLS-only etcd as "Remote end closed connection" after as long. Both backends use it, and
:func:`etcd_version` reads the answer for ``etcd-v2``'s own check of an etcd without the v2 API too.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from typing import TYPE_CHECKING

from rdzv_core.errors import InvalidURLError

from .._tls import where as _where

if TYPE_CHECKING:
    from .budget import AttemptDeadline
    from .settings import EtcdSettings

__all__ = ["etcd_version", "not_etcd", "probe_http", "PROBE_SECONDS"]

#: Longest one endpoint's probe may take (seconds): an endpoint silent that long is left to the backend's
#: requests (which report it); etcd answers ``/version`` in about a millisecond.
PROBE_SECONDS = 1.0


def etcd_version(status: int, body: bytes) -> str | None:
    """etcd's server version from an answer to ``GET /version`` (``None``: not etcd's answer)."""
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if status == 200 and isinstance(parsed, dict) and "etcdserver" in parsed:
        return str(parsed["etcdserver"])
    return None


def answered(status: int, body: bytes) -> str:
    """What a non-etcd server answered to ``GET /version``, for messages."""
    first_line = body.split(b"\n", 1)[0][:60]
    return f"HTTP {status} {first_line!r}"


def not_etcd(host: str, port: int, base_uri: str, what: str) -> InvalidURLError:
    """The error for a server at ``host:port`` that answered ``GET /version`` with ``what``, not etcd's version."""
    return InvalidURLError(
        "host", _where(host, port),
        f"the server at {base_uri} is not etcd: GET /version answered {what}, not etcd's version; check the URL's "
        "host and port (etcd's client port is 2379)",
    )


def _speaks_tls(host: str, port: int, seconds: float) -> bool:
    """Whether ``host:port`` answers a TLS ClientHello (a handshake that completes, or ends in an alert)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only: does it speak TLS at all
    try:
        with socket.create_connection((host, port), timeout=seconds) as raw, \
                context.wrap_socket(raw, server_hostname=host):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or exc).upper()  # a TLS server's refusal (a client certificate...)
    except OSError:
        return False


def probe_http(settings: EtcdSettings, deadline: AttemptDeadline) -> list[int]:
    """At open, for ``protocol=http``: ``GET /version`` on every endpoint (at most :data:`PROBE_SECONDS` each).

    Endpoints that refuse the connection, cannot be reached or stay silent are skipped: the backend's own
    requests report them. The probe takes its time from ``deadline`` (the open's).

    Returns:
        the indexes (into ``settings.endpoints``) of the endpoints that answered as etcd, in order (``[]`` for
        ``protocol=https``): the backend sends its first request to one of them, not again to a silent one.

    Raises:
        InvalidURLError: on ``protocol``: an endpoint closes a plain HTTP request unanswered (or answers
            garbage) and speaks TLS; on ``host``: an endpoint answers HTTP, but not as etcd.
    """
    answered_by: list[int] = []
    if settings.protocol != "http":
        return answered_by
    for index, (host, port) in enumerate(settings.endpoints):
        seconds = min(deadline.attempt(), PROBE_SECONDS)
        if seconds <= 0:
            return answered_by
        at = _where(host, port)
        conn = http.client.HTTPConnection(host, port, timeout=seconds)
        try:
            conn.request("GET", "/version", headers={"Connection": "close"})
            response = conn.getresponse()
            status, body = response.status, response.read(65536)
        except (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError,
                BrokenPipeError) as exc:  # closed unanswered, or garbage: a TLS port?
            if _speaks_tls(host, port, min(deadline.attempt(), PROBE_SECONDS)):
                raise InvalidURLError(
                    "protocol", "http", f"the server at {at} speaks TLS (a plain HTTP request got no answer: "
                    f"{type(exc).__name__}): add protocol=https (and cacert=PATH, cert=PATH&key=PATH as it needs)"
                ) from None
            continue
        except (OSError, http.client.HTTPException):
            continue  # refused, unreachable or silent: the backend's requests report it
        finally:
            conn.close()
        if etcd_version(status, body) is None:
            raise not_etcd(host, port, f"http://{at}", answered(status, body))
        answered_by.append(index)
    return answered_by
