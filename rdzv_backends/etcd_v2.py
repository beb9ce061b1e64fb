"""``etcd://`` and ``etcd-v2://`` — etcd's v2 API, the seed's backend (client: ``python-etcd``).

::

    etcd-v2://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/RUN_ID?protocol=https&cacert=...&cert=...&key=...

The v2 API exists only on servers started with ``--enable-v2=true`` (etcd 3.4
and 3.5; gone in 3.6). Against a server without it, opening the backend fails
at once with :class:`~rdzv_core.errors.InvalidURLError` on ``scheme`` (as the
URL wrote it) pointing to ``etcd-v3://``; against an HTTP server that is not
etcd (no etcd ``GET /version``), with one on ``host``. Query keys are described in :mod:`rdzv_backends._etcd_common`.

What ``python-etcd`` does and what is ours: each endpoint of the URL gets one
``etcd.Client`` (no reconnection, no member discovery, no redirects). It holds
the endpoint's URI, the TLS settings (CA bundle, client certificate), the
basic-auth header and the ``urllib3`` pool manager, and its request code
(``Client.api_execute`` without the wrapper around it, see
:meth:`EtcdV2Backend._request`) builds and sends every request. The wrapper is
left out because it logs an ERROR line for every failed request (a wrong port
would spam the log), fails over on its own without a deadline, and turns
answers into exceptions. Ours: the key and value mapping below, reading the
answers, the failover between endpoints, the deadlines and retries, ``add``,
the watch loop, and the cluster-ID check.

Mapping of the KV protocol onto v2 (``kv.py`` has the contract):

Keys
    Key ``a/b/c`` is the v2 node ``/a/b/!c``: each key's last segment gets the
    marker ``!`` (not a key character). A v2 node is either a directory or a
    value, never both; the marker keeps leaves and directories apart, so the
    keys ``a`` (node ``/!a``) and ``a/b`` (directory ``/a``, node ``/a/!b``)
    coexist as the protocol allows. A directory segment starting with ``_``
    (v2 hides such nodes from listings and recursive watches) or ``~`` is
    written with one more ``~`` in front. Nodes without the marker, or whose
    names fall outside the key grammar (written by other programs), are ignored.
Values
    v2 stores text, so values are stored base64-encoded (standard alphabet).
    :data:`~rdzv_backends._etcd_common.MAX_VALUE_BYTES` (1 MiB) fits etcd's
    default ``--max-request-bytes`` (the v2 API does not apply that limit:
    etcd 3.5 stores a 900 KiB value with ``--max-request-bytes 524288``).
Revisions
    ``Entry.revision`` is the node's ``modifiedIndex``; ``list`` returns the
    ``X-Etcd-Index`` of its answer. ``refresh`` (``refresh=true&prevExist=true``)
    advances the key's ``modifiedIndex`` and notifies no watcher.
TTL
    v2 TTLs are whole seconds: a fractional TTL is rounded up (at least 1 s).
    The leader deletes expired keys on a 500 ms tick, so an expiry is seen up
    to about 1.5 s after the requested TTL (``ttl_resolution``; measured up to 1.4 s).
Writes
    ``create`` is ``prevExist=false``, ``compare_and_swap`` ``prevIndex``,
    ``compare_and_delete`` a ``DELETE`` with ``prevIndex``. ``add`` is a
    compare-and-swap on ``prevIndex`` *and* ``prevValue``: a lost race answers
    error 101 whose cause carries the key's current value and index, so the
    next attempt is sent at once without a read and without sleeping while
    other writers make progress (jittered backoff only for failures without
    progress), until ``operation_timeout``. It reads the key again only when
    it must: the first time this backend adds to the key, when the key has a
    TTL (``add`` keeps it, in whole seconds), or when the key was re-created.
    (One race is not closed: an ``add`` that loses to a ``put`` giving a
    TTL-less counter a TTL drops that TTL; the rendezvous never gives
    counters a TTL.) Concurrent ``add`` calls on one key through one backend
    object are combined into one write of their summed deltas
    (:class:`~rdzv_backends._etcd_common.AddCombiner`).
Directories
    v2 makes the directories of a key's path implicitly; ``delete`` and
    ``compare_and_delete`` remove those the deleted key left empty (see
    :meth:`EtcdV2Backend._prune`). Directories emptied by a TTL's expiry stay
    until a later delete below them.
Corrupt data
    Data at a key that this backend did not write raises
    :class:`~rdzv_core.errors.CorruptEntry` naming the key from every
    operation that meets it: a v2 *directory* at a key's node (``/a/b/!c``
    made with ``dir=true``), a value that is not base64, a non-decimal value
    given to ``add``, a value node (written by another program) where a
    directory of the key's path belongs. Nothing is written by the failing
    call, except that ``refresh`` of a directory is refused by etcd itself.
    ``delete(key)`` removes such data: a directory recursively, a blocking
    value node on the key's path included, so ``rdzv reset`` recovers.
Watch
    A long poll ``wait=true&recursive=true&waitIndex=after+1`` on the prefix's
    directory; it returns one event per call (the contract allows fewer than
    all). etcd keeps the last 1,000 v2 events; an older ``waitIndex`` answers
    "event index cleared" (401), raised as
    :class:`~rdzv_core.errors.HistoryCompacted`.
Connections
    Each endpoint's client keeps up to :data:`POOL_CONNECTIONS` (1,024) idle
    keep-alive connections (``per_host_pool_size``). Every request in flight
    uses a connection of its own, and a watch holds one for its whole long
    poll, so a process whose threads share one backend object (say 512
    agents, each waiting in a watch while its keep-alive thread writes) needs
    that many at once; connections are opened on demand, never in advance.
    Beyond :data:`POOL_CONNECTIONS` concurrent requests the extra connections
    are closed after use (``urllib3`` then logs "Connection pool is full");
    the server's file descriptor limit (and the client's ``ulimit -n``) must
    allow the concurrency you use.
Failures
    Each operation has ``operation_timeout`` seconds (query key, default 10),
    shared by the attempts of its requests: one attempt may take
    ``max(0.5, operation_timeout / 3)`` seconds, twice that after an attempt
    ran out of time (:meth:`~rdzv_backends._etcd_common.Deadline.attempt`),
    because a member can hold a write for etcd's own request timeout (5 s and
    more: a write sent to a follower just after the leader died is forwarded
    to the dead leader and lost) while a new leader serves within about a
    second. A failed attempt moves to the next endpoint of the URL and, after
    a round of failures, the request is retried with jittered backoff until
    the deadline. Connection refused everywhere raises one
    :class:`~rdzv_core.errors.BackendConnectionError` naming every endpoint;
    other failures raise the last attempt's ``BackendTimeout`` /
    ``BackendConnectionError``. Each failed attempt is one DEBUG line of this
    module's logger; neither ``python-etcd`` nor ``urllib3`` (which never
    retries here) logs anything above DEBUG. "Leader election in progress"
    (errorCode 301) and etcd's "request timed out" (300) are retried too.

    Every request is retried, also after an attempt that may have been
    applied (a timeout, a connection lost mid-answer, error 300): reads and
    ``put``, ``delete`` and ``refresh`` may be repeated (a repeated ``delete``
    then reports ``False``, the key being gone already). A compare-guarded
    write (``create``, the compare-and-* writes, ``add``'s compare-and-swap)
    cannot be applied twice -- a repetition meets the first one's result as a
    conflict -- and reads such a conflict with
    :class:`~rdzv_backends._etcd_common.Tries`: a success, or a conflict with
    state older than the request, is the plain answer; ``create`` and
    ``compare_and_swap`` report success when the key shows their own write
    (newer than the request, the written value, a TTL exactly if they gave one,
    for ``create`` unmodified since; v2 records no writer, so a concurrent
    write of the very same value in the same second passes as well). Every
    other conflict newer than the request -- for ``compare_and_delete`` and
    ``add`` every one, as no state proves their own write and ``add`` must not
    count twice -- raises ``BackendTimeout`` saying that the write may or may
    not have taken effect.

    A watch retries a lost long poll for ``operation_timeout`` seconds from the
    failure (never past its own timeout); a server that is silent (paused)
    looks like a quiet one to it.
Auth
    ``USER:PASSWORD@`` in the URL is sent as HTTP basic auth (etcd v2 auth;
    a user without a password is refused at open); the password never
    appears in logs, ``repr`` or error messages.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import re
import urllib.parse
from typing import Any, Callable, NamedTuple

from rdzv_core.errors import (
    BackendClosed,
    BackendConnectionError,
    BackendTimeout,
    BackendUnavailable,
    CompareFailed,
    CorruptEntry,
    HistoryCompacted,
    InvalidKeyError,
    InvalidURLError,
    KeyExists,
    KeyNotFound,
    KVError,
)
from rdzv_core.kv import call_budget, Capabilities, Entry, Event, EventType, KVBackend, check_key, parse_counter
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL

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
    Tries,
    check_tls,
    may_have_applied,
    ttl_seconds,
    unreachable,
)

__all__ = ["EtcdV2Backend", "POOL_CONNECTIONS", "plugin"]

log = logging.getLogger(__name__)

#: Idle keep-alive connections kept per endpoint (see "Connections" in the module docstring).
POOL_CONNECTIONS = 1024

_LEAF = "!"
#: Shortest long poll (seconds): ``watch(timeout=0)`` still asks the server once.
_MIN_POLL = 0.2
_KEYS = "/v2/keys"
#: Counters whose last written state ``add`` remembers per backend object.
_COUNTER_CACHE = 1024
# v2 errorCodes (etcd Documentation/v2/errorcode.md)
_KEY_NOT_FOUND, _COMPARE_FAILED, _NOT_FILE, _NOT_DIR, _NODE_EXISTS = 100, 101, 102, 104, 105
_DIR_NOT_EMPTY, _UNAUTHORIZED, _RAFT_INTERNAL, _LEADER_ELECT, _INDEX_CLEARED = 108, 110, 300, 301, 401
# Causes of error 101 for a compare on prevValue and prevIndex (etcd's v2store getCompareFailCause).
_INDEX_MOVED = re.compile(r"\[(\d+) != (\d+)\]")
_BOTH_MOVED = re.compile(r"\[(\S*) != (.*)\] \[(\d+) != (\d+)\]", re.DOTALL)
_CAUSE_INDEX = re.compile(r"\[(\d+) != (\d+)\]\Z")


class _Answer(NamedTuple):
    """One v2 answer: ``ok`` (2xx), the JSON body (or error payload), the ``X-Etcd-Index``."""

    ok: bool
    body: dict[str, Any]
    etcd_index: int

    @property
    def code(self) -> int | None:
        return None if self.ok else self.body.get("errorCode")


class _Counter(NamedTuple):
    """A counter node as ``add`` last saw it: stored (base64) text, ``modifiedIndex``, TTL left (s) or ``None``."""

    raw: str
    modified: int
    ttl: int | None


class _ClusterChanged(Exception):
    """An endpoint answered with another ``X-Etcd-Cluster-Id`` than before."""


# -- key and value mapping -------------------------------------------------------
def _node_segments(key: str) -> list[str]:
    """The v2 node's path segments of ``key``: ``a/b/c`` -> ``["a", "b", "!c"]``."""
    *dirs, leaf = key.split("/")
    return [_dir_segment(d) for d in dirs] + [_LEAF + leaf]


