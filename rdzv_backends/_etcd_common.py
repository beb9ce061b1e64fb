"""What the etcd v2 and v3 backends share: URL settings, TTL rounding, deadlines, endpoints.

Nothing here imports an etcd client library, so the plugin modules that import
this one stay importable without ``python-etcd`` or ``python3-etcd3``.

URL form (both backends)::

    etcd[-v2|-v3]://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/RUN_ID?protocol=https&cacert=...

Query keys: ``protocol`` (``http``/``https``; default ``http``), ``cacert``
(CA bundle that signs the server certificate), ``cert`` and ``key`` (client
certificate and its private key; the seed's names), ``operation_timeout``
(seconds, default :data:`DEFAULT_OPERATION_TIMEOUT`; a dead or silent server
raises :class:`~rdzv_core.errors.BackendUnavailable` within about that time).
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass, field

from rdzv_core.errors import InvalidURLError
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
    "ttl_seconds",
]

#: etcd's client port, for hosts given without one.
DEFAULT_PORT = 2379
#: Seconds an operation may take before it fails with ``BackendUnavailable``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Largest value either etcd backend accepts (bytes). Fits etcd's default
#: ``--max-request-bytes`` (1.5 MiB) even base64-encoded in a v2 form body.
MAX_VALUE_BYTES = 1024 * 1024

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
        protocol: ``"http"`` or ``"https"``.
        ca_cert: path of the CA bundle, or ``None`` (system CAs for https).
        cert: path of the client certificate (PEM), or ``None``.
        key: path of the client certificate's private key (PEM), or ``None``.
        username: etcd user, or ``None``.
        password: its password (never shown by ``repr``), or ``None``.
        operation_timeout: seconds per operation (float > 0).
    """

    endpoints: tuple[tuple[str, int], ...]
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
                ``protocol=https``; ``key`` without ``cert``; a certificate
                file that does not exist; a password without a user.
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
        return cls(
            endpoints=endpoints,
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


def ttl_seconds(ttl: float) -> int:
    """etcd TTLs are whole seconds: round ``ttl`` (float seconds > 0) up, to at least 1.

    Rounding up means a key never expires earlier than asked; it may live up to
    one second longer (part of the backends' ``ttl_resolution``).
    """
    return max(1, math.ceil(ttl))


class Deadline:
    """An absolute ``time.monotonic()`` deadline.

    Args:
        seconds: time from now (float >= 0).
    """

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self._attempt = 0

    def remaining(self) -> float:
        """Seconds left (0.0 once passed)."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

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
        cap = min(_BACKOFF_CAP, _BACKOFF_FIRST * (2**self._attempt))
        self._attempt += 1
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
