"""Requests to etcd's v2 API through ``python-etcd``, with failover between endpoints and deadlines.

Each endpoint gets one ``etcd.Client`` (no reconnection, member discovery or redirects) whose request code
(``Client.api_execute`` without its logging, self-failing-over wrapper) builds and sends each request;
reading answers, failover, deadlines and retries are ours (``docs/backends/etcd-v2.md``, "Failures").
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import urllib.parse
from typing import Any, Callable

import etcd
import urllib3
import urllib3.exceptions as u3

from rdzv_core.errors import (
    BackendClosedError,
    BackendConnectionError,
    BackendTimeoutError,
    BackendUnavailableError,
    InvalidURLError,
    KVError,
)
from rdzv_core.kv import call_budget

from .._etcd.budget import AttemptDeadline, Tries
from .._etcd.endpoints import Endpoints
from .._etcd.errors import Failure, give_up, transport_error
from .._etcd.probe import answered, etcd_version, not_etcd
from .._etcd.settings import EtcdSettings
from .mapping import KEY_NOT_FOUND, LEADER_ELECT, NOT_FILE, RAFT_INTERNAL, UNAUTHORIZED, Answer

__all__ = ["POOL_CONNECTIONS", "Transport"]

log = logging.getLogger(__name__)

#: Idle keep-alive connections kept per endpoint: a request in flight and a watch's long poll hold one
#: each; beyond this many at once the extra connections are closed after use (urllib3 logs it).
POOL_CONNECTIONS = 1024

#: Shortest long poll (seconds): ``watch(timeout=0)`` still asks the server once.
_MIN_POLL = 0.2
_KEYS = "/v2/keys"


class _ClusterChanged(Exception):
    """An endpoint answered with another ``X-Etcd-Cluster-Id`` than before."""


def _failure(cause: BaseException) -> Failure:
    """How a urllib3 / ``http.client`` / socket error failed."""
    if isinstance(cause, (u3.NewConnectionError, u3.ConnectTimeoutError, ConnectionRefusedError)):
        return Failure.NOT_SENT
    if isinstance(cause, (u3.SSLError, ssl.SSLError)):
        return Failure.TLS
    if isinstance(cause, (u3.ReadTimeoutError, TimeoutError)):
        return Failure.TIMED_OUT
    return Failure.LOST


def _reason(cause: BaseException) -> str:
    """The useful part of a connection error (urllib3 repeats the pool's repr first)."""
    text = str(cause)
    return text.split(": ", 1)[1] if text.startswith(("HTTPConnection(", "HTTPSConnection(")) and ": " in text else text


class _Endpoint:
    """One etcd endpoint: its ``python-etcd`` client (URI, TLS, basic auth, urllib3 pools) and cluster ID."""

    def __init__(self, host: str, port: int, settings: EtcdSettings) -> None:
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


class Transport:
    """The v2 requests of one backend object, over every endpoint of its URL (thread-safe).

    Args:
        settings: endpoints, TLS, credentials and ``operation_timeout``.
        check_open: raises :class:`~rdzv_core.errors.BackendClosedError` once the backend is closed.
        is_closed: whether the backend has been closed (a failure then raises ``BackendClosedError``).

    Raises:
        InvalidURLError: the URL names a user without a password.
        KVError: the installed ``python-etcd`` lacks ``Client.api_execute.__wrapped__``.
    """

    def __init__(self, settings: EtcdSettings, check_open: Callable[[], None], is_closed: Callable[[], bool]) -> None:
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
        self._check_open = check_open
        self._is_closed = is_closed
        self.settings = settings
        self.endpoints = Endpoints(len(settings.endpoints))
        self._eps = [_Endpoint(host, port, settings) for host, port in settings.endpoints]
        self.seen = 0  # the highest X-Etcd-Index answered so far (see Tries)

    def tries(self) -> Tries:
        """A :class:`~rdzv_backends._etcd.budget.Tries` for a compare-guarded write sent now."""
        return Tries(self.seen)

    def call(
        self, method: str, path: str, params: dict[str, str], deadline: AttemptDeadline, tries: Tries | None = None,
        *, resend: bool = True,
    ) -> Answer:
        """Send one request, failing over between endpoints until ``deadline``.

        Each attempt gets :meth:`~rdzv_backends._etcd.budget.AttemptDeadline.attempt` seconds; every transport
        failure is retried.

        Args:
            path: the quoted path below ``/v2/keys``.
            tries: for a compare-guarded write: marked when an attempt failed after it may have reached etcd.
            resend: ``False``: no attempt after one that may have reached etcd (a write that must not be
                applied twice, such as an in-order key); the call raises ``BackendTimeoutError`` instead.

        Returns:
            The :class:`~.mapping.Answer`: a 2xx answer or an etcd error payload.

        Raises:
            BackendConnectionError, BackendTimeoutError: no endpoint answered in time (see ``errors.give_up``).
            InvalidURLError: the server does not serve the v2 API, or refused the credentials.
        """
        answer = self.send(method, path, params, deadline, tries=tries, poll=None, resend=resend)
        if answer is None:  # only long polls time out quietly
            raise BackendTimeoutError(f"etcd {method} {path} timed out")
        return answer

    def send(
        self,
        method: str,
        path: str,
        params: dict[str, str],
        deadline: AttemptDeadline,
        *,
        tries: Tries | None,
        poll: AttemptDeadline | None,
        resend: bool = True,
    ) -> Answer | None:
        """:meth:`call`; with ``poll`` (a watch's deadline) a long poll that times out returns ``None``."""
        what = f"{method} {urllib.parse.unquote(path)}"
        last: BackendUnavailableError | None = None
        refused = True  # every failure so far reached no server
        while True:
            for index in self.endpoints.order():
                self._check_open()
                if not resend and tries is not None and tries.maybe_applied:
                    raise BackendTimeoutError(f"etcd {what}: an attempt may have been applied and no answer came; "
                                         "not sent again") from last
                per_try = deadline.attempt() if poll is None else max(poll.remaining(), _MIN_POLL)
                if per_try <= 0:
                    break
                ep = self._eps[index]
                timeout = urllib3.Timeout(connect=min(per_try, self.settings.operation_timeout), read=per_try)
                try:
                    answer = self._request(ep, method, path, params, timeout)
                except _ClusterChanged as exc:  # another cluster answered (and applied?) it
                    last, refused = BackendConnectionError(f"etcd at {ep.base_uri}: {exc}"), False
                    self._attempt_failed(index, deadline, tries, last)
                    continue
                except (u3.HTTPError, http.client.HTTPException, OSError) as exc:
                    if self._is_closed():
                        raise BackendClosedError(f"EtcdV2Backend was closed during a {method}") from None
                    failure = _failure(exc)
                    if poll is not None and failure is Failure.TIMED_OUT:
                        self.endpoints.worked(index)
                        return None
                    last = transport_error(failure, f"etcd at {ep.base_uri}", what, _reason(exc))
                    if failure is Failure.TLS:
                        raise last from None
                    if failure is Failure.TIMED_OUT:
                        deadline.timed_out()
                    sent = failure is not Failure.NOT_SENT
                    refused = refused and not sent
                    self._attempt_failed(index, deadline, tries if sent else None, last)
                    continue
                if answer.code in (LEADER_ELECT, RAFT_INTERNAL):
                    # 301: no leader, nothing applied. 300: etcd's own request timeout ran out (a
                    # proposal lost with a dead leader, say); the write may still be applied.
                    last, refused = BackendTimeoutError(
                        f"etcd at {ep.base_uri}: {answer.body.get('message')} ({answer.body.get('cause')})"
                    ), False
                    self._attempt_failed(index, deadline, tries if answer.code == RAFT_INTERNAL else None, last)
                    continue
                self._check_answer(ep, answer)
                self.endpoints.worked(index)
                return answer
            if not deadline.backoff():
                raise give_up(self.settings, what, last, refused=refused, tries=tries) from None

    def _attempt_failed(self, index: int, deadline: AttemptDeadline, tries: Tries | None, error: BaseException) -> None:
        """Book a failed attempt on endpoint ``index`` (``tries``: the attempt may have been applied)."""
        self.endpoints.failed(index)
        deadline.failed()
        if tries is not None:
            tries.maybe_applied = True
        log.debug("%s", error)  # one line per failed attempt; the caller sees the error

    def _request(self, ep: _Endpoint, method: str, path: str, params: dict[str, str], timeout: Any) -> Answer:
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
        if etcd_index > self.seen:
            self.seen = etcd_index  # unlocked: a lost update only makes Tries.seen more cautious
        if response.status in (200, 201):
            try:
                return Answer(True, json.loads(data.decode("utf-8")), etcd_index)
            except (UnicodeDecodeError, ValueError):
                raise BackendConnectionError(f"etcd at {ep.base_uri} sent a non-JSON answer") from None
        try:
            payload = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            payload = None
        if not isinstance(payload, dict):
            payload = {"message": "Bad response", "cause": data[:200].decode("utf-8", "replace")}
        payload["status"] = response.status
        if payload.get("errorCode") == RAFT_INTERNAL and "Not a file" in str(payload.get("cause")):
            payload["errorCode"] = NOT_FILE  # a refresh of a directory: refused, nothing applied
        return Answer(False, payload, int(payload.get("index") or etcd_index))

    def _check_answer(self, ep: _Endpoint, answer: Answer) -> None:
        """Raise for error answers that no operation handles itself."""
        if answer.ok:
            return
        payload = answer.body
        if answer.code is None and (payload.get("status") == 404 or "404 page not found" in str(payload.get("cause"))):
            raise self._no_v2(ep)  # Go's "404 page not found" (or another server's 404), not a v2 answer
        if answer.code == UNAUTHORIZED or payload.get("status") == 401:
            hint = "" if self.settings.username else "; add USER:PASSWORD@ before the host in the URL"
            raise InvalidURLError(
                "username", self.settings.username,
                f"etcd at {ep.base_uri} refused access: {payload.get('message')}{hint}",
            )

    def _no_v2(self, ep: _Endpoint) -> InvalidURLError:
        """The error for a 404 at ``/v2/keys``: an etcd without the v2 API, or no etcd (``GET /version`` tells)."""
        host = f"[{ep.host}]" if ":" in ep.host else ep.host
        version, what = self._etcd_version(ep)
        if version is None:
            return not_etcd(ep.host, ep.port, ep.base_uri, what)
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
                                     timeout=urllib3.Timeout(connect=seconds, read=seconds))
            data = response.data or b""
        except (u3.HTTPError, http.client.HTTPException, OSError) as exc:
            return None, f"nothing ({_reason(exc)})"
        version = etcd_version(response.status, data)
        if version is not None:
            return version, "etcd's version"
        return None, answered(response.status, data)

    def probe(self, deadline: AttemptDeadline) -> None:
        """Check at open that some endpoint serves the v2 API."""
        answer = self.call("GET", "/", {}, deadline)
        if not answer.ok and answer.code != KEY_NOT_FOUND:
            raise BackendConnectionError(f"etcd v2 probe failed: {answer.body.get('message')}")

    def close(self) -> None:
        """Close the idle connections of every endpoint's pools."""
        for ep in self._eps:
            ep.client.http.clear()