def _node_key(key: str) -> str:
    """The v2 node key (unquoted) of ``key``: ``a/b/c`` -> ``/a/b/!c``."""
    return "/" + "/".join(_node_segments(key))


def _node_path(key: str) -> str:
    """The URL path (quoted) of ``key``'s v2 node."""
    return "".join("/" + urllib.parse.quote(s, safe="") for s in _node_segments(key))


def _dir_path(prefix: str) -> str:
    """The URL path (quoted) of the v2 directory holding ``prefix`` (``""`` -> ``/``)."""
    if not prefix:
        return "/"
    return "".join("/" + urllib.parse.quote(_dir_segment(d), safe="") for d in prefix[:-1].split("/"))


def _dir_segment(segment: str) -> str:
    return "~" + segment if segment[0] in "_~" else segment


def _key_of(node_key: str) -> str | None:
    """Our key for a v2 node key (``/a/b/!c`` -> ``a/b/c``), ``None`` if not one of ours."""
    *dirs, leaf = node_key.lstrip("/").split("/")
    if not leaf.startswith(_LEAF) or len(leaf) < 2:
        return None
    try:
        return check_key("/".join([d[1:] if d.startswith("~") else d for d in dirs] + [leaf[1:]]))
    except InvalidKeyError:
        return None


def _decode(key: str, raw: Any) -> bytes:
    """The bytes of a stored value (base64 text); :class:`CorruptEntry` if it is not base64."""
    try:
        return base64.b64decode(raw if isinstance(raw, str) else "", validate=True)
    except (binascii.Error, ValueError):
        raise CorruptEntry(
            f"etcd v2 node {_node_key(key)} (key {key!r}) holds {str(raw)[:40]!r}, not base64 data written by "
            f"this backend; delete({key!r}) or `rdzv reset` removes it", key
        ) from None


