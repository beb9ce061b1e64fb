"""``etcd://`` and ``etcd-v2://`` — etcd's v2 API, the seed's backend (client: ``python-etcd``).

::

    etcd-v2://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/RUN_ID?protocol=https&cacert=...&cert=...&key=...

The v2 API exists only on servers started with ``--enable-v2=true`` (etcd 3.4
and 3.5; gone in 3.6). Against a server without it, opening the backend fails
at once with :class:`~rdzv_core.errors.InvalidURLError` pointing to
``etcd-v3://``. Query keys are described in :mod:`rdzv_backends._etcd_common`.

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
    default ``--max-request-bytes``.
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
    ``compare_and_delete`` a ``DELETE`` with ``prevIndex``; ``add`` is a
    read/``prevIndex`` loop with jittered backoff until ``operation_timeout``.
Watch
    A long poll ``wait=true&recursive=true&waitIndex=after+1`` on the prefix's
    directory; it returns one event per call (the contract allows fewer than
    all). etcd keeps the last 1,000 v2 events; an older ``waitIndex`` answers
    "event index cleared" (401), raised as
    :class:`~rdzv_core.errors.HistoryCompacted`.
Failures
    Each operation has ``operation_timeout`` seconds (query key, default 10).
    Connection refused moves to the next endpoint of the URL and, after a
    round of failures, retries with jittered backoff until the deadline, then
    raises :class:`~rdzv_core.errors.BackendConnectionError`. A request that
    may have reached the server (read timeout, connection lost mid-answer,
    raft timeout) is retried only if repeating it is harmless (reads, ``put``,
    ``delete``, ``refresh``); ``create``, the compare-and-* writes and ``add``
    raise :class:`~rdzv_core.errors.BackendTimeout` / ``BackendConnectionError``
    instead of risking a second application. "Leader election in progress"
    (errorCode 301) is retried until the deadline. urllib3's own retries are
    disabled so a timeout is not multiplied. A watch retries a lost long poll
    for ``operation_timeout`` seconds from the failure (never past its own
    timeout); a server that is silent (paused) looks like a quiet one to it.
Auth
    ``USER:PASSWORD@`` in the URL is sent as HTTP basic auth (etcd v2 auth);
    the password never appears in logs, ``repr`` or error messages.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import urllib.parse
from typing import Any, NamedTuple

from rdzv_core.errors import (
    BackendConnectionError,
    BackendTimeout,
    BackendUnavailable,
    CompareFailed,
    HistoryCompacted,
    InvalidKeyError,
    InvalidURLError,
    KeyExists,
    KeyNotFound,
    KVError,
)
from rdzv_core.kv import Capabilities, Entry, Event, EventType, KVBackend, check_key, parse_counter
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL

from ._etcd_common import (
    DEFAULT_PORT,
    MAX_VALUE_BYTES,
    QUERY_KEYS,
    Deadline,
    Endpoints,
    EtcdSettings,
    FailureBudget,
    ttl_seconds,
)

__all__ = ["EtcdV2Backend", "plugin"]

_LEAF = "!"
#: Shortest long poll (seconds): ``watch(timeout=0)`` still asks the server once.
_MIN_POLL = 0.2
_KEYS = "/v2/keys"
# v2 errorCodes (etcd Documentation/v2/errorcode.md)
_KEY_NOT_FOUND, _COMPARE_FAILED, _NOT_FILE, _NOT_DIR, _NODE_EXISTS = 100, 101, 102, 104, 105
_UNAUTHORIZED, _RAFT_INTERNAL, _LEADER_ELECT, _INDEX_CLEARED = 110, 300, 301, 401


class _Answer(NamedTuple):
    """One v2 answer: ``ok`` (2xx), the JSON body (or error payload), the ``X-Etcd-Index``."""

    ok: bool
    body: dict[str, Any]
    etcd_index: int

    @property
    def code(self) -> int | None:
        return None if self.ok else self.body.get("errorCode")


# -- key and value mapping -------------------------------------------------------
def _node_path(key: str) -> str:
    """The URL path (quoted) of ``key``'s v2 node: ``a/b/c`` -> ``/a/b/!c``."""
    *dirs, leaf = key.split("/")
    return "".join("/" + urllib.parse.quote(_dir_segment(d), safe="") for d in dirs) + "/" + urllib.parse.quote(
        _LEAF + leaf, safe=""
    )


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


def _decode(node: dict[str, Any]) -> bytes:
    try:
        return base64.b64decode(node.get("value", ""), validate=True)
    except (binascii.Error, ValueError):
        raise KVError(f"etcd v2 node {node.get('key')!r} does not hold base64 data", node.get("key")) from None


