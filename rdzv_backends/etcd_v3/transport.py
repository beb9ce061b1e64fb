"""RPCs to etcd's v3 API with failover between endpoints, deadlines and auth tokens.

Each endpoint of the URL gets one gRPC channel with the generated stubs (``etcd3.etcdrpc``); ``etcd3.Client``
is not used (its fixed timeout, endpoint quarantine, one-time token and watch thread do not meet the
deadlines). The retry rules are in ``docs/backends/etcd-v3.md`` ("Failures").
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, TypeVar

from rdzv_core.errors import (
    BackendClosedError,
    BackendConnectionError,
    BackendTimeoutError,
    BackendUnavailableError,
    InvalidURLError,
    KVError,
)

from .._etcd.budget import AttemptDeadline, Tries
from .._etcd.endpoints import Endpoints
from .._etcd.errors import Failure, give_up, transport_error
from .._etcd.settings import EtcdSettings
from .client import etcdrpc, grpc
from .lease_stream import KeepAliveStream
from .streams import AioEndpoint, StreamError
from .watch import WatchStream

__all__ = ["Endpoint", "ServerError", "Transport", "range_request", "txn_request", "put_request"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: gRPC channel options: no 4 MiB cap on answers (a list of large values),
#: quick reconnection after a server restart (gRPC's default backoff grows to 120 s), and HTTP/2
#: keep-alive pings while calls are active, so that a connection whose packets vanish (a partition: no
#: RST) is closed and made again instead of waiting out TCP's retransmission backoff after the heal
#: (seen: 32 s; etcd refuses pings more often than its --grpc-keepalive-min-time, 5 s by default).
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
)
#: Shortest time given to one RPC attempt (seconds).
_MIN_TRY = 0.05
#: Details of ``UNAVAILABLE`` errors that mean the request reached no server.
_NOT_SENT_DETAILS = ("failed to connect", "connection refused", "no leader", "dns resolution failed",
                     "name resolution")
#: Details grpc.aio gives an RPC whose operation failed in the client's gRPC core (a connection that
#: broke under a stream, for one); no server answered it.
_CLIENT_CORE_ERROR = "internal error from core"


def _failure(code: Any, details: str) -> Failure | None:
    """How an RPC failed in transport (a gRPC status code and its details), ``None`` if etcd answered it."""
    name, low = getattr(code, "name", ""), details.lower()
    if name == "DEADLINE_EXCEEDED" or (name == "UNKNOWN" and "deadline exceeded" in low):
        return Failure.TIMED_OUT
    if name == "UNAVAILABLE":
        return Failure.NOT_SENT if any(s in low for s in _NOT_SENT_DETAILS) else Failure.LOST
    if name == "INTERNAL" and low == _CLIENT_CORE_ERROR:  # grpc.aio: a batch failed in the client's core
        return Failure.LOST
    if name == "RESOURCE_EXHAUSTED" and "too many requests" in details:
        return Failure.OVERLOADED
    return None


class Endpoint:
    """One etcd endpoint: a gRPC channel for unary RPCs, the stubs on it, a ``grpc.aio`` channel for the
    streams (made at the first stream, :meth:`streams`), and the watch stream new watches join."""

    def __init__(self, host: str, port: int, settings: EtcdSettings) -> None:
        self.target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._credentials: Any = None
        if settings.protocol == "https":
            key = read_pem(settings.key, "key") if settings.key else read_pem(settings.cert, "cert")  # or one PEM file
            cert = read_pem(settings.cert, "cert")
            self._credentials = grpc.ssl_channel_credentials(read_pem(settings.ca_cert, "cacert"), key, cert)
            self.channel = grpc.secure_channel(self.target, self._credentials, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.stream: WatchStream | None = None  # the watch stream new watches join (see WatchStream)
        self.stream_lock = threading.Lock()
        self._streams: AioEndpoint | None = None
        self._streams_lock = threading.Lock()
        self._lease_stream: KeepAliveStream | None = None
        self._closed = False

    def streams(self) -> AioEndpoint:
        """The endpoint's ``grpc.aio`` channel and stubs (:mod:`.streams`), made at the first call.

        Raises:
            ValueError: the endpoint was closed (as gRPC raises for an RPC on a closed channel).
        """
        with self._streams_lock:
            if self._closed:
                raise ValueError("Cannot invoke RPC on closed channel!")
            if self._streams is None:
                self._streams = AioEndpoint(self.target, self._credentials, _CHANNEL_OPTIONS)
            return self._streams

    def lease_stream(self, metadata: Any) -> KeepAliveStream:
        """The endpoint's keep-alive stream for ``metadata`` (a new one after a failure or a new auth token).

        Raises:
            ValueError: the endpoint was closed.
        """
        stub = self.streams().lease
        with self._streams_lock:
            stream = self._lease_stream
            if stream is None or stream.failure is not None or stream.metadata != metadata:
                if stream is not None:
                    stream.close()
                stream = self._lease_stream = KeepAliveStream(stub, self.target, metadata)
            return stream

    def close(self) -> None:
        """Close both channels: every stream on them fails, and so do their callers' calls."""
        with self._streams_lock:
            self._closed = True
            streams, self._streams = self._streams, None
        self.channel.close()
        if streams is not None:
            streams.close()