def _dir_error(key: str) -> CorruptEntry:
    return CorruptEntry(
        f"etcd v2 holds a directory at {_node_key(key)}, where the value of key {key!r} belongs (made by another "
        f"program); delete({key!r}) or `rdzv reset` removes it", key
    )


def _entry(key: str, node: dict[str, Any]) -> Entry:
    if node.get("dir"):
        raise _dir_error(key)
    return Entry(key, _decode(key, node.get("value", "")), int(node["modifiedIndex"]))


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The value nodes, and the directories named like key nodes (``!x``), of a recursive v2 answer."""
    if not node.get("dir") or node.get("key", "").rsplit("/", 1)[-1].startswith(_LEAF):
        return [node]
    out: list[dict[str, Any]] = []
    for child in node.get("nodes", ()):
        out.extend(_nodes(child))
    return out


def _after_compare_failed(tried: _Counter, cause: str) -> _Counter | None:
    """The counter's current state from the cause of a failed ``prevValue``+``prevIndex`` compare.

    ``None`` when the answer does not tell (or tells that only the index moved:
    something rewrote the same value, perhaps with another TTL, so re-read).
    """
    both = _BOTH_MOVED.fullmatch(cause)
    if both is not None and both.group(1) == tried.raw:
        return _Counter(both.group(2), int(both.group(4)), None)
    return None


def _current_index(cause: str) -> int | None:
    """The node's ``modifiedIndex`` from the cause of error 101 (it ends ``[prevIndex != modifiedIndex]``)."""
    match = _CAUSE_INDEX.search(cause)
    return int(match.group(2)) if match else None


def _own_write(node: dict[str, Any], params: dict[str, str], tries: Tries, *, created: bool = False) -> bool:
    """Whether ``node`` shows the write ``params`` of a request whose earlier attempt may have been applied.

    It must be newer than the request (``modifiedIndex`` above ``tries.seen``),
    hold the written value, have a TTL exactly if the write gave one, and (for
    ``create``) be unmodified since it was created. v2 records no writer, so a
    concurrent write of the very same value in the same second passes as well.
    """
    return (
        not tries.predates(int(node["modifiedIndex"]))
        and node.get("value") == params["value"]
        and (node.get("ttl") is not None) == ("ttl" in params)
        and (not created or node.get("createdIndex") == node.get("modifiedIndex"))
    )


# -- failure classification --------------------------------------------------------
def _not_sent(cause: BaseException | None) -> bool:
    """True if the request cannot have reached the server (connecting failed)."""
    import urllib3.exceptions as u3

    return isinstance(cause, (u3.NewConnectionError, u3.ConnectTimeoutError, ConnectionRefusedError))


def _is_read_timeout(cause: BaseException | None) -> bool:
    import urllib3.exceptions as u3

    return isinstance(cause, (u3.ReadTimeoutError, TimeoutError))


def _is_tls_error(cause: BaseException | None) -> bool:
    import ssl

    import urllib3.exceptions as u3

    return isinstance(cause, (u3.SSLError, ssl.SSLError))


