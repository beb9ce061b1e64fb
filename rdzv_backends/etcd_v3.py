"""``etcd-v3://`` (alias ``etcd3://``) — etcd's v3 gRPC API (client: ``python3-etcd3``).

::

    etcd-v3://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/RUN_ID?protocol=https&cacert=...&cert=...&key=...

Query keys are described in :mod:`rdzv_backends._etcd_common`. The backend
speaks gRPC through ``python3-etcd3``'s generated stubs (``etcd3.etcdrpc``) and
comparison helpers (``etcd3.transactions``); it does not use that package's
high-level client, whose fixed per-client timeout, five-minute endpoint
quarantine, one-time auth token and watch thread do not meet the deadlines
below.

Mapping of the KV protocol onto v3 (``kv.py`` has the contract):

Keys and values
    Key ``a/b`` is the v3 key ``/a/b`` (UTF-8); values are stored as they are.
    A prefix is the key range ``["/" + prefix, "/" + prefix + 1)``. Keys under
    ``/`` that are not valid keys (written by other programs) are ignored by
    ``list`` and ``watch``. With etcd auth, grant the URL's user ``readwrite``
    on the key prefix it uses, e.g.
    ``etcdctl role grant-permission R --prefix=true readwrite /torchelastic/``.
Revisions
    ``Entry.revision`` is the key's ``mod_revision``; ``list`` returns the
    answer's ``header.revision``.
Reads
    ``get`` and ``list`` are linearizable ``Range`` requests. Concurrent calls
    of the same ``get`` or ``list`` through one backend object (threads
    sharing a client) share requests, each answered by one sent after it was
    called (:class:`~rdzv_backends._etcd_common.ReadCoalescer`).
Writes
    ``create`` is a transaction ``version(key) == 0 -> put``; ``compare_and_swap``
    and ``compare_and_delete`` are transactions on ``mod_revision(key) ==
    expected``. ``add`` is one transaction per attempt, ``if mod_revision ==
    R: put(value + delta) else: range(key)``: a lost race answers the current
    value and revision, and the next attempt is sent at once (no read, no
    sleep while other writers make progress; jittered backoff only for
    failures without progress), until ``operation_timeout``. The key keeps
    its lease. Concurrent ``add`` calls on one key through one backend object
    (threads sharing a client) are combined into one transaction of their
    summed deltas (:class:`~rdzv_backends._etcd_common.AddCombiner`), so
    watchers may see one ``PUT`` for several adds.
Value size
    Values up to :data:`~rdzv_backends._etcd_common.MAX_VALUE_BYTES` (1 MiB,
    ``max_value_bytes``) are accepted; a server started with a lower
    ``--max-request-bytes`` refuses larger writes, raised as
    :class:`~rdzv_core.errors.ValueTooLarge` naming the key and the size.
Corrupt data
    A non-decimal value at a key given to ``add`` raises
    :class:`~rdzv_core.errors.CorruptEntry` naming the key, having written
    nothing; ``delete`` removes it like any key.
TTL: one lease per key
    A write with a TTL grants a new lease of ``ceil(ttl)`` seconds (at least 1)
    and attaches the key to it; the key's previous lease, if any, is revoked.
    ``refresh(key, ttl)`` sends one keep-alive for exactly that key's lease, so
    it renews that key and no other. Leases are never shared between keys:
    with a per-agent lease, the death of the agent that created a shared key
    (such as the rendezvous round record) would delete it for everyone. If
    ``refresh`` asks for a TTL other than the lease's granted TTL, the key is
    re-put with the same value on a new lease of the asked TTL (in a
    transaction on its ``mod_revision``): this advances the key's revision and,
    unlike a keep-alive, is seen by watchers as a ``PUT`` of the unchanged value.
    etcd's shortest lease is ``ceil(1.5 * election timeout)`` seconds (2 s with
    the default 1000 ms), and leases are checked for expiry every 500 ms: an
    expiry is seen up to 2.5 s after the requested TTL (``ttl_resolution``;
    measured up to 1.45 s on a server whose minimum lease is 1 s).
Watch
    All watches of a backend object share ONE gRPC watch stream per endpoint
    (:class:`_WatchStream`): a call sends a ``WatchCreateRequest`` from
    ``after_revision + 1`` on the prefix range and waits, until its own
    timeout, for the stream's dispatcher thread to hand it the first events;
    calls of the same range and ``after_revision`` share one server watch. A
    watch no call waits on any more is cancelled on the server. A watch below
    the compaction point answers ``compact_revision``, raised as
    :class:`~rdzv_core.errors.HistoryCompacted`; another cancellation by etcd
    raises :class:`~rdzv_core.errors.KVError` with its reason. A failed stream
    wakes every call on it, which retries on a new stream (see "Failures").
Failures
    Each operation has ``operation_timeout`` seconds (query key, default 10),
    shared by the attempts of its RPCs: one attempt may take
    ``max(0.5, operation_timeout / 3)`` seconds, twice that after an attempt
    ran out of time (:meth:`~rdzv_backends._etcd_common.Deadline.attempt`),
    because a member can hold a request for etcd's own request timeout (5 s
    and more: a write or linearizable read sent to a follower just after the
    leader died waits for the dead leader) while a new leader serves within
    about a second. A failed attempt moves to the next endpoint and, after a
    round of failures, the RPC is retried with jittered backoff until the
    deadline. Connection refused everywhere raises one
    :class:`~rdzv_core.errors.BackendConnectionError` naming every endpoint;
    other failures raise the last attempt's ``BackendTimeout`` /
    ``BackendConnectionError`` (each failed attempt is one DEBUG line of this
    module's logger).

    Every RPC is retried, also after an attempt that may have been applied
    (deadline exceeded, connection lost, leader changed): reads, ``put``,
    ``delete``, lease grants (a lease granted twice just runs out unused) and
    keep-alives may be repeated. A transaction (``create``, the compare-and-*
    writes, ``add``, ``refresh``'s re-put) cannot be applied twice -- a
    repetition meets the first one's result as a failed compare -- and reads
    such an answer with :class:`~rdzv_backends._etcd_common.Tries`: a success,
    or a failed compare on state older than the request, is the plain answer.
    A write that gave a TTL recognises its own result for certain (the key is
    on the write's new lease), one without a TTL when the key is newer than
    the request, holds the written value and no lease (for ``create``:
    ``version`` 1) -- a concurrent write of the very same value passes as
    well. Every other failed compare newer than the request -- for
    ``compare_and_delete`` and ``add`` every one, as no state proves their own
    write and ``add`` must not count twice -- raises ``BackendTimeout`` saying
    that the write may or may not have taken effect.

    A watch retries a lost stream for ``operation_timeout`` seconds from the
    failure (never past its own timeout). gRPC reconnects within 1 s of a
    server's return (its default backoff would grow to 2 minutes).
Auth
    ``USER:PASSWORD@`` in the URL authenticates against etcd's v3 auth; the
    token is renewed when etcd reports it invalid. The password never appears
    in logs, ``repr`` or error messages.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, NamedTuple, TypeVar

from rdzv_core.errors import (
    BackendClosed,
    BackendConnectionError,
    BackendTimeout,
    BackendUnavailable,
    CompareFailed,
    InvalidURLError,
    KeyExists,
    KeyNotFound,
    KVError,
    ValueTooLarge,
)
from rdzv_core.kv import call_budget, Capabilities, Entry, Event, KVBackend, parse_counter
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL

from ._etcd_v3_watch import _key, _StreamError, _WatchStream
from ._etcd_common import (
    DEFAULT_PORT,
    MAX_VALUE_BYTES,
    QUERY_KEYS,
    AddCombiner,
    Deadline,
    Endpoints,
    EtcdSettings,
    FailureBudget,
    RaceRetry,
    ReadCoalescer,
    Tries,
    check_tls,
    may_have_applied,
    ttl_seconds,
    unreachable,
)

__all__ = ["EtcdV3Backend", "plugin"]

#: Refreshes (a Range and a LeaseKeepAlive stream each) one client runs at once; more wait their turn.
REFRESH_CONCURRENCY = 32

log = logging.getLogger(__name__)

T = TypeVar("T")

#: gRPC channel options: no 4 MiB cap on answers (a list of large values),
#: and quick reconnection after a server restart (gRPC's default backoff grows to 120 s).
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
#: Shortest time given to one RPC attempt (seconds).
_MIN_TRY = 0.05
#: Counters whose last written state ``add`` remembers per backend object.
_COUNTER_CACHE = 1024
#: Details of ``UNAVAILABLE`` errors that mean the request reached no server.
_NOT_SENT_DETAILS = ("failed to connect", "connection refused", "no leader", "dns resolution failed",
                     "name resolution")


class _Counter(NamedTuple):
    """A counter's state as this backend last saw it: value bytes, ``mod_revision``, lease ID (0: none)."""

    value: bytes
    revision: int
    lease: int


