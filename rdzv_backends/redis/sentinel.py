"""``SentinelBackend``: :class:`~rdzv_backends.redis.backend.RedisBackend` whose connections go to
the master that Redis Sentinel names.

Each new connection (the pool's and the watch listener's) asks the sentinels for the master's
address (redis-py's :meth:`redis.sentinel.Sentinel.discover_master`), connects there and checks
with ``ROLE`` that the server is a master; a connection whose server was demoted (``READONLY``
reply) is dropped, so the next call asks the sentinels again. Everything else -- scripts,
revisions, watches -- is :class:`RedisBackend`'s. Failover behaviour: docs/backends/redis.md, "Sentinel".
"""

from __future__ import annotations

import logging
from typing import Any, Sequence, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from rdzv_backends.redis._settings import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_SENTINEL_PORT,
    MASTER_NAME_KEY,
)
from rdzv_backends.redis._config import TLSFiles
from rdzv_backends.redis.backend import RedisBackend
from rdzv_core.errors import BackendConnectionError, InvalidURLError
from rdzv_core.url import RendezvousURL

__all__ = ["SentinelBackend", "open_sentinel_url"]

log = logging.getLogger(__name__)


class _MasterAddress:
    """What redis-py's :class:`SentinelManagedConnection` asks for its address: the master that the
    sentinels name now (the part of redis-py's ``SentinelConnectionPool`` it uses)."""

    is_master = True
    check_connection = False  # the ROLE check of _MasterConnection replaces redis-py's PING

    def __init__(self, sentinel: Sentinel, service_name: str) -> None:
        self.sentinel = sentinel
        self.service_name = service_name

    def get_master_address(self) -> tuple[str, int]:
        """``(host, port)`` of the master.

        Raises:
            redis.sentinel.MasterNotFoundError: no sentinel answered, or none names a master that
                is up (during a failover).
        """
        host, port = self.sentinel.discover_master(self.service_name)  # type: ignore[no-untyped-call, unused-ignore]
        return str(host), int(port)


class _MasterConnection(SentinelManagedConnection):
    """A connection to the sentinels' master: connects where they say, refuses a server that is not
    (or no longer) a master, and drops itself on a ``READONLY`` reply (redis-py's behaviour)."""

    def connect(self) -> None:
        self.connect_check_health()

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        """Connect to the master the sentinels name now (redis-py sends through this, not ``connect``).

        Raises:
            redis.ConnectionError: no master found (``MasterNotFoundError``), it refused, or it is no master.
        """
        if self._sock:
            return
        self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)

    def on_connect_check_health(self, check_health: bool = True) -> None:
        super().on_connect_check_health(check_health=check_health)
        self.send_command("ROLE", check_health=False)  # type: ignore[no-untyped-call, unused-ignore]
        role = self.read_response()
        if not role or role[0] not in (b"master", "master"):
            raise redis.ConnectionError(
                f"{self.host}:{self.port}, named master {self.connection_pool.service_name!r} by the sentinels, "
                f"is a {role[0] if role else 'server of no role'!r}: a failover is under way")