def _entry(key: str, node: dict[str, Any]) -> Entry:
    return Entry(key, _decode(node), int(node["modifiedIndex"]))


def _leaves(node: dict[str, Any]) -> list[dict[str, Any]]:
    """All non-directory nodes in a (recursive) v2 answer."""
    if not node.get("dir"):
        return [node]
    out: list[dict[str, Any]] = []
    for child in node.get("nodes", ()):
        out.extend(_leaves(child))
    return out


# -- failure classification --------------------------------------------------------
def _not_sent(cause: BaseException | None) -> bool:
    """True if the request cannot have reached the server (connecting failed)."""
    import urllib3.exceptions as u3

    return isinstance(cause, (u3.NewConnectionError, u3.ConnectTimeoutError)) or isinstance(
        cause, ConnectionRefusedError
    )


def _is_read_timeout(cause: BaseException | None) -> bool:
    import urllib3.exceptions as u3

    return isinstance(cause, (u3.ReadTimeoutError, TimeoutError))


def _is_tls_error(cause: BaseException | None) -> bool:
    import ssl

    import urllib3.exceptions as u3

    return isinstance(cause, (u3.SSLError, ssl.SSLError))


class EtcdV2Backend(KVBackend):
    """KV backend on etcd's v2 API; see the module docstring for the mapping.

    Args:
        settings: endpoints, TLS, credentials and ``operation_timeout``.

    Raises:
        InvalidURLError: the server does not serve the v2 API (started without
            ``--enable-v2``), or rejected the credentials.
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

        self._etcd = etcd
        self.settings = settings
        self._endpoints = Endpoints(len(settings.endpoints))
        cert: str | tuple[str, str] | None = None
        if settings.cert is not None:
            cert = (settings.cert, settings.key) if settings.key else settings.cert
        self._clients = []
        for host, port in settings.endpoints:
            client = etcd.Client(
                host=f"[{host}]" if ":" in host else host,
                port=port,
                protocol=settings.protocol,
                cert=cert,
                ca_cert=settings.ca_cert,
                username=settings.username,
                password=settings.password,
                read_timeout=settings.operation_timeout,
                allow_reconnect=False,  # failover is ours: bounded by the operation's deadline
                allow_redirect=False,
            )
            # No urllib3 retries: one attempt per request, so timeouts are not multiplied.
            client.http.connection_pool_kw["retries"] = False
            self._clients.append(client)
        try:
            self._probe()
        except BaseException:
            self._do_close()
            raise

    def __repr__(self) -> str:
        return f"EtcdV2Backend({self.settings.describe()!r})"

    # -- transport ---------------------------------------------------------------
    def _call(self, method: str, path: str, params: dict[str, str], deadline: Deadline, *, safe: bool) -> _Answer:
        """Send one request, failing over between endpoints until ``deadline``.

        Args:
            safe: the request may be repeated (a read): retry after any transport failure.

        Returns:
            The :class:`_Answer`: a 2xx answer or an etcd error payload.

        Raises:
            BackendConnectionError, BackendTimeout: see the module docstring.
            InvalidURLError: the server does not serve the v2 API, or refused the credentials.
        """
        answer = self._send(method, path, params, deadline, safe=safe, poll=None)
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
        safe: bool,
        poll: Deadline | None,
    ) -> _Answer | None:
        """:meth:`_call`; with ``poll`` (a watch's deadline) a long poll that times out returns ``None``."""
        etcd = self._etcd
        last: BackendUnavailable | None = None
        while True:
            for index in self._endpoints.order():
                self._check_open()
                per_try = deadline.remaining() if poll is None else max(poll.remaining(), _MIN_POLL)
                if per_try <= 0:
                    break
                client = self._clients[index]
                try:
                    response = client.api_execute(_KEYS + path, method, params=params, timeout=per_try)
                except etcd.EtcdWatchTimedOut:
                    self._endpoints.worked(index)
                    return None
                except etcd.EtcdConnectionFailed as exc:
                    cause = exc.cause if isinstance(exc.cause, BaseException) else None
                    self._endpoints.failed(index)
                    deadline.failed()
                    last = self._transport_error(client, method, cause)
                    if _is_tls_error(cause) or not (safe or _not_sent(cause)):
                        raise last from None
                    continue
                except etcd.EtcdClusterIdChanged as exc:  # another cluster answered (and applied?) it
                    self._endpoints.failed(index)
                    deadline.failed()
                    last = BackendConnectionError(f"etcd at {client.base_uri}: {exc}")
                    if not safe:
                        raise last from None
                    continue
                except etcd.EtcdException as exc:
                    payload = exc.payload if isinstance(exc.payload, dict) else {}
                    answer = _Answer(False, payload, int(payload.get("index") or 0))
                    if answer.code == _LEADER_ELECT or (answer.code == _RAFT_INTERNAL and safe):
                        self._endpoints.failed(index)
                        deadline.failed()
                        last = BackendTimeout(f"etcd at {client.base_uri}: {payload.get('message')} "
                                              f"({payload.get('cause')})")
                        continue
                    self._check_answer(client, method, answer)
                    self._endpoints.worked(index)
                    return answer
                self._endpoints.worked(index)
                try:
                    body = json.loads(response.data.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    raise BackendConnectionError(f"etcd at {client.base_uri} sent a non-JSON answer") from None
                return _Answer(True, body, int(response.headers.get("X-Etcd-Index") or 0))
            if last is None:
                last = BackendTimeout(f"no etcd endpoint of {self.settings.describe()} answered in time")
            if not deadline.backoff():
                raise last

    def _check_answer(self, client: Any, method: str, answer: _Answer) -> None:
        """Raise for error answers that no operation handles itself."""
        payload = answer.body
        if answer.code is None and (payload.get("status") == 404 or "404 page not found" in str(payload.get("cause"))):
            raise self._v2_disabled(client)  # Go's "404 page not found", not a v2 answer
        if answer.code == _RAFT_INTERNAL:
            raise BackendTimeout(
                f"etcd at {client.base_uri} did not apply the {method} in time "
                f"({payload.get('cause')}); it may or may not have taken effect"
            )
        if answer.code == _UNAUTHORIZED or payload.get("status") == 401:
            hint = "" if self.settings.username else "; add USER:PASSWORD@ before the host in the URL"
            raise InvalidURLError(
                "username", self.settings.username,
                f"etcd at {client.base_uri} refused access: {payload.get('message')}{hint}",
            )

    def _transport_error(self, client: Any, method: str, cause: BaseException | None) -> BackendUnavailable:
        where = f"etcd at {client.base_uri}"
        if _not_sent(cause):
            return BackendConnectionError(f"cannot connect to {where}: {cause}")
        if _is_tls_error(cause):
            return BackendConnectionError(f"TLS handshake with {where} failed: {cause}")
        if _is_read_timeout(cause):
            return BackendTimeout(f"{where} did not answer the {method} in time")
        return BackendConnectionError(f"connection to {where} lost during a {method}: {cause}")

    def _v2_disabled(self, client: Any) -> InvalidURLError:
        return InvalidURLError(
            "scheme",
            "etcd-v2",
            f"the etcd server at {client.base_uri} does not serve the v2 API (v2 is disabled: it was started "
            "without --enable-v2=true, and etcd 3.6+ has no v2 at all); use an etcd-v3:// URL "
            f"(etcd-v3://{client.host}:{client.port}/RUN_ID) or start etcd with --enable-v2=true",
        )

    def _probe(self) -> None:
        """Check at open that some endpoint serves the v2 API."""
        answer = self._call("GET", "/", {}, Deadline(self.settings.operation_timeout), safe=True)
        if not answer.ok and answer.code != _KEY_NOT_FOUND:
            raise BackendConnectionError(f"etcd v2 probe failed: {answer.body.get('message')}")

    def _deadline(self) -> Deadline:
        return Deadline(self.settings.operation_timeout)

    # -- reads -------------------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        answer = self._call("GET", _node_path(key), {}, self._deadline(), safe=True)
        if not answer.ok:
            if answer.code in (_KEY_NOT_FOUND, _NOT_DIR):
                return None
            raise self._unexpected(answer, key)
        node = answer.body["node"]
        return None if node.get("dir") else _entry(key, node)

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        answer = self._call("GET", _dir_path(prefix), {"recursive": "true"}, self._deadline(), safe=True)
        if not answer.ok:
            if answer.code in (_KEY_NOT_FOUND, _NOT_DIR):
                return [], answer.etcd_index
            raise self._unexpected(answer, prefix)
        entries = []
        for node in _leaves(answer.body["node"]):
            key = _key_of(node.get("key", ""))
            if key is not None and key.startswith(prefix):
                entries.append(_entry(key, node))
        return sorted(entries, key=lambda e: e.key), answer.etcd_index

    # -- writes ------------------------------------------------------------------
    def _write(self, key: str, params: dict[str, str], deadline: Deadline, *, safe: bool) -> _Answer:
        answer = self._call("PUT", _node_path(key), params, deadline, safe=safe)
        if answer.code == _NOT_DIR:
            raise KVError(
                f"etcd v2 cannot store {key!r}: a directory on its path is missing or a value "
                f"({answer.body.get('cause')})",
                key,
            )
        return answer

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        answer = self._write(key, _value_params(value, ttl, prevExist="false"), self._deadline(), safe=False)
        if answer.code == _NODE_EXISTS:
            raise KeyExists(f"key {key!r} exists", key)
        if not answer.ok:
            raise self._unexpected(answer, key)
        return _entry(key, answer.body["node"])

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        answer = self._write(key, _value_params(value, ttl), self._deadline(), safe=True)
        if not answer.ok:
            raise self._unexpected(answer, key)
        return _entry(key, answer.body["node"])

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        params = _value_params(value, ttl, prevIndex=str(expected_revision))
        answer = self._write(key, params, self._deadline(), safe=False)
        if not answer.ok:
            raise self._compare_error(answer, key, expected_revision)
        return _entry(key, answer.body["node"])

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        params = {"prevIndex": str(expected_revision)}
        answer = self._call("DELETE", _node_path(key), params, self._deadline(), safe=False)
        if not answer.ok:
            raise self._compare_error(answer, key, expected_revision)

    def _do_delete(self, key: str) -> bool:
        answer = self._call("DELETE", _node_path(key), {}, self._deadline(), safe=True)
        if answer.ok:
            return True
        if answer.code in (_KEY_NOT_FOUND, _NOT_DIR):
            return False
        raise self._unexpected(answer, key)

    def _do_refresh(self, key: str, ttl: float) -> None:
        params = {"ttl": str(ttl_seconds(ttl)), "refresh": "true", "prevExist": "true"}
        answer = self._write(key, params, self._deadline(), safe=True)
        if answer.code == _KEY_NOT_FOUND:
            raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
        if not answer.ok:
            raise self._unexpected(answer, key)

    def _do_add(self, key: str, delta: int) -> int:
        deadline = self._deadline()
        while True:
            current = self._call("GET", _node_path(key), {}, deadline, safe=True)
            if current.ok and not current.body["node"].get("dir"):
                node = current.body["node"]
                total = parse_counter(key, _decode(node)) + delta
                params = {"value": _b64(str(total).encode("ascii")), "prevIndex": str(node["modifiedIndex"])}
                if node.get("ttl") is not None:  # keep the key's TTL (remaining whole seconds)
                    params["ttl"] = str(max(1, int(node["ttl"])))
            elif current.ok or current.code in (_KEY_NOT_FOUND, _NOT_DIR):
                total = delta
                params = {"value": _b64(str(total).encode("ascii")), "prevExist": "false"}
            else:
                raise self._unexpected(current, key)
            answer = self._write(key, params, deadline, safe=False)
            if answer.ok:
                return total
            if answer.code not in (_COMPARE_FAILED, _NODE_EXISTS, _KEY_NOT_FOUND):
                raise self._unexpected(answer, key)
            if not deadline.backoff():  # lost a race: another writer changed the key
                raise BackendTimeout(f"add({key!r}) lost every race for {self.settings.operation_timeout} s", key)

    # -- watch -------------------------------------------------------------------
    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        poll = Deadline(timeout)
        failures = FailureBudget(self.settings.operation_timeout, poll)
        wait_index = after_revision + 1
        while True:
            params = {"wait": "true", "recursive": "true", "waitIndex": str(wait_index)}
            answer = self._send("GET", _dir_path(prefix), params, failures, safe=True, poll=poll)
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
        if answer.code in (_KEY_NOT_FOUND, _NOT_FILE, _NOT_DIR):
            return KeyNotFound(f"key {key!r} not found", key)
        if answer.code == _COMPARE_FAILED:
            match = re.search(r"!= (\d+)\]", str(answer.body.get("cause", "")))
            actual = int(match.group(1)) if match else None
            return CompareFailed(f"key {key!r} is at revision {actual}, not {expected}", key, expected, actual)
        return self._unexpected(answer, key)

    def _unexpected(self, answer: _Answer, key: str) -> KVError:
        body = answer.body
        if answer.code == _NOT_FILE:
            return KVError(f"etcd v2 holds a directory at {key!r} (not written by this backend)", key)
        return KVError(f"etcd v2 error {body.get('errorCode')} on {key!r}: {body.get('message')} "
                       f"({body.get('cause')})", key)

    def _do_close(self) -> None:
        for client in self._clients:
            client.http.clear()


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
    value = _decode(node) if kind is EventType.PUT else None
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