class _Endpoint:
    """One etcd endpoint: its ``python-etcd`` client and the cluster ID it last answered with.

    The client is built for exactly one endpoint (no reconnection, no member
    discovery, no redirects); it carries the endpoint's URI, the TLS settings,
    the basic-auth header and the ``urllib3`` pool manager its requests use.
    """

    def __init__(self, etcd: Any, host: str, port: int, settings: EtcdSettings) -> None:
        cert: str | tuple[str, str] | None = None
        if settings.cert is not None:  # a certificate alone is one PEM file holding the key as well
            cert = (settings.cert, settings.key) if settings.key else settings.cert
        self.host, self.port = host, port
        self.client = etcd.Client(
            host=f"[{host}]" if ":" in host else host,
            port=port,
            protocol=settings.protocol,
            cert=cert,
            ca_cert=settings.ca_cert,
            username=settings.username,
            password=settings.password,
            read_timeout=settings.operation_timeout,
            allow_redirect=False,
            allow_reconnect=False,  # failover is ours: bounded by the operation's deadline
            per_host_pool_size=POOL_CONNECTIONS,
        )
        # One attempt per request: urllib3 must not retry behind our deadline (nor log its retries).
        self.client.http.connection_pool_kw["retries"] = False
        self.base_uri: str = self.client.base_uri
        self.cluster_id: str | None = None


