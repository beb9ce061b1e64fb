"""What the etcd v2 and v3 backends share: URL settings, TTL rounding, deadlines, endpoints, ``add``.

Nothing here imports an etcd client library, so the plugin modules that import
this one stay importable without ``python-etcd`` or ``python3-etcd3``.

URL form (both backends)::

    etcd[-v2|-v3]://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/RUN_ID?protocol=https&cacert=...

Query keys: ``protocol`` (``http``/``https``; default ``http``), ``cacert``
(CA bundle that signs the server certificate), ``cert`` and ``key`` (client
certificate and its private key; the seed's names), ``operation_timeout``
(seconds, default :data:`DEFAULT_OPERATION_TIMEOUT`; a dead or silent server
raises :class:`~rdzv_core.errors.BackendUnavailable` within about that time).

TLS files are checked when the URL is parsed (:func:`tls_context`: readable,
PEM, a private key that matches the certificate), and at open one TLS
handshake with Python's ``ssl`` (:func:`check_tls`) names a ``cacert`` that
does not sign the server's certificate, or a ``cert`` the server refuses, as
:class:`~rdzv_core.errors.InvalidURLError` at once (gRPC would retry such a
handshake until ``operation_timeout``).

Attempts: one operation's deadline is shared by several attempts of its
request (:meth:`Deadline.attempt`), because an etcd member can hold a request
for its own request timeout (5 s plus two election timeouts) -- a write sent to
a follower just after the leader died is forwarded to the dead leader and lost
-- while a new leader serves within about a second. Every request may be sent
again after such an attempt; for the writes that repeating could apply twice
(compare-guarded ones), :class:`Tries` tells the operation that an earlier
attempt may have been applied, so it can read a conflict answer correctly.
"""

from __future__ import annotations

import copy
import math
import os
import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, TypeVar, cast

from rdzv_core.errors import BackendTimeout, InvalidURLError, KVError
from rdzv_core.url import Converter, RendezvousURL, to_str

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_OPERATION_TIMEOUT",
    "MAX_VALUE_BYTES",
    "QUERY_KEYS",
    "EtcdSettings",
    "Endpoints",
    "Deadline",
    "FailureBudget",
    "MIN_ATTEMPT",
    "RaceRetry",
    "Tries",
    "AddCombiner",
    "ReadCoalescer",
    "may_have_applied",
    "check_tls",
    "tls_context",
    "ttl_seconds",
    "unreachable",
]

#: etcd's client port, for hosts given without one.
DEFAULT_PORT = 2379
#: Seconds an operation may take before it fails with ``BackendUnavailable``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Largest value either etcd backend accepts (bytes). Fits etcd's default
#: ``--max-request-bytes`` (1.5 MiB) even base64-encoded in a v2 form body.
#: A v3 server started with a lower ``--max-request-bytes`` refuses larger
#: writes: ``ValueTooLarge`` from the server's answer (the v2 API ignores it).
MAX_VALUE_BYTES = 1024 * 1024

#: Shortest time one attempt of a request gets (seconds); see :meth:`Deadline.attempt`.
MIN_ATTEMPT = 0.5

T = TypeVar("T")

_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 1.0


def _protocol(field_name: str, raw: str) -> str:
    value = raw.lower()
    if value not in ("http", "https"):
        raise InvalidURLError(field_name, raw, "must be 'http' or 'https'")
    return value


def _path(field_name: str, raw: str) -> str:
    return to_str(field_name, raw)


#: Query keys of the etcd backends (``operation_timeout`` is common to every backend).
QUERY_KEYS: dict[str, Converter] = {"protocol": _protocol, "cacert": _path, "cert": _path, "key": _path}