def _import_grpc() -> Any:
    """``import grpc``, with gRPC's fork handlers off unless the user set ``GRPC_ENABLE_FORK_SUPPORT``,
    and gRPC's C-core log silent unless the user set ``GRPC_VERBOSITY`` or ``GRPC_TRACE``.

    The agent forks its workers (``subprocess`` with a ``preexec_fn``) while a round watch
    stream is open; gRPC's handlers then ran in the child and aborted about 1 in 5 loaded
    worker starts (SIGABRT, "epoll_wait error: Bad file descriptor"). The child only execs,
    so it needs none of them. The C-core log printed dozens of lines to stderr per failed TLS
    handshake; every failure it reports is in this backend's errors.
    """
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    if "GRPC_VERBOSITY" not in os.environ and "GRPC_TRACE" not in os.environ:
        os.environ["GRPC_VERBOSITY"] = "NONE"
    import grpc

    return grpc


class _Endpoint:
    """One etcd endpoint: a gRPC channel and the stubs on it."""

    def __init__(self, host: str, port: int, settings: EtcdSettings) -> None:
        grpc = _import_grpc()
        from etcd3 import etcdrpc

        self.target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if settings.protocol == "https":
            key = _read(settings.key, "key") if settings.key else _read(settings.cert, "cert")  # or one PEM file
            creds = grpc.ssl_channel_credentials(_read(settings.ca_cert, "cacert"), key, _read(settings.cert, "cert"))
            self.channel = grpc.secure_channel(self.target, creds, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.stream: _WatchStream | None = None  # the watch stream new watches join (see _WatchStream)
        self.stream_lock = threading.Lock()


def _read(path: str | None, field_name: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidURLError(field_name, path, f"cannot read: {exc.strerror}") from None


class _ServerError(KVError):
    """etcd answered an RPC with an error status (``code`` is the gRPC status name)."""

    def __init__(self, message: str, code: str, details: str) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class EtcdV3Backend(KVBackend):
    """KV backend on etcd's v3 API; see the module docstring for the mapping.

    Args:
        settings: endpoints, TLS, credentials and ``operation_timeout``.

    Raises:
        InvalidURLError: etcd rejected the user or password; a TLS file cannot
            be used, or the server's TLS handshake refuses it (see
            :func:`~rdzv_backends._etcd_common.check_tls`).
        BackendConnectionError, BackendTimeout: no endpoint answered within
            ``operation_timeout`` seconds.
    """

    capabilities = Capabilities(
        multi_host=True,
        server_side_ttl=True,
        native_watch=True,
        persistent=True,
        tls=True,
        auth=True,
        max_value_bytes=MAX_VALUE_BYTES,
        ttl_resolution=2.5,
    )

    def __init__(self, settings: EtcdSettings) -> None:
        grpc = _import_grpc()
        from etcd3 import etcdrpc, transactions

        self._grpc = grpc
        self._rpc = etcdrpc
        self._cmp = transactions
        self.settings = settings
        self._endpoints = Endpoints(len(settings.endpoints))
        opening = Deadline(settings.operation_timeout)
        check_tls(settings, opening)  # a wrong cacert or cert at once: gRPC retries its handshake until the deadline
        self._eps = [_Endpoint(host, port, settings) for host, port in settings.endpoints]
        self._token: str | None = None
        self._seen = 0  # the highest header revision answered so far (see Tries)
        self._min_ttl = 0  # etcd's minimum lease TTL (seconds), once a grant revealed it
        self._token_lock = threading.Lock()
        self._adds = AddCombiner()
        self._reads = ReadCoalescer()
        self._counters: dict[str, _Counter] = {}  # key -> state last written by add (see _add_once)
        self._refresh_slots = threading.BoundedSemaphore(REFRESH_CONCURRENCY)
        try:
            if settings.username is not None:
                self._authenticate(Deadline(settings.operation_timeout))
            self._call(lambda ep, t, md: ep.maintenance.Status(etcdrpc.StatusRequest(), timeout=t, metadata=md),
                       opening, what="status")
        except BaseException:
            self._do_close()
            raise

    def __repr__(self) -> str:
        return f"EtcdV3Backend({self.settings.describe()!r})"

    # -- transport ---------------------------------------------------------------
    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = self._token
        return None if token is None else (("token", token),)

    def _authenticate(self, deadline: Deadline) -> None:
        """Get a fresh auth token for the URL's user (thread-safe)."""
        request = self._rpc.AuthenticateRequest(name=self.settings.username, password=self.settings.password or "")
        with self._token_lock:
            try:
                answer = self._call(lambda ep, t, md: ep.auth.Authenticate(request, timeout=t), deadline,
                                    what="authenticate", reauth=False)
            except _ServerError as exc:
                if "authentication is not enabled" in exc.details:
                    log.warning("etcd at %s has authentication disabled; ignoring the URL's user %r",
                                self.settings.describe(), self.settings.username)
                    self._token = None
                    return
                raise InvalidURLError(
                    "username", self.settings.username, f"etcd rejected the user or password: {exc.details}"
                ) from None
            self._token = answer.token

    def _call(
        self,
        rpc: Callable[[_Endpoint, float, Any], T],
        deadline: Deadline,
        *,
        what: str,
        reauth: bool = True,
        tries: Tries | None = None,
    ) -> T:
        """Run ``rpc(endpoint, timeout, metadata)`` on the endpoints in turn until ``deadline``.

        Each attempt gets :meth:`~rdzv_backends._etcd_common.Deadline.attempt`
        seconds; every transport failure is retried (see "Failures" in the
        module docstring).

        Args:
            what: what the RPC does, for error messages.
            tries: for a compare-guarded transaction: marked when an attempt failed
                after it may have reached etcd (see :class:`~rdzv_backends._etcd_common.Tries`).
            reauth: renew the auth token once if etcd reports it invalid.

        Raises:
            BackendConnectionError, BackendTimeout: see the module docstring.
            _ServerError: etcd answered with another error status.
        """
        grpc = self._grpc
        last: BackendUnavailable | None = None
        refused = True  # every failure so far reached no server
        tried = False  # every call makes at least one attempt, even with no time left
        while True:
            for index in self._endpoints.order():
                self._check_open()
                per_try = deadline.attempt()
                if per_try <= 0 and tried:
                    break
                tried = True
                ep = self._eps[index]
                try:
                    answer = rpc(ep, max(per_try, _MIN_TRY), self._metadata())
                except (grpc.RpcError, _StreamError) as exc:
                    if self._closed:
                        raise BackendClosed(f"{type(self).__name__} was closed during {what}") from None
                    code, details = exc.code(), exc.details() or ""
                    error = self._classify(ep, code, details, what)
                    if error is None:  # an answer from etcd, not a transport failure
                        if reauth and code == grpc.StatusCode.UNAUTHENTICATED and self.settings.username:
                            self._authenticate(deadline)
                            reauth = False
                            last = BackendConnectionError(f"etcd at {ep.target}: {details}")
                            continue
                        if "user name is empty" in details:
                            raise InvalidURLError(
                                "username", None, f"etcd at {ep.target} requires authentication: "
                                "add USER:PASSWORD@ before the host in the URL"
                            ) from None
                        raise _ServerError(f"etcd at {ep.target} refused {what}: {details}", code.name,
                                           details) from None
                    self._endpoints.failed(index)
                    deadline.failed()
                    if _deadline_exceeded(code, details):
                        deadline.timed_out()
                    last = error
                    sent = not _not_sent(code, details)
                    refused = refused and not sent
                    if sent and tries is not None:
                        tries.maybe_applied = True
                    log.debug("%s", error)  # one line per failed attempt; the caller sees the error
                    continue
                except ValueError:  # gRPC: "Cannot invoke RPC on closed channel!"
                    if self._closed:
                        raise BackendClosed(f"{type(self).__name__} was closed during {what}") from None
                    raise
                self._endpoints.worked(index)
                header = getattr(answer, "header", None)
                if header is not None and header.revision > self._seen:
                    self._seen = int(header.revision)  # unlocked: a lost update only makes Tries.seen more cautious
                return answer
            if last is None:
                last = BackendTimeout(f"no etcd endpoint of {self.settings.describe()} answered {what} in time")
            if not deadline.backoff():
                if refused and isinstance(last, BackendConnectionError):
                    raise BackendConnectionError(unreachable(self.settings, what, last)) from None
                if tries is not None and tries.maybe_applied and "may or may not" not in str(last):
                    raise type(last)(f"{last}; it may or may not have taken effect") from None
                raise last

    def _classify(self, ep: _Endpoint, code: Any, details: str, what: str) -> BackendUnavailable | None:
        """The transport error for a failed RPC, or ``None`` if etcd itself answered."""
        codes = self._grpc.StatusCode
        if _deadline_exceeded(code, details):
            return BackendTimeout(f"etcd at {ep.target} did not answer {what} in time")
        if code == codes.UNAVAILABLE:
            if _not_sent(code, details):
                return BackendConnectionError(f"cannot reach etcd at {ep.target} for {what}: {details}")
            return BackendConnectionError(
                f"etcd at {ep.target} failed during {what} ({details}); it may or may not have taken effect"
            )
        if code == codes.RESOURCE_EXHAUSTED and "too many requests" in details:
            return BackendTimeout(f"etcd at {ep.target} is overloaded: {details}")
        return None

    def _deadline(self) -> Deadline:
        """One operation's deadline: ``operation_timeout``, or the caller's (``rdzv_core.kv.deadline``) if sooner."""
        return Deadline(call_budget(self.settings.operation_timeout))

    # -- request builders ----------------------------------------------------------
    def _range(self, key: bytes, range_end: bytes | None = None) -> Any:
        request = self._rpc.RangeRequest(key=key)
        if range_end is not None:
            request.range_end = range_end
            request.sort_order = self._rpc.RangeRequest.ASCEND
            request.sort_target = self._rpc.RangeRequest.KEY
        return request

    def _txn_request(self, compare: Any, success: Any, key: bytes) -> Any:
        """``if compare: success (a put or delete request) else: range(key)``."""
        rpc = self._rpc
        op = (rpc.RequestOp(request_put=success) if isinstance(success, rpc.PutRequest)
              else rpc.RequestOp(request_delete_range=success))
        return rpc.TxnRequest(compare=[compare.build_message()], success=[op],
                              failure=[rpc.RequestOp(request_range=self._range(key))])

    def _txn(self, request: Any, deadline: Deadline, what: str, tries: Tries | None = None) -> Any:
        return self._call(lambda ep, t, md: ep.kv.Txn(request, timeout=t, metadata=md), deadline,
                          what=what, tries=tries)

    # -- leases --------------------------------------------------------------------
    def _grant(self, ttl: float | None, deadline: Deadline) -> int:
        """A new lease for ``ttl`` seconds (rounded up), or ``0`` for no TTL."""
        if ttl is None:
            return 0
        request = self._rpc.LeaseGrantRequest(TTL=ttl_seconds(ttl))
        answer = self._call(lambda ep, t, md: ep.lease.LeaseGrant(request, timeout=t, metadata=md), deadline,
                            what="lease grant")
        if answer.error:
            raise KVError(f"etcd refused a lease of {ttl_seconds(ttl)} s: {answer.error}")
        if answer.TTL > request.TTL:  # etcd raised it to its minimum lease TTL
            self._min_ttl = int(answer.TTL)
        return int(answer.ID)

    def _revoke(self, lease: int, deadline: Deadline) -> None:
        """Revoke ``lease`` within ``deadline`` (at most 2 s; best effort: a lease without keys just runs out)."""
        if not lease:
            return
        request = self._rpc.LeaseRevokeRequest(ID=lease)
        try:
            self._call(lambda ep, t, md: ep.lease.LeaseRevoke(request, timeout=t, metadata=md),
                       Deadline(min(2.0, deadline.remaining())), what="lease revoke")
        except (BackendUnavailable, _ServerError) as exc:
            log.debug("lease %x not revoked (it will run out): %s", lease, exc)

    def _keepalive(self, lease: int, deadline: Deadline) -> int:
        """Send one keep-alive for ``lease``; return its granted TTL (seconds), 0 if it is gone."""
        request = self._rpc.LeaseKeepAliveRequest(ID=lease)

        def rpc(ep: _Endpoint, timeout: float, metadata: Any) -> int:
            for answer in ep.lease.LeaseKeepAlive(iter([request]), timeout=timeout, metadata=metadata):
                return int(answer.TTL)
            return 0

        return self._call(rpc, deadline, what="lease keep-alive")

    # -- reads -----------------------------------------------------------------------
    def _get_kv(self, key: str, deadline: Deadline) -> Any | None:
        request = self._range(_k(key))
        answer = self._call(lambda ep, t, md: ep.kv.Range(request, timeout=t, metadata=md), deadline,
                            what=f"get {key!r}")
        return answer.kvs[0] if answer.kvs else None

    def _do_get(self, key: str) -> Entry | None:
        deadline = self._deadline()
        kv = self._reads.read(("get", key), deadline, lambda: self._get_kv(key, deadline))
        return None if kv is None else Entry(key, bytes(kv.value), int(kv.mod_revision))

    def _do_ttl_remaining(self, key: str) -> float | None:
        """The remaining TTL of the key's lease (``LeaseTimeToLive``, whole seconds)."""
        deadline = self._deadline()
        kv = self._get_kv(key, deadline)
        if kv is None:
            raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
        if not kv.lease:
            return None
        request = self._rpc.LeaseTimeToLiveRequest(ID=int(kv.lease))
        answer = self._call(lambda ep, t, md: ep.lease.LeaseTimeToLive(request, timeout=t, metadata=md), deadline,
                            what="lease time-to-live")
        if int(answer.TTL) < 0:  # the lease ran out since the read
            raise KeyNotFound(f"key {key!r} not found (expired)", key)
        return float(answer.TTL)

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        start, end = _prefix_range(prefix)
        request = self._range(start, end)
        deadline = self._deadline()
        answer = self._reads.read(("list", prefix), deadline, lambda: self._call(
            lambda ep, t, md: ep.kv.Range(request, timeout=t, metadata=md), deadline, what=f"list {prefix!r}"))
        entries = [Entry(key, bytes(kv.value), int(kv.mod_revision))
                   for kv in answer.kvs if (key := _key(kv.key)) is not None]
        return entries, int(answer.header.revision)

    # -- writes ----------------------------------------------------------------------
    def _put_request(self, key: str, value: bytes, lease: int) -> Any:
        return self._rpc.PutRequest(key=_k(key), value=value, lease=lease, prev_kv=True)

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        deadline = self._deadline()
        lease = self._grant(ttl, deadline)
        request = self._txn_request(self._cmp.Version(_k(key)) == 0, self._put_request(key, value, lease), _k(key))
        tries = Tries(self._seen)
        try:
            answer = self._txn(request, deadline, f"create {key!r}", tries)
        except BaseException as exc:
            self._revoke(lease, deadline)
            _raise_if_too_large(exc, key, value)
            raise
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and not (kvs and tries.predates(int(kvs[0].create_revision))):
                if kvs and _own_write(kvs[0], value, lease, tries, created=True):
                    return Entry(key, value, int(kvs[0].mod_revision))
                self._revoke(lease, deadline)
                raise may_have_applied(f"create({key!r})", key)
            self._revoke(lease, deadline)
            raise KeyExists(f"key {key!r} exists", key)
        return Entry(key, value, int(answer.header.revision))

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        deadline = self._deadline()
        lease = self._grant(ttl, deadline)
        request = self._put_request(key, value, lease)
        try:
            answer = self._call(lambda ep, t, md: ep.kv.Put(request, timeout=t, metadata=md), deadline,
                                what=f"put {key!r}")
        except BaseException as exc:
            self._revoke(lease, deadline)
            _raise_if_too_large(exc, key, value)
            raise
        self._revoke_replaced(answer.prev_kv, lease, deadline)
        return Entry(key, value, int(answer.header.revision))

    def _revoke_replaced(self, prev_kv: Any, new_lease: int, deadline: Deadline) -> None:
        """After a write replaced ``prev_kv``, revoke the lease it had (one lease per key)."""
        if prev_kv is not None and prev_kv.lease and prev_kv.lease != new_lease:
            self._revoke(int(prev_kv.lease), deadline)

    def _compare_failed(self, answer: Any, key: str, expected: int) -> KVError:
        kvs = answer.responses[0].response_range.kvs
        if not kvs:
            return KeyNotFound(f"key {key!r} not found", key)
        actual = int(kvs[0].mod_revision)
        return CompareFailed(f"key {key!r} is at revision {actual}, not {expected}", key, expected, actual)

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        deadline = self._deadline()
        lease = self._grant(ttl, deadline)
        request = self._txn_request(
            self._cmp.Mod(_k(key)) == expected_revision, self._put_request(key, value, lease), _k(key)
        )
        tries = Tries(self._seen)
        try:
            answer = self._txn(request, deadline, f"compare_and_swap {key!r}", tries)
        except BaseException as exc:
            self._revoke(lease, deadline)
            _raise_if_too_large(exc, key, value)
            raise
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and not (kvs and tries.predates(int(kvs[0].mod_revision))):
                if kvs and _own_write(kvs[0], value, lease, tries):
                    return Entry(key, value, int(kvs[0].mod_revision))  # the replaced lease just runs out
                self._revoke(lease, deadline)
                raise may_have_applied(f"compare_and_swap({key!r})", key)
            self._revoke(lease, deadline)
            raise self._compare_failed(answer, key, expected_revision)
        self._revoke_replaced(answer.responses[0].response_put.prev_kv, lease, deadline)
        return Entry(key, value, int(answer.header.revision))

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        request = self._txn_request(
            self._cmp.Mod(_k(key)) == expected_revision,
            self._rpc.DeleteRangeRequest(key=_k(key), prev_kv=True),
            _k(key),
        )
        deadline, tries = self._deadline(), Tries(self._seen)
        answer = self._txn(request, deadline, f"compare_and_delete {key!r}", tries)
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and not (kvs and tries.predates(int(kvs[0].mod_revision))):
                raise may_have_applied(f"compare_and_delete({key!r})", key)
            raise self._compare_failed(answer, key, expected_revision)
        for prev in answer.responses[0].response_delete_range.prev_kvs:
            self._revoke_replaced(prev, 0, deadline)

    def _do_delete(self, key: str) -> bool:
        request = self._rpc.DeleteRangeRequest(key=_k(key), prev_kv=True)
        deadline = self._deadline()
        answer = self._call(lambda ep, t, md: ep.kv.DeleteRange(request, timeout=t, metadata=md),
                            deadline, what=f"delete {key!r}")
        for prev in answer.prev_kvs:
            self._revoke_replaced(prev, 0, deadline)
        return int(answer.deleted) > 0

    def _do_refresh(self, key: str, ttl: float) -> None:
        deadline = self._deadline()
        # Each keep-alive is a LeaseKeepAlive stream with a gRPC thread of its own; unbounded, 1,024 refreshes at
        # once starve each other and keys lapse (steady benchmark, docs/benchmarks.md).
        if not self._refresh_slots.acquire(timeout=max(0.0, deadline.remaining())):
            raise BackendTimeout(f"refresh({key!r}): {REFRESH_CONCURRENCY} refreshes of this client in flight for "
                                 f"{self.settings.operation_timeout} s", key)
        try:
            self._refresh_once(key, ttl, deadline)
        finally:
            self._refresh_slots.release()

    def _refresh_once(self, key: str, ttl: float, deadline: Deadline) -> None:
        wanted = ttl_seconds(ttl)
        while True:
            kv = self._get_kv(key, deadline)
            if kv is None:
                raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
            granted = self._keepalive(int(kv.lease), deadline) if kv.lease else 0
            if granted > 0 and granted == self._effective_ttl(wanted):
                return
            if granted <= 0 and kv.lease:
                # The lease ran out or was replaced between the read and the keep-alive: read again.
                current = self._get_kv(key, deadline)
                if current is None:
                    raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
                if current.lease != kv.lease or current.mod_revision != kv.mod_revision:
                    if not deadline.backoff():
                        raise BackendTimeout(f"refresh({key!r}) lost every race", key)
                    continue
            # No lease, or a different TTL: re-put the same value on a lease of the asked TTL.
            if self._reput(key, kv, ttl, deadline):
                return
            if not deadline.backoff():
                raise BackendTimeout(f"refresh({key!r}) lost every race", key)

    def _effective_ttl(self, wanted: int) -> int:
        """The TTL a new lease of ``wanted`` seconds gets (etcd raises it to its minimum, once seen)."""
        return max(wanted, self._min_ttl)

    def _reput(self, key: str, kv: Any, ttl: float, deadline: Deadline) -> bool:
        """Put ``kv``'s value again on a new lease, if it is unchanged; ``False`` if it changed."""
        lease = self._grant(ttl, deadline)
        request = self._txn_request(
            self._cmp.Mod(_k(key)) == int(kv.mod_revision), self._put_request(key, bytes(kv.value), lease), _k(key)
        )
        tries = Tries(self._seen)
        try:
            answer = self._txn(request, deadline, f"refresh {key!r}", tries)
        except BaseException:
            self._revoke(lease, deadline)
            raise
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and kvs and kvs[0].lease == lease:
                return True  # an earlier attempt put the key on the new lease
            self._revoke(lease, deadline)
            if not answer.responses[0].response_range.kvs:
                raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
            return False
        self._revoke_replaced(answer.responses[0].response_put.prev_kv, lease, deadline)
        return True

    def _do_add(self, key: str, delta: int) -> int:
        return self._adds.add(key, delta, self._deadline(), lambda total, dl: self._add_once(key, total, dl))

    def _add_once(self, key: str, delta: int, deadline: Deadline) -> int:
        """Add ``delta`` to ``key`` in one successful transaction; return the new value.

        Each attempt is ONE transaction ``if mod_revision(key) == R: put(value + delta)
        else: range(key)`` (``version == 0`` for an absent key): a lost race answers
        the key's current value and revision, which the next attempt uses at once
        (:class:`~rdzv_backends._etcd_common.RaceRetry`). The first attempt assumes
        the state this backend last saw at ``key`` (absent if none), so an add to a
        counter nobody else touched since costs one round trip.

        Raises:
            CorruptEntry: the value at ``key`` is not ASCII decimal (nothing written).
            BackendTimeout: every attempt lost a race until the operation deadline; or an
                attempt that may have been applied was followed by a lost race, so the add
                may or may not have taken effect (see ``Tries``; it is never applied twice).
        """
        k = _k(key)
        known = self._counters.get(key)
        race = RaceRetry(deadline)
        while True:
            if known is None:
                total, lease = delta, 0
                compare = self._cmp.Version(k) == 0
            else:
                total, lease = parse_counter(key, known.value) + delta, known.lease  # keeps its TTL (lease)
                compare = self._cmp.Mod(k) == known.revision
            value = str(total).encode("ascii")
            tries = Tries(self._seen)
            try:
                answer = self._txn(self._txn_request(compare, self._put_request(key, value, lease), k), deadline,
                                   f"add {key!r}", tries)
            except _ServerError as exc:
                if "lease not found" not in exc.details:
                    raise
                current = None  # the key's lease ran out after we saw it: the key is gone with it
            else:
                if answer.succeeded:  # a success proves that no earlier attempt was applied (see Tries)
                    self._remember(key, _Counter(value, int(answer.header.revision), lease))
                    return total
                kvs = answer.responses[0].response_range.kvs
                current = _Counter(bytes(kvs[0].value), int(kvs[0].mod_revision), int(kvs[0].lease)) if kvs else None
            if tries.maybe_applied and (current is None or not tries.predates(current.revision)):
                self._counters.pop(key, None)
                raise may_have_applied(f"add({key!r})", key)  # adding again could count twice
            progressed, known = current != known, current
            self._counters.pop(key, None)  # only states this backend wrote are remembered (never corrupt ones)
            if not race.again(progressed):
                raise BackendTimeout(
                    f"add({key!r}) lost {race.attempts} races in a row to other writers of the key within "
                    f"operation_timeout={self.settings.operation_timeout:g} s", key
                )

    def _remember(self, key: str, counter: _Counter) -> None:
        """Note the state ``add`` wrote at ``key`` (a decimal value, so a later add never fails on
        a remembered state: only on one the server answered).

        Bounded; a stale entry costs one lost attempt, whose answer has the current state.
        """
        if len(self._counters) >= _COUNTER_CACHE:
            self._counters.clear()
        self._counters[key] = counter

    # -- watch -----------------------------------------------------------------------
    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        start, end = _prefix_range(prefix)
        poll = Deadline(timeout)
        return self._call(
            lambda ep, t, md: self._watch_once(ep, start, end, after_revision, poll, md),
            FailureBudget(call_budget(self.settings.operation_timeout), poll), what=f"watch {prefix!r}",
        )

    def _watch_once(self, ep: _Endpoint, start: bytes, end: bytes, after: int, poll: Deadline,
                    md: Any) -> list[Event]:
        """Wait on ``ep``'s shared watch stream until an event after ``after``, an error, or ``poll`` passes.

        Raises:
            _StreamError: the stream failed (``_call`` retries); HistoryCompacted, KVError: see the stream.
        """
        for _ in range(3):  # a stream that fails between being found and subscribed to is replaced
            with ep.stream_lock:
                stream = ep.stream
                if stream is None or stream.failure is not None or stream.retired or stream.metadata != md:
                    if stream is not None:
                        stream.retire()
                    stream = ep.stream = _WatchStream(self, ep, md)
            sub = stream.subscribe(start, end, after)
            if sub is not None:
                break
        else:
            raise _StreamError(self._grpc.StatusCode.UNAVAILABLE, "the watch stream failed at once, thrice")
        try:
            # Exactly the call's timeout: no floor. A floor (it was 50 ms) made every short watch end at
            # the same moment, which defeated the rendezvous's jittered setup stagger (all nodes created).
            sub.woken.wait(max(poll.remaining(), 0.0))
        finally:
            stream.unsubscribe(sub)
        if sub.error is not None:
            raise sub.error
        return sub.events

    def _do_close(self) -> None:
        for ep in getattr(self, "_eps", ()):
            ep.channel.close()  # fails every watch stream: their callers raise BackendClosed


def _k(key: str) -> bytes:
    return ("/" + key).encode("utf-8")


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """``[start, end)`` of the v3 keys below ``prefix`` (``"/"`` + prefix, last byte + 1)."""
    start = _k(prefix) if prefix else b"/"
    return start, start[:-1] + bytes([start[-1] + 1])



def _own_write(kv: Any, value: bytes, lease: int, tries: Tries, *, created: bool = False) -> bool:
    """Whether ``kv`` (a conflict's current state) shows the write of ``value`` on ``lease`` by a
    request whose earlier attempt may have been applied.

    With a TTL the write's lease is new and never shared, so the key being on
    it proves the write. Without one: newer than the request (``mod_revision``
    above ``tries.seen``), the written value, no lease, and (for ``create``)
    unmodified since it was created; a concurrent write of the very same value
    passes as well.
    """
    if lease:
        return int(kv.lease) == lease
    return (not tries.predates(int(kv.mod_revision)) and bytes(kv.value) == value and not kv.lease
            and (not created or int(kv.version) == 1))


def _raise_if_too_large(error: BaseException, key: str, value: bytes) -> None:
    """Raise :class:`ValueTooLarge` if ``error`` is etcd refusing a write as too large (nothing was written).

    etcd answers ``request is too large`` above its ``--max-request-bytes``, and
    gRPC ``received message larger than max`` above that plus 512 KiB; the
    server's limit cannot be read through the API.
    """
    if isinstance(error, _ServerError) and ("request is too large" in error.details
                                            or "larger than max" in error.details):
        raise ValueTooLarge(
            f"etcd refused the value of {len(value)} bytes for key {key!r} as too large ({error.details}): this "
            f"backend accepts up to {MAX_VALUE_BYTES} bytes (max_value_bytes), but the server's "
            "--max-request-bytes may be configured lower; store smaller values or raise the server's limit", key
        ) from None


def _deadline_exceeded(code: Any, details: str) -> bool:
    name = getattr(code, "name", "")
    return name == "DEADLINE_EXCEEDED" or (name == "UNKNOWN" and "deadline exceeded" in details.lower())


def _not_sent(code: Any, details: str) -> bool:
    low = details.lower()
    return getattr(code, "name", "") == "UNAVAILABLE" and any(s in low for s in _NOT_SENT_DETAILS)


def _open(url: RendezvousURL) -> EtcdV3Backend:
    return EtcdV3Backend(EtcdSettings.from_url(url))


#: Registers ``etcd-v3://`` and ``etcd3://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    BackendSpec(
        schemes=("etcd-v3", "etcd3"),
        open=_open,
        capabilities=EtcdV3Backend.capabilities,
        default_port=DEFAULT_PORT,
        query_keys=QUERY_KEYS,
        requires_host=True,
        description="etcd v3 gRPC API, one lease per key, python3-etcd3",
    )
)