def read_pem(path: str | None, field_name: str) -> bytes | None:
    """The bytes of a TLS file for gRPC (``None`` for no path); ``InvalidURLError`` if it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidURLError(field_name, path, f"cannot read: {exc.strerror}") from None


class ServerError(KVError):
    """etcd answered an RPC with an error status (``code`` is the gRPC status name)."""

    def __init__(self, message: str, code: str, details: str) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


def range_request(key: bytes, range_end: bytes | None = None) -> Any:
    """A linearizable ``Range`` of ``key``, or of ``[key, range_end)`` sorted by key."""
    request = etcdrpc.RangeRequest(key=key)
    if range_end is not None:
        request.range_end = range_end
        request.sort_order = etcdrpc.RangeRequest.ASCEND
        request.sort_target = etcdrpc.RangeRequest.KEY
    return request


def put_request(key: bytes, value: bytes, lease: int) -> Any:
    """A ``Put`` of ``value`` at ``key`` on ``lease`` (0: none), answering the previous key-value."""
    return etcdrpc.PutRequest(key=key, value=value, lease=lease, prev_kv=True)


def txn_request(compare: Any, success: Any, key: bytes) -> Any:
    """``if compare: success (a put or delete request) else: range(key)``."""
    op = (etcdrpc.RequestOp(request_put=success) if isinstance(success, etcdrpc.PutRequest)
          else etcdrpc.RequestOp(request_delete_range=success))
    return etcdrpc.TxnRequest(compare=[compare.build_message()], success=[op],
                              failure=[etcdrpc.RequestOp(request_range=range_request(key))])


class Transport:
    """The RPCs of one backend object, over every endpoint of its URL (thread-safe).

    Args:
        settings: endpoints, TLS, credentials and ``operation_timeout``.
        check_open: raises :class:`~rdzv_core.errors.BackendClosedError` once the backend is closed.
        is_closed: whether the backend has been closed (a failure then raises ``BackendClosedError``).
    """

    def __init__(self, settings: EtcdSettings, check_open: Callable[[], None], is_closed: Callable[[], bool]) -> None:
        self.settings = settings
        self._check_open = check_open
        self._is_closed = is_closed
        self.endpoints = Endpoints(len(settings.endpoints))
        self.eps = [Endpoint(host, port, settings) for host, port in settings.endpoints]
        self._token: str | None = None
        self._token_lock = threading.Lock()
        self.seen = 0  # the highest header revision answered so far (see Tries)

    def tries(self) -> Tries:
        """A :class:`~rdzv_backends._etcd.budget.Tries` for a compare-guarded transaction sent now."""
        return Tries(self.seen)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The gRPC metadata of an RPC: the auth token, if any."""
        token = self._token
        return None if token is None else (("token", token),)

    def authenticate(self, deadline: AttemptDeadline) -> None:
        """Get a fresh auth token for the URL's user (thread-safe)."""
        request = etcdrpc.AuthenticateRequest(name=self.settings.username, password=self.settings.password or "")
        with self._token_lock:
            try:
                answer = self.call(lambda ep, t, md: ep.auth.Authenticate(request, timeout=t), deadline,
                                   what="authenticate", reauth=False)
            except ServerError as exc:
                if "authentication is not enabled" in exc.details:
                    log.warning("etcd at %s has authentication disabled; ignoring the URL's user %r",
                                self.settings.describe(), self.settings.username)
                    self._token = None
                    return
                raise InvalidURLError(
                    "username", self.settings.username, f"etcd rejected the user or password: {exc.details}"
                ) from None
            self._token = answer.token

    def call(
        self,
        rpc: Callable[[Endpoint, float, Any], T],
        deadline: AttemptDeadline,
        *,
        what: str,
        reauth: bool = True,
        tries: Tries | None = None,
        resend: bool = True,
    ) -> T:
        """Run ``rpc(endpoint, timeout, metadata)`` on the endpoints in turn until ``deadline``.

        Each attempt gets :meth:`~rdzv_backends._etcd.budget.AttemptDeadline.attempt` seconds; every transport
        failure is retried.

        Args:
            what: what the RPC does, for error messages.
            tries: for a compare-guarded transaction: marked when an attempt failed
                after it may have reached etcd (see :class:`~rdzv_backends._etcd.budget.Tries`).
            reauth: renew the auth token once if etcd reports it invalid.
            resend: ``False``: no attempt after one that may have reached etcd (a write that must not be
                applied twice, such as a ticket's put); the call raises ``BackendTimeoutError`` instead.

        Raises:
            BackendConnectionError, BackendTimeoutError: no endpoint answered in time (see ``errors.give_up``).
            InvalidURLError: etcd requires a user and the URL names none.
            ServerError: etcd answered with another error status.
        """
        last: BackendUnavailableError | None = None
        refused = True  # every failure so far reached no server
        tried = False  # every call makes at least one attempt, even with no time left
        while True:
            for index in self.endpoints.order():
                self._check_open()
                if not resend and tries is not None and tries.maybe_applied:
                    raise BackendTimeoutError(f"etcd {what}: an attempt may have reached etcd and no answer came; "
                                         "not sent again") from last
                per_try = deadline.attempt()
                if per_try <= 0 and tried:
                    break
                tried = True
                ep = self.eps[index]
                try:
                    answer = rpc(ep, max(per_try, _MIN_TRY), self.metadata())
                except (grpc.RpcError, StreamError) as exc:
                    if self._is_closed():
                        raise BackendClosedError(f"EtcdV3Backend was closed during {what}") from None
                    code, details = exc.code(), exc.details() or ""
                    failure = _failure(code, details)
                    if failure is None:  # an answer from etcd, not a transport failure
                        if reauth and code == grpc.StatusCode.UNAUTHENTICATED and self.settings.username:
                            self.authenticate(deadline)
                            reauth = False
                            last = BackendConnectionError(f"etcd at {ep.target}: {details}")
                            continue
                        if "user name is empty" in details:
                            raise InvalidURLError(
                                "username", None, f"etcd at {ep.target} requires authentication: "
                                "add USER:PASSWORD@ before the host in the URL"
                            ) from None
                        raise ServerError(f"etcd at {ep.target} refused {what}: {details}", code.name,
                                          details) from None
                    self.endpoints.failed(index)
                    deadline.failed()
                    if failure is Failure.TIMED_OUT:
                        deadline.timed_out()
                    last = error = transport_error(failure, f"etcd at {ep.target}", what, details)
                    sent = failure is not Failure.NOT_SENT
                    refused = refused and not sent
                    if sent and tries is not None:
                        tries.maybe_applied = True
                    log.debug("%s", error)  # one line per failed attempt; the caller sees the error
                    continue
                except ValueError:  # gRPC: "Cannot invoke RPC on closed channel!"
                    if self._is_closed():
                        raise BackendClosedError(f"EtcdV3Backend was closed during {what}") from None
                    raise
                self.endpoints.worked(index)
                header = getattr(answer, "header", None)
                if header is not None and header.revision > self.seen:
                    self.seen = int(header.revision)  # unlocked: a lost update only makes Tries.seen more cautious
                return answer
            if not deadline.backoff():
                raise give_up(self.settings, what, last, refused=refused, tries=tries) from None

    def open_streams(self) -> None:
        """Make the preferred endpoint's stream channel now (it connects in the background), so that the
        first watch finds a connection made while the server answered (a silent server then gives a quiet
        watch, as on the unary channel, not a connection timeout)."""
        self.eps[self.endpoints.order()[0]].streams()

    def close(self) -> None:
        """Close every channel: fails every watch stream, whose callers raise ``BackendClosedError``."""
        for ep in self.eps:
            ep.close()