@dataclass(frozen=True)
class EtcdSettings:
    """Connection settings taken from a rendezvous URL.

    Attributes:
        endpoints: ``((host, port), ...)``, at least one.
        scheme: the URL's scheme as given (``"etcd"``, ``"etcd-v2"``, ...), for messages.
        protocol: ``"http"`` or ``"https"``.
        ca_cert: path of the CA bundle, or ``None`` (system CAs for https).
        cert: path of the client certificate (PEM), or ``None``.
        key: path of the client certificate's private key (PEM), or ``None``.
        username: etcd user, or ``None``.
        password: its password (never shown by ``repr``), or ``None``.
        operation_timeout: seconds per operation (float > 0).
    """

    endpoints: tuple[tuple[str, int], ...]
    scheme: str = "etcd"
    protocol: str = "http"
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    operation_timeout: float = DEFAULT_OPERATION_TIMEOUT

    @classmethod
    def from_url(cls, url: RendezvousURL) -> "EtcdSettings":
        """Validate ``url`` for an etcd backend.

        Raises:
            InvalidURLError: no host; ``cacert``/``cert``/``key`` without
                ``protocol=https``; ``key`` without ``cert``; a TLS file that
                does not exist, cannot be read or is not PEM; a ``cert`` without
                a private key (in it or in ``key``), or a ``key`` that does not
                match it (see :func:`tls_context`); a password without a user.
        """
        if not url.hosts:
            raise InvalidURLError("host", url.redacted(), f"{url.scheme}:// needs at least one HOST[:PORT]")
        endpoints = tuple((host, port if port is not None else DEFAULT_PORT) for host, port in url.hosts)
        params = url.params
        protocol = params.get("protocol", "http")
        for name in ("cacert", "cert", "key"):
            path = params.get(name)
            if path is None:
                continue
            if protocol != "https":
                raise InvalidURLError(name, path, "only used with TLS: add protocol=https to the URL")
            if not os.path.isfile(path):
                raise InvalidURLError(name, path, "no such file")
        if "key" in params and "cert" not in params:
            raise InvalidURLError("key", params["key"], "a client key needs its certificate: add cert=PATH")
        if url.password is not None and not url.username:
            raise InvalidURLError("username", "", "a password was given without a user name (USER:PASSWORD@HOST)")
        if protocol == "https":
            tls_context(params.get("cacert"), params.get("cert"), params.get("key"))
        return cls(
            endpoints=endpoints,
            scheme=url.scheme,
            protocol=protocol,
            ca_cert=params.get("cacert"),
            cert=params.get("cert"),
            key=params.get("key"),
            username=url.username,
            password=url.password,
            operation_timeout=float(params.get("operation_timeout", DEFAULT_OPERATION_TIMEOUT)),
        )

    def describe(self) -> str:
        """``"http://h1:p1,h2:p2"`` for messages (no credentials)."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"{self.protocol}://{hosts}"


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


def check_tls(settings: EtcdSettings, deadline: Deadline) -> None:
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


def ttl_seconds(ttl: float) -> int:
    """etcd TTLs are whole seconds: round ``ttl`` (float seconds > 0) up, to at least 1.

    Rounding up means a key never expires earlier than asked; it may live up to
    one second longer (part of the backends' ``ttl_resolution``).
    """
    return max(1, math.ceil(ttl))


class Deadline:
    """An absolute ``time.monotonic()`` deadline, shared by the attempts of an operation.

    Args:
        seconds: time from now (float >= 0).
    """

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self._backoffs = 0
        self._attempt_cap = max(MIN_ATTEMPT, seconds / 3)

    def remaining(self) -> float:
        """Seconds left (0.0 once passed)."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def attempt(self) -> float:
        """Seconds the next attempt of a request may take (0.0 once the deadline passed).

        ``min(remaining, cap)``: the cap starts at ``max(MIN_ATTEMPT, seconds / 3)``
        and doubles with each attempt that ran out of time (:meth:`timed_out`), so
        a request held by one etcd member is sent again (to the next endpoint)
        well before the deadline, and a server that is merely slow still gets the
        time it needs.
        """
        return min(self.remaining(), self._attempt_cap)

    def timed_out(self) -> None:
        """Note that an attempt used up its :meth:`attempt` time: the next one gets twice as long."""
        self._attempt_cap *= 2

    def failed(self) -> None:
        """Note a transport failure (see :class:`FailureBudget`); a plain deadline ignores it."""

    def backoff(self) -> bool:
        """Sleep a jittered, exponentially growing delay (50 ms .. 1 s, "full jitter").

        Returns:
            ``False`` (without sleeping) if no time is left, else ``True``.
        """
        remaining = self.remaining()
        if remaining <= 0:
            return False
        cap = min(_BACKOFF_CAP, _BACKOFF_FIRST * (2**self._backoffs))
        self._backoffs += 1
        time.sleep(min(remaining, random.uniform(cap / 2, cap)))
        return True


class FailureBudget(Deadline):
    """How long a long poll (a watch) may retry transport failures.

    ``seconds`` counted from the first failure (so a server lost an hour into a
    watch still gets the full budget), never past ``cap`` (the watch's own
    deadline). Before any failure it is ``cap``.
    """

    def __init__(self, seconds: float, cap: Deadline) -> None:
        super().__init__(0.0)
        self.seconds = seconds
        self.cap = cap
        self.at = cap.at
        self._started = False

    def failed(self) -> None:
        if not self._started:
            self._started = True
            self.at = min(self.cap.at, time.monotonic() + self.seconds)


class Tries:
    """What the transport tells a compare-guarded write about the attempts of its request.

    Every request is sent again after an attempt that failed (until the
    operation's deadline). For a compare-guarded write (``create``, the
    compare-and-* writes, ``add``'s compare-and-swap) an attempt that timed out
    or lost its connection may still have been applied, and then a later
    attempt meets the write's own result as a conflict (``KeyExists``,
    ``CompareFailed``). The operation reads such a conflict with two facts:

    * ``seen``: the highest revision the backend had seen before the first
      attempt. Any write the request makes gets a higher revision, so state at
      revision ``<= seen`` predates it: the conflict is genuine.
    * ``maybe_applied``: set by the transport when an attempt failed after it
      may have reached etcd. Without it a conflict is always genuine, and a
      success after it proves no earlier attempt was applied (it would have
      changed what the write compares; for ``create``: unless the key it made
      was deleted, or expired, between the attempts).

    Attributes:
        seen: a revision (int).
        maybe_applied: bool, ``False`` until the transport sets it.
    """

    __slots__ = ("seen", "maybe_applied")

    def __init__(self, seen: int) -> None:
        self.seen = seen
        self.maybe_applied = False

    def predates(self, revision: int) -> bool:
        """Whether state at ``revision`` existed before this request's first attempt was sent."""
        return revision <= self.seen


def may_have_applied(what: str, key: str) -> BackendTimeout:
    """The error for a compare-guarded write whose outcome the backend cannot tell.

    An attempt may have been applied and a later attempt met a conflict that
    is not provably genuine (state written after the request was first sent,
    not recognisably this write's own).
    """
    return BackendTimeout(
        f"{what} was retried after an attempt that may have been applied, and the retry found {key!r} changed "
        "by a write after it was first sent: it may or may not have taken effect; re-read the key", key
    )


class Endpoints:
    """The endpoints of a multi-host URL, tried in turn (thread-safe).

    The endpoint that last worked is tried first; a failing one moves the
    preference to the next, so every operation visits each endpoint at most
    once per round (see :meth:`order`).
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("at least one endpoint")
        self.count = count
        self._current = 0
        self._lock = threading.Lock()

    def order(self) -> list[int]:
        """Endpoint indexes for one round, the preferred one first."""
        with self._lock:
            start = self._current
        return [(start + i) % self.count for i in range(self.count)]

    def failed(self, index: int) -> None:
        """Prefer the endpoint after ``index`` (if ``index`` is still preferred)."""
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % self.count

    def worked(self, index: int) -> None:
        """Prefer ``index`` from now on."""
        with self._lock:
            self._current = index


def unreachable(settings: EtcdSettings, what: str, last: BaseException | None) -> str:
    """The message for "no endpoint could be reached": names every endpoint (never the password).

    Args:
        settings: the backend's settings (their :meth:`~EtcdSettings.describe` lists the endpoints).
        what: the operation, e.g. ``"get 'a/b'"``.
        last: the last transport error seen, or ``None``.
    """
    count = len(settings.endpoints)
    which = "the etcd endpoint" if count == 1 else f"any of the {count} etcd endpoints"
    detail = f" (last error: {last})" if last is not None else ""
    return (f"cannot reach {which} {settings.describe()} for {what} within "
            f"operation_timeout={settings.operation_timeout:g} s{detail}; is etcd running there?")


class RaceRetry:
    """When to retry an optimistic read-modify-write that lost a race (``add``'s loop).

    A lost compare-and-swap whose answer shows the key in a state other than the
    one the attempt assumed means another writer succeeded: the system made
    progress, so the loser retries *at once* with the state the answer carried
    (no sleep: a sleep only lets the key move further). An attempt that fails
    without progress -- the answer shows the very state the attempt assumed,
    which a compare on the key's revision should never give, so this is a
    safety net against spinning -- retries once at once and then backs off
    with :meth:`Deadline.backoff` (jittered, 50 ms doubling to 1 s). Nothing
    retries past the operation's deadline.

    Cost: N clients (not threads of one backend object, which
    :class:`AddCombiner` merges) arriving at one counter at the same instant
    make about N^2/2 attempts in all, each answered at once by etcd.

    Args:
        deadline: the operation's :class:`Deadline`.
    """

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.attempts = 0
        self._stalls = 0

    def again(self, progressed: bool) -> bool:
        """Note a lost attempt; return ``False`` (without sleeping) once the deadline has passed.

        Args:
            progressed: the key's state moved since the attempt's assumption.
        """
        self.attempts += 1
        if self.deadline.expired():
            return False
        if progressed:
            self._stalls = 0
            return True
        self._stalls += 1
        return True if self._stalls == 1 else self.deadline.backoff()


class _Waiter:
    """One ``add`` call queued in an :class:`AddCombiner`."""

    __slots__ = ("delta", "deadline", "done", "lead", "result", "error")

    def __init__(self, delta: int, deadline: Deadline) -> None:
        self.delta = delta
        self.deadline = deadline
        self.done = threading.Event()
        self.lead = False
        self.result: int | None = None
        self.error: BaseException | None = None


class AddCombiner:
    """Combines concurrent ``add`` calls of one backend object on one key into one write.

    etcd has no atomic increment: ``add`` is a compare-and-swap loop, and N
    threads adding to one hot counter (the rendezvous' join and confirm
    tickets, with many agents in one process sharing a backend) would make
    about N^2/2 attempts. Instead, the first caller for a key becomes its
    *leader*: it applies its own delta plus the deltas of every call queued
    for that key meanwhile as ONE compare-and-swap of their sum, then hands
    each queued caller its result (the value before the write plus the running
    sum of deltas in queue order) and passes leadership to the next queued
    call ("flat combining", Hendler, Incze, Shavit and Tzafrir, SPAA 2010).

    The combined calls are linearizable: all of them are in progress when the
    one write takes effect, and they take effect at that instant in queue
    order (each gets a distinct result; no intermediate value is observable).
    Watchers see one ``PUT`` for the batch. A failed write fails every call of
    its batch with the same error (so none of them took effect, or -- for a
    timeout that etcd may still apply -- all of them may have).

    Deadlines: a batch runs under the deadline of its leader, the batch's
    oldest call, so no call waits past its own deadline for its batch; a call
    still queued when its deadline passes leaves the queue and raises
    :class:`~rdzv_core.errors.BackendTimeout` having written nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, list[_Waiter]] = {}  # key -> calls waiting; present while a leader runs

    def add(self, key: str, delta: int, deadline: Deadline, apply: Callable[[int, Deadline], int]) -> int:
        """Add ``delta`` to ``key`` through ``apply``, combined with concurrent calls.

        Args:
            apply: ``apply(total_delta, deadline)`` adds ``total_delta`` in one
                atomic write and returns the key's new value (int).
            deadline: this call's operation deadline.

        Returns:
            The key's value right after this call's delta was applied.

        Raises:
            whatever ``apply`` raised for this call's batch;
            BackendTimeout: the call's deadline passed while it was queued.
        """
        me = _Waiter(delta, deadline)
        with self._lock:
            queue = self._queues.get(key)
            if queue is None:
                self._queues[key] = []
                me.lead = True
            else:
                queue.append(me)
        if not me.lead:
            self._wait(key, me)
            if not me.lead:
                if me.error is not None:
                    raise _copy_error(me.error)
                return cast(int, me.result)  # set before ``done``
        return self._lead(key, me, apply)

    def _wait(self, key: str, me: _Waiter) -> None:
        """Wait until ``me`` is done or promoted to leader (bounded by its deadline)."""
        if me.done.wait(me.deadline.remaining() + 0.5):
            return
        with self._lock:
            queue = self._queues.get(key)
            if queue is not None and me in queue:  # never taken into a batch: nothing was written
                queue.remove(me)
                raise BackendTimeout(f"add({key!r}) waited past its deadline behind other adds of this process", key)
        # In a batch whose leader started before us (so its deadline is earlier): it ends soon.
        if not me.done.wait(me.deadline.remaining() + 30.0):
            raise BackendTimeout(f"add({key!r}) did not complete in time; it may or may not have taken effect", key)

    def _lead(self, key: str, me: _Waiter, apply: Callable[[int, Deadline], int]) -> int:
        with self._lock:
            batch = [me] + self._queues[key]
            self._queues[key] = []
        total = sum(w.delta for w in batch)
        try:
            value = apply(total, me.deadline)
        except BaseException as exc:
            shared: BaseException = exc if isinstance(exc, Exception) else KVError(
                f"add({key!r}) was interrupted in another thread; it may or may not have taken effect", key
            )
            for w in batch[1:]:
                w.error = shared
            raise
        else:
            running = value - total
            for w in batch:
                running += w.delta
                w.result = running
            return value - total + me.delta
        finally:
            with self._lock:
                queue = self._queues[key]
                if queue:
                    nxt = queue.pop(0)
                    nxt.lead = True
                    nxt.done.set()
                else:
                    del self._queues[key]
            for w in batch[1:]:
                w.done.set()



class _Read:
    """One request of a :class:`ReadCoalescer` and the calls it answers."""

    __slots__ = ("go", "done", "answer", "error", "calls")

    def __init__(self) -> None:
        self.calls = 1  # calls this request answers
        self.go = threading.Event()  # the request before it ended: send this one
        self.done = threading.Event()
        self.answer: object = None
        self.error: BaseException | None = None


class ReadCoalescer:
    """Concurrent identical reads through one backend object share requests, each as fresh as its own.

    Hundreds of agent threads of one process read the same keys at once (the
    rendezvous state after each change, the bootstrap record). The first call
    for a key sends its request at once. A call that finds a request for the
    key in flight joins the key's *next* request, which the first call to join
    it sends as soon as the one in flight ends, and whose answer serves every
    call that joined before it was sent. Every call's answer thus comes from a
    request sent after the call began -- it reflects every write that completed
    before the call, as the call's own request would (a linearizable read stays
    linearizable) -- and at most two requests per key are outstanding.

    Deadlines: a request runs under the deadline of the call that sends it, the
    oldest of its group, so no call waits past its own deadline (plus the time
    the request in flight overruns its own); errors are shared by the group.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, list[_Read | None]] = {}  # key -> [request in flight, next request]

    def waiting(self, key: Hashable) -> int:
        """How many calls wait for the next request of ``key`` (not yet sent); for tests and diagnostics."""
        with self._lock:
            slot = self._flights.get(key)
            nxt = None if slot is None else slot[1]
            return 0 if nxt is None else nxt.calls

    def read(self, key: Hashable, deadline: Deadline, fetch: Callable[[], T]) -> T:
        """``fetch()`` (one request, under ``deadline``), or the answer of one sent after this call began.

        Raises:
            whatever ``fetch`` raised for this call's group (a copy per call);
            BackendTimeout: the request before this call's group did not end in time.
        """
        with self._lock:
            slot = self._flights.get(key)
            if slot is None:
                me, lead = _Read(), True
                me.go.set()
                self._flights[key] = [me, None]
            elif slot[1] is None:
                me, lead = _Read(), True
                slot[1] = me
            else:
                me, lead = slot[1], False
                me.calls += 1
        if not lead:
            if not me.done.wait(deadline.remaining() + 30.0):
                raise BackendTimeout(f"a read of {key!r} shared with other threads did not end in time")
            if me.error is not None:
                raise _copy_error(me.error)
            return cast(T, me.answer)
        if not me.go.wait(deadline.remaining() + 30.0):
            with self._lock:
                if slot is not None and slot[1] is me:  # never promoted: give the group up
                    slot[1] = None
                    me.error = BackendTimeout(f"a read of {key!r} in flight in another thread did not end in time")
                    me.done.set()
                    raise _copy_error(me.error)
        try:
            answer = fetch()
        except BaseException as exc:
            me.error = exc if isinstance(exc, Exception) else KVError(f"a read of {key!r} was interrupted")
            raise
        else:
            me.answer = answer
            return answer
        finally:
            with self._lock:
                current = self._flights[key]
                nxt = current[1]
                if nxt is not None:
                    current[0], current[1] = nxt, None
                    nxt.go.set()
                else:
                    del self._flights[key]
            me.done.set()


def _copy_error(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise in another thread (each thread gets its own traceback)."""
    try:
        return copy.copy(error).with_traceback(None)
    except Exception:  # an exception class that cannot be rebuilt from its args: share it
        return error