class SentinelBackend(RedisBackend):
    """The KV protocol on the master of a Redis Sentinel group (``redis+sentinel://``).

    Args:
        sentinels: the sentinels' ``(host, port)`` pairs (at least one; give every one of them).
        master_name: the name the sentinels monitor the master under.
        sentinel_username, sentinel_password: credentials of the sentinels (``requirepass`` /
            ACL of ``redis-sentinel``), or ``None``; the Redis servers' own are ``username`` and
            ``password``.
        db, username, password, namespace, operation_timeout, max_connections: as
            :class:`RedisBackend` (``operation_timeout`` also bounds each sentinel query).

    Raises:
        BackendConnectionError: no sentinel names a master that is up (``MasterNotFoundError``),
            or the master refused the connection (``open`` pings).
        BackendTimeoutError, InvalidURLError: as :class:`RedisBackend`.
    """

    def __init__(
        self,
        sentinels: Sequence[tuple[str, int]],
        master_name: str,
        *,
        sentinel_username: str | None = None,
        sentinel_password: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        namespace: str | None = None,
        operation_timeout: float = DEFAULT_OPERATION_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.sentinels = [(host, int(port)) for host, port in sentinels]
        self.master_name = master_name
        self._sentinel = Sentinel(self.sentinels, sentinel_kwargs={  # type: ignore[no-untyped-call, unused-ignore]
            "socket_timeout": operation_timeout,
            "socket_connect_timeout": operation_timeout,
            "username": sentinel_username,
            "password": sentinel_password,
            "retry": Retry(NoBackoff(), 0),
            "protocol": 2,
        })
        try:
            # host names the group (it keys the shared listener): the master's name and the sentinels.
            super().__init__(f"{master_name}@{self._listed()}", 0, db=db, username=username, password=password,
                             namespace=namespace, operation_timeout=operation_timeout, tls=None,
                             max_connections=max_connections)
        except BackendConnectionError:
            try:
                self._check_master_name()
            finally:
                self._sentinel.close()
            raise
        except BaseException:
            self._sentinel.close()
            raise

    def _check_master_name(self) -> None:
        """Raise :class:`InvalidURLError` on ``master_name`` if a sentinel answers and monitors no
        master of that name (a failed open is otherwise a failover or an outage)."""
        for client in self._sentinel.sentinels:
            try:
                masters = cast("dict[str, Any]", client.sentinel_masters())
            except redis.RedisError:
                continue
            if self.master_name not in masters:
                known = ", ".join(sorted(masters)) or "none"
                raise InvalidURLError(MASTER_NAME_KEY, self.master_name,
                                      f"the sentinel at {client.connection_pool.connection_kwargs['host']}:"
                                      f"{client.connection_pool.connection_kwargs['port']} monitors no master of "
                                      f"that name (it monitors: {known})") from None
            return

    def _connection_target(self, host: str, port: int,
                           tls: TLSFiles | None) -> tuple[type[Any], dict[str, Any], str]:
        """Connections of :class:`_MasterConnection`, addressed by the sentinels (see the module doc)."""
        return _MasterConnection, {"connection_pool": _MasterAddress(self._sentinel, self.master_name)}, \
            f"redis master {self.master_name!r} of sentinels {self._listed()}"

    def _listed(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.sentinels)

    def __repr__(self) -> str:
        user = f"{self.username}@" if self.username else ""
        return (f"SentinelBackend('redis+sentinel://{user}{self._listed()}', master_name={self.master_name!r}, "
                f"db={self.db}, prefix={self.prefix!r})")

    def _do_close(self) -> None:
        super()._do_close()
        self._sentinel.close()


def open_sentinel_url(url: RendezvousURL) -> SentinelBackend:
    """Open a :class:`SentinelBackend` for a parsed ``redis+sentinel://`` URL.

    Raises:
        InvalidURLError: ``master_name`` missing.
        BackendUnavailableError: see :class:`SentinelBackend`.
    """
    params = url.params
    master_name = params.get(MASTER_NAME_KEY)
    if not master_name:
        raise InvalidURLError(MASTER_NAME_KEY, master_name or "",
                              "redis+sentinel:// needs the name the sentinels monitor the master under: "
                              f"?{MASTER_NAME_KEY}=NAME (e.g. mymaster, as in 'sentinel monitor mymaster ...')")
    return SentinelBackend(
        [(host, port or DEFAULT_SENTINEL_PORT) for host, port in url.hosts],
        master_name,
        sentinel_username=params.get("sentinel_username"),
        sentinel_password=params.get("sentinel_password"),
        db=params.get("db", 0),
        username=url.username,
        password=url.password,
        namespace=params.get("namespace"),
        operation_timeout=params.get("operation_timeout", DEFAULT_OPERATION_TIMEOUT),
        max_connections=params.get("max_connections", DEFAULT_MAX_CONNECTIONS),
    )