class EtcdV2Backend(KVBackend):
    """KV backend on etcd's v2 API; see the module docstring for the mapping.

    Args:
        settings: endpoints, TLS, credentials and ``operation_timeout``.

    Raises:
        InvalidURLError: the server does not serve the v2 API (started without
            ``--enable-v2``), or rejected the credentials; the URL names a user
            without a password; a TLS file cannot be used, or the server's TLS
            handshake refuses it (see :func:`~rdzv_backends._etcd_common.check_tls`).
        KVError: the installed ``python-etcd`` lacks ``Client.api_execute.__wrapped__``.
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
        ttl_resolution=1.5,
    )

    def __init__(self, settings: EtcdSettings) -> None:
        import etcd
        import urllib3

        if settings.username and not settings.password:
            raise InvalidURLError(
                "password", "", f"etcd v2 authenticates USER:PASSWORD@ with HTTP basic auth; the URL gives the user "
                f"{settings.username!r} without a password"
            )
        execute: Callable[..., Any] | None = getattr(etcd.Client.api_execute, "__wrapped__", None)
        if execute is None:
            raise KVError("this python-etcd has no Client.api_execute.__wrapped__ (the request without its "
                          "logging and reconnection wrapper); the etcd-v2 backend needs python-etcd 0.4")
        self._execute = execute
        self._u3 = urllib3
        self.settings = settings
        self._endpoints = Endpoints(len(settings.endpoints))
        self._eps = [_Endpoint(etcd, host, port, settings) for host, port in settings.endpoints]
        self._seen = 0  # the highest X-Etcd-Index answered so far (see Tries)
        self._adds = AddCombiner()
        self._counters: dict[str, _Counter] = {}  # key -> state last written by add (see _add_once)
        try:
            opening = Deadline(settings.operation_timeout)
            check_tls(settings, opening)  # names a wrong cacert or cert (urllib3's error would not)
            self._probe(opening)
        except BaseException:
            self._do_close()
            raise

    def __repr__(self) -> str:
        return f"EtcdV2Backend({self.settings.describe()!r})"

    # -- transport ---------------------------------------------------------------
    def _call(
        self, method: str, path: str, params: dict[str, str], deadline: Deadline, tries: Tries | None = None
    ) -> _Answer:
        """Send one request, failing over between endpoints until ``deadline``.

        Each attempt gets :meth:`~rdzv_backends._etcd_common.Deadline.attempt`
        seconds; every transport failure is retried (see "Failures" in the
        module docstring).

        Args:
            tries: for a compare-guarded write: marked when an attempt failed
                after it may have reached etcd (see :class:`~rdzv_backends._etcd_common.Tries`).

        Returns:
            The :class:`_Answer`: a 2xx answer or an etcd error payload.

        Raises:
            BackendConnectionError, BackendTimeout: see the module docstring.
            InvalidURLError: the server does not serve the v2 API, or refused the credentials.
        """
        answer = self._send(method, path, params, deadline, tries=tries, poll=None)
        if answer is None:  # only long polls time out quietly
            raise BackendTimeout(f"etcd {method} {path} timed out")
        return answer

    def _send(
        self,
        method: str,
        path: str,
        params: dict[str, str],
        deadline: Deadline,
        *,
        tries: Tries | None,
        poll: Deadline | None,
    ) -> _Answer | None:
        """:meth:`_call`; with ``poll`` (a watch's deadline) a long poll that times out returns ``None``."""
        u3 = self._u3
        last: BackendUnavailable | None = None
        refused = True  # every failure so far reached no server
        while True:
            for index in self._endpoints.order():
                self._check_open()
                per_try = deadline.attempt() if poll is None else max(poll.remaining(), _MIN_POLL)
                if per_try <= 0:
                    break
                ep = self._eps[index]
                timeout = u3.Timeout(connect=min(per_try, self.settings.operation_timeout), read=per_try)
                try:
                    answer = self._request(ep, method, path, params, timeout)
                except _ClusterChanged as exc:  # another cluster answered (and applied?) it
                    last, refused = BackendConnectionError(f"etcd at {ep.base_uri}: {exc}"), False
                    self._attempt_failed(index, deadline, tries, last)
                    continue
                except (u3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
                    if self._closed:
                        raise BackendClosed(f"{type(self).__name__} was closed during a {method}") from None
                    if poll is not None and _is_read_timeout(exc):
                        self._endpoints.worked(index)
                        return None
                    last = self._transport_error(ep, method, exc)
                    if _is_tls_error(exc):
                        raise last from None
                    if _is_read_timeout(exc):
                        deadline.timed_out()
                    sent = not _not_sent(exc)
                    refused = refused and not sent
                    self._attempt_failed(index, deadline, tries if sent else None, last)
                    continue
                if answer.code in (_LEADER_ELECT, _RAFT_INTERNAL):
                    # 301: no leader, nothing applied. 300: etcd's own request timeout ran out (a
                    # proposal lost with a dead leader, say); the write may still be applied.
                    last, refused = BackendTimeout(
                        f"etcd at {ep.base_uri}: {answer.body.get('message')} ({answer.body.get('cause')})"
                    ), False
                    self._attempt_failed(index, deadline, tries if answer.code == _RAFT_INTERNAL else None, last)
                    continue
                self._check_answer(ep, answer)
                self._endpoints.worked(index)
                return answer
            if last is None:
                last = BackendTimeout(f"no etcd endpoint of {self.settings.describe()} answered in time")
            if not deadline.backoff():
                if refused and isinstance(last, BackendConnectionError):
                    raise BackendConnectionError(
                        unreachable(self.settings, f"{method} {urllib.parse.unquote(path)}", last)
                    ) from None
                if tries is not None and tries.maybe_applied:
                    raise type(last)(f"{last}; the {method} may or may not have taken effect") from None
                raise last

    def _attempt_failed(self, index: int, deadline: Deadline, tries: Tries | None, error: BaseException) -> None:
        """Book a failed attempt on endpoint ``index`` (``tries``: the attempt may have been applied)."""
        self._endpoints.failed(index)
        deadline.failed()
        if tries is not None:
            tries.maybe_applied = True
        log.debug("%s", error)  # one line per failed attempt; the caller sees the error

    def _request(self, ep: _Endpoint, method: str, path: str, params: dict[str, str], timeout: Any) -> _Answer:
        """One attempt: ``python-etcd``'s request to ``ep``; the answer, 2xx or an etcd error payload.

        ``Client.api_execute.__wrapped__`` is ``api_execute`` without its
        wrapper (the wrapper logs an ERROR line per failed request, fails over
        on its own and turns answers into exceptions): it builds the URL, the
        query string or form body and the auth header, and sends through the
        client's pool manager. Reading the answer is ours.
        """
        response = self._execute(ep.client, _KEYS + path, method, params=params, timeout=timeout)
        data = response.data or b""  # reads the whole body (an error here is a transport failure too)
        cluster = response.headers.get("X-Etcd-Cluster-Id")
        if cluster:
            previous, ep.cluster_id = ep.cluster_id, cluster
            if previous is not None and previous != cluster:
                ep.client.http.clear()  # connect afresh next time
                raise _ClusterChanged(f"the cluster ID changed from {previous} to {cluster}")
        etcd_index = int(response.headers.get("X-Etcd-Index") or 0)
        if etcd_index > self._seen:
            self._seen = etcd_index  # unlocked: a lost update only makes Tries.seen more cautious
        if response.status in (200, 201):
            try:
                return _Answer(True, json.loads(data.decode("utf-8")), etcd_index)
            except (UnicodeDecodeError, ValueError):
                raise BackendConnectionError(f"etcd at {ep.base_uri} sent a non-JSON answer") from None
        try:
            payload = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            payload = None
        if not isinstance(payload, dict):
            payload = {"message": "Bad response", "cause": data[:200].decode("utf-8", "replace")}
        payload["status"] = response.status
        if payload.get("errorCode") == _RAFT_INTERNAL and "Not a file" in str(payload.get("cause")):
            payload["errorCode"] = _NOT_FILE  # a refresh of a directory: refused, nothing applied
        return _Answer(False, payload, int(payload.get("index") or etcd_index))

    def _check_answer(self, ep: _Endpoint, answer: _Answer) -> None:
        """Raise for error answers that no operation handles itself."""
        if answer.ok:
            return
        payload = answer.body
        if answer.code is None and (payload.get("status") == 404 or "404 page not found" in str(payload.get("cause"))):
            raise self._no_v2(ep)  # Go's "404 page not found" (or another server's 404), not a v2 answer
        if answer.code == _UNAUTHORIZED or payload.get("status") == 401:
            hint = "" if self.settings.username else "; add USER:PASSWORD@ before the host in the URL"
            raise InvalidURLError(
                "username", self.settings.username,
                f"etcd at {ep.base_uri} refused access: {payload.get('message')}{hint}",
            )

    def _tries(self) -> Tries:
        return Tries(self._seen)

    def _transport_error(self, ep: _Endpoint, method: str, cause: BaseException) -> BackendUnavailable:
        where = f"etcd at {ep.base_uri}"
        if _not_sent(cause):
            return BackendConnectionError(f"cannot connect to {where}: {_reason(cause)}")
        if _is_tls_error(cause):
            return BackendConnectionError(f"TLS handshake with {where} failed: {cause}")
        if _is_read_timeout(cause):
            return BackendTimeout(f"{where} did not answer the {method} in time")
        return BackendConnectionError(f"connection to {where} lost during a {method}: {cause}")

    def _no_v2(self, ep: _Endpoint) -> InvalidURLError:
        """The error for a 404 at ``/v2/keys``: an etcd without the v2 API, or no etcd (``GET /version`` tells)."""
        host = f"[{ep.host}]" if ":" in ep.host else ep.host
        version, answered = self._etcd_version(ep)
        if version is None:
            return InvalidURLError(
                "host", f"{host}:{ep.port}",
                f"the server at {ep.base_uri} is not etcd: /v2/keys/ is not there, and GET /version answered "
                f"{answered}, not etcd's version; check the URL's host and port (etcd's client port is 2379)",
            )
        return InvalidURLError(
            "scheme",
            self.settings.scheme,
            f"the etcd server at {ep.base_uri} (etcd {version}) does not serve the v2 API that "
            f"{self.settings.scheme}:// uses (v2 is disabled: it was started without --enable-v2=true, and etcd "
            f"3.6+ has no v2 at all); use an etcd-v3:// URL (etcd-v3://{host}:{ep.port}/RUN_ID) or start etcd with "
            "--enable-v2=true",
        )

    def _etcd_version(self, ep: _Endpoint) -> tuple[str | None, str]:
        """``(etcd's server version or None, what GET /version answered)``; etcd 3.5 serves it without v2 too."""
        seconds = min(call_budget(self.settings.operation_timeout), 2.0)
        try:
            response = self._execute(ep.client, "/version", "GET", params={},
                                     timeout=self._u3.Timeout(connect=seconds, read=seconds))
            data = response.data or b""
        except (self._u3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
            return None, f"nothing ({_reason(exc)})"
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            body = None
        if response.status == 200 and isinstance(body, dict) and "etcdserver" in body:
            return str(body["etcdserver"]), "etcd's version"
        first_line = data.split(b"\n", 1)[0][:60]
        return None, f"HTTP {response.status} {first_line!r}"

    def _probe(self, deadline: Deadline) -> None:
        """Check at open that some endpoint serves the v2 API."""
        answer = self._call("GET", "/", {}, deadline)
        if not answer.ok and answer.code != _KEY_NOT_FOUND:
            raise BackendConnectionError(f"etcd v2 probe failed: {answer.body.get('message')}")

    def _deadline(self) -> Deadline:
        """One operation's deadline: ``operation_timeout``, or the caller's (``rdzv_core.kv.deadline``) if sooner."""
        return Deadline(call_budget(self.settings.operation_timeout))

    # -- reads -------------------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        answer = self._call("GET", _node_path(key), {}, self._deadline())
        if not answer.ok:
            if answer.code in (_KEY_NOT_FOUND, _NOT_DIR):
                return None
            raise self._unexpected(answer, key)
        return _entry(key, answer.body["node"])

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        answer = self._call("GET", _dir_path(prefix), {"recursive": "true"}, self._deadline())
        if not answer.ok:
            if answer.code in (_KEY_NOT_FOUND, _NOT_DIR):
                return [], answer.etcd_index
            raise self._unexpected(answer, prefix)
        entries = []
        for node in _nodes(answer.body["node"]):
            key = _key_of(node.get("key", ""))
            if key is not None and key.startswith(prefix):
                entries.append(_entry(key, node))
        return sorted(entries, key=lambda e: e.key), answer.etcd_index

    def _do_ttl_remaining(self, key: str) -> float | None:
        """The node's ``ttl``: the server's remaining whole seconds (rounded up)."""
        node = self._read_node(key, self._deadline())
        if node is None:
            raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
        if node.get("dir"):
            raise _dir_error(key)
        ttl = node.get("ttl")
        return None if ttl is None else float(max(0, int(ttl)))

    # -- writes ------------------------------------------------------------------
    def _write(self, key: str, params: dict[str, str], deadline: Deadline, tries: Tries | None = None) -> _Answer:
        answer = self._call("PUT", _node_path(key), params, deadline, tries)
        if answer.code in (_NOT_FILE, _NOT_DIR):
            raise self._unexpected(answer, key)
        return answer

    def _read_node(self, key: str, deadline: Deadline) -> dict[str, Any] | None:
        """The v2 node at ``key`` (a value or a directory), ``None`` if absent."""
        answer = self._call("GET", _node_path(key), {}, deadline)
        if not answer.ok:
            if answer.code in (_KEY_NOT_FOUND, _NOT_DIR):
                return None
            raise self._unexpected(answer, key)
        node: dict[str, Any] = answer.body["node"]
        return node

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        deadline, tries = self._deadline(), self._tries()
        params = _value_params(value, ttl, prevExist="false")
        answer = self._write(key, params, deadline, tries)
        if answer.code == _NODE_EXISTS:
            node = self._read_node(key, deadline)  # a key, or a directory?
            if node is not None and node.get("dir"):
                raise _dir_error(key)
            if tries.maybe_applied and (node is None or not tries.predates(int(node["createdIndex"]))):
                if node is not None and _own_write(node, params, tries, created=True):
                    return _entry(key, node)
                raise may_have_applied(f"create({key!r})", key)
            raise KeyExists(f"key {key!r} exists", key)
        if not answer.ok:
            raise self._unexpected(answer, key)
        return _entry(key, answer.body["node"])

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        answer = self._write(key, _value_params(value, ttl), self._deadline())
        if not answer.ok:
            raise self._unexpected(answer, key)
        return _entry(key, answer.body["node"])

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        deadline, tries = self._deadline(), self._tries()
        params = _value_params(value, ttl, prevIndex=str(expected_revision))
        answer = self._write(key, params, deadline, tries)
        if answer.ok:
            return _entry(key, answer.body["node"])
        if tries.maybe_applied and not self._conflict_predates(answer, tries):
            node = self._read_node(key, deadline)
            if node is not None and not node.get("dir") and _own_write(node, params, tries):
                return _entry(key, node)
            raise may_have_applied(f"compare_and_swap({key!r})", key)
        raise self._compare_error(answer, key, expected_revision)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        deadline, tries = self._deadline(), self._tries()
        answer = self._call("DELETE", _node_path(key), {"prevIndex": str(expected_revision)}, deadline, tries)
        if answer.ok:
            self._prune(key, deadline)
            return
        if tries.maybe_applied and not self._conflict_predates(answer, tries):
            raise may_have_applied(f"compare_and_delete({key!r})", key)
        raise self._compare_error(answer, key, expected_revision)

    def _conflict_predates(self, answer: _Answer, tries: Tries) -> bool:
        """Whether a failed compare shows a node state older than the request (so the conflict is genuine).

        Only error 101 tells: its cause ends ``[prevIndex != modifiedIndex]``.
        An absent key (100) may be this write's own doing followed by a delete,
        an existing one (105) this write's own create. Answers that are no
        conflict count as genuine (the caller raises them as usual).
        """
        if answer.code != _COMPARE_FAILED:
            return answer.code not in (_KEY_NOT_FOUND, _NODE_EXISTS)
        current = _current_index(str(answer.body.get("cause", "")))
        return current is not None and tries.predates(current)

    def _do_delete(self, key: str) -> bool:
        deadline = self._deadline()
        answer = self._call("DELETE", _node_path(key), {}, deadline)
        if answer.code == _NOT_FILE:  # a directory where the key belongs: remove it and what it holds
            answer = self._call("DELETE", _node_path(key), {"recursive": "true"}, deadline)
        elif answer.code == _NOT_DIR:  # a foreign value node where a directory of the key's path belongs
            self._delete_blocking(key, str(answer.body.get("cause", "")), deadline)
            return False
        if answer.ok:
            self._prune(key, deadline)
            return True
        if answer.code == _KEY_NOT_FOUND:
            return False
        raise self._unexpected(answer, key)

    def _prune(self, key: str, deadline: Deadline) -> None:
        """After ``key`` was deleted, remove the directories on its path that it left empty (v2 makes them
        implicitly, so each round left its own behind), deepest first, never the root.

        ``DELETE ?dir=true`` removes only an EMPTY directory (errorCode 108 otherwise, which ends the walk), so a
        key created in it concurrently is never lost: etcd applies one of the two first. Costs one request for
        the first directory that still holds something; a failure only leaves an empty directory behind.
        """
        segments = _node_segments(key)[:-1]
        while segments:
            path = "".join("/" + urllib.parse.quote(s, safe="") for s in segments)
            try:
                answer = self._call("DELETE", path, {"dir": "true"}, deadline)
            except (BackendUnavailable, BackendClosed) as exc:
                log.debug("empty etcd v2 directory %s left behind: %s", path, exc)
                return
            if not answer.ok and answer.code != _KEY_NOT_FOUND:  # 108: not empty (or not ours to remove)
                return
            segments.pop()

    def _delete_blocking(self, key: str, node_key: str, deadline: Deadline) -> None:
        """Delete the value node ``node_key`` that stands where a directory of ``key``'s node path belongs."""
        if not _node_key(key).startswith(node_key.rstrip("/") + "/") or _key_of(node_key) is not None:
            return  # not a proper ancestor, or one of our own keys: leave it
        path = "".join("/" + urllib.parse.quote(s, safe="") for s in node_key.strip("/").split("/"))
        log.warning("deleting etcd v2 node %s (not written by rdzv): it blocks key %r", node_key, key)
        answer = self._call("DELETE", path, {}, deadline)
        if not answer.ok and answer.code != _KEY_NOT_FOUND:
            raise self._unexpected(answer, key)

    def _do_refresh(self, key: str, ttl: float) -> None:
        params = {"ttl": str(ttl_seconds(ttl)), "refresh": "true", "prevExist": "true"}
        answer = self._write(key, params, self._deadline())
        if answer.code == _KEY_NOT_FOUND:
            raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
        if not answer.ok:
            raise self._unexpected(answer, key)

    def _do_add(self, key: str, delta: int) -> int:
        return self._adds.add(key, delta, self._deadline(), lambda total, dl: self._add_once(key, total, dl))

    def _add_once(self, key: str, delta: int, deadline: Deadline) -> int:
        """Add ``delta`` to ``key`` with one successful compare-and-swap; return the new value.

        See "Writes" in the module docstring for the attempts and when they read.

        Raises:
            CorruptEntry: the key holds a non-decimal value or is a directory (nothing written).
            BackendTimeout: every attempt lost a race until the operation deadline; or an
                attempt that may have been applied was followed by a lost race, so the add
                may or may not have taken effect (see ``Tries``; it is never applied twice).
        """
        known: _Counter | None = self._counters.get(key)
        read = known is None
        race = RaceRetry(deadline)
        while True:
            if read:
                known, read = self._read_counter(key, deadline), False
            if known is None:
                total = delta
                params = {"value": _b64(str(total).encode("ascii")), "prevExist": "false"}
            else:
                total = parse_counter(key, _decode(key, known.raw)) + delta
                params = {"value": _b64(str(total).encode("ascii")), "prevIndex": str(known.modified),
                          "prevValue": known.raw}
                if known.ttl is not None:  # keep the key's TTL (remaining whole seconds)
                    params["ttl"] = str(max(1, known.ttl))
            tries = self._tries()
            answer = self._write(key, params, deadline, tries)
            if answer.ok:  # a success proves that no earlier attempt was applied (see Tries)
                node = answer.body["node"]
                self._remember(key, _Counter(node["value"], int(node["modifiedIndex"]), node.get("ttl")))
                return total
            if tries.maybe_applied and not self._conflict_predates(answer, tries):
                self._counters.pop(key, None)
                raise may_have_applied(f"add({key!r})", key)  # adding again could count twice
            if answer.code == _COMPARE_FAILED and known is not None:
                current = None if known.ttl is not None else _after_compare_failed(known, str(answer.body.get("cause")))
                progressed, read = True, current is None
                known = current
            elif answer.code == _KEY_NOT_FOUND:  # deleted (or expired) since it was seen
                progressed, known = known is not None, None
            elif answer.code == _NODE_EXISTS:  # created since it was seen absent
                progressed, read = True, True
            else:
                raise self._unexpected(answer, key)
            self._counters.pop(key, None)  # only states this backend wrote are remembered (never corrupt ones)
            if not race.again(progressed):
                raise BackendTimeout(
                    f"add({key!r}) lost {race.attempts} races in a row to other writers of the key within "
                    f"operation_timeout={self.settings.operation_timeout:g} s", key
                )

    def _read_counter(self, key: str, deadline: Deadline) -> _Counter | None:
        """The counter node at ``key`` (``None`` if absent); :class:`CorruptEntry` for a directory."""
        node = self._read_node(key, deadline)
        if node is None:
            return None
        if node.get("dir"):
            raise _dir_error(key)
        ttl = node.get("ttl")
        return _Counter(str(node.get("value", "")), int(node["modifiedIndex"]), None if ttl is None else int(ttl))

    def _remember(self, key: str, counter: _Counter) -> None:
        """Note the state ``add`` wrote at ``key`` (a decimal value, so a later add never fails on a
        remembered state: only on one the server answered), unless the key has a TTL (its TTL runs
        down, so such a counter is read each time).

        Bounded; a stale entry costs one lost attempt, whose answer has the current state.
        """
        if counter.ttl is not None:
            self._counters.pop(key, None)
            return
        if len(self._counters) >= _COUNTER_CACHE:
            self._counters.clear()
        self._counters[key] = counter

    # -- watch -------------------------------------------------------------------
    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        poll = Deadline(timeout)
        failures = FailureBudget(call_budget(self.settings.operation_timeout), poll)
        wait_index = after_revision + 1
        while True:
            params = {"wait": "true", "recursive": "true", "waitIndex": str(wait_index)}
            answer = self._send("GET", _dir_path(prefix), params, failures, tries=None, poll=poll)
            if answer is None:
                return []
            if not answer.ok:
                if answer.code == _INDEX_CLEARED:
                    raise HistoryCompacted(
                        f"etcd v2 no longer has the events after index {after_revision} "
                        f"({answer.body.get('cause')}); re-read and watch from the index read",
                        prefix,
                    )
                raise self._unexpected(answer, prefix)
            event = _event(answer.body, prefix)
            if event is not None:
                return [event]
            wait_index = int(answer.body["node"]["modifiedIndex"]) + 1  # a refresh or a directory: skip
            if poll.expired():
                return []

    # -- helpers -----------------------------------------------------------------
    def _compare_error(self, answer: _Answer, key: str, expected: int) -> KVError:
        if answer.code in (_KEY_NOT_FOUND, _NOT_DIR):
            return KeyNotFound(f"key {key!r} not found", key)
        if answer.code == _COMPARE_FAILED:
            match = _INDEX_MOVED.fullmatch(str(answer.body.get("cause", "")))
            actual = int(match.group(2)) if match else None
            return CompareFailed(f"key {key!r} is at revision {actual}, not {expected}", key, expected, actual)
        return self._unexpected(answer, key)

    def _unexpected(self, answer: _Answer, key: str) -> KVError:
        body = answer.body
        if answer.code == _NOT_FILE:
            return _dir_error(key)
        if answer.code == _NOT_DIR:
            return CorruptEntry(
                f"etcd v2 holds a value at node {body.get('cause')} (made by another program), where a directory "
                f"on the path of key {key!r} belongs; delete({key!r}) or `rdzv reset` removes it", key
            )
        return KVError(f"etcd v2 error {body.get('errorCode')} on {key!r}: {body.get('message')} "
                       f"({body.get('cause')})", key)

    def _do_close(self) -> None:
        for ep in getattr(self, "_eps", ()):
            ep.client.http.clear()  # closes the idle connections of the client's pools


def _reason(cause: BaseException) -> str:
    """The useful part of a connection error (urllib3 repeats the pool's repr first)."""
    text = str(cause)
    return text.split(": ", 1)[1] if text.startswith(("HTTPConnection(", "HTTPSConnection(")) and ": " in text else text


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _value_params(value: bytes, ttl: float | None, **extra: str) -> dict[str, str]:
    params = {"value": _b64(value), **extra}
    if ttl is not None:
        params["ttl"] = str(ttl_seconds(ttl))
    return params


_ACTIONS = {
    "set": EventType.PUT,
    "create": EventType.PUT,
    "update": EventType.PUT,
    "compareAndSwap": EventType.PUT,
    "delete": EventType.DELETE,
    "compareAndDelete": EventType.DELETE,
    "expire": EventType.DELETE,
}


def _event(body: dict[str, Any], prefix: str) -> Event | None:
    """The :class:`Event` of a v2 watch answer, ``None`` if it is not one to report."""
    node = body.get("node", {})
    kind = _ACTIONS.get(body.get("action", ""))
    if kind is None or node.get("dir") or body.get("refresh"):
        return None
    key = _key_of(node.get("key", ""))
    if key is None or not key.startswith(prefix):
        return None
    value = _decode(key, node.get("value", "")) if kind is EventType.PUT else None
    return Event(kind, key, int(node["modifiedIndex"]), value)


def _open(url: RendezvousURL) -> EtcdV2Backend:
    return EtcdV2Backend(EtcdSettings.from_url(url))


#: Registers ``etcd://`` and ``etcd-v2://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    BackendSpec(
        schemes=("etcd-v2", "etcd"),
        open=_open,
        capabilities=EtcdV2Backend.capabilities,
        default_port=DEFAULT_PORT,
        query_keys=QUERY_KEYS,
        requires_host=True,
        description="etcd v2 API (servers started with --enable-v2), python-etcd",
    )
)
