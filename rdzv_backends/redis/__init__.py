"""``redis://`` and ``rediss://`` — the KV protocol on one Redis server, with redis-py (docs/backends/redis.md).

This package holds the registration only; :mod:`rdzv_backends.redis.backend` (and redis-py) is
imported when a URL is opened, or a name of it is asked for (``from rdzv_backends.redis import
RedisBackend``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rdzv_backends._lazy import lazy_attributes
from rdzv_backends.redis._settings import (
    CAPABILITIES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_PORT,
    DEFAULT_SENTINEL_PORT,
    MASTER_NAME_KEY,
    MAX_VALUE_BYTES,
)
from rdzv_core.errors import InvalidURLError, UnknownBackendError
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL, to_bool, to_int, to_str

if TYPE_CHECKING:
    from rdzv_backends.redis._config import TLSFiles, namespace_prefix
    from rdzv_backends.redis._lua import HISTORY_LIMIT
    from rdzv_backends.redis.backend import RedisBackend
    from rdzv_backends.redis.sentinel import SentinelBackend

__all__ = [
    "RedisBackend",
    "SentinelBackend",
    "TLSFiles",
    "CAPABILITIES",
    "HISTORY_LIMIT",
    "MAX_VALUE_BYTES",
    "DEFAULT_PORT",
    "DEFAULT_SENTINEL_PORT",
    "MASTER_NAME_KEY",
    "DEFAULT_OPERATION_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "QUERY_KEYS",
    "namespace_prefix",
    "plugin",
    "sentinel_plugin",
]




def _open(url: RendezvousURL) -> RedisBackend:
    """Open a :class:`RedisBackend` for a parsed ``redis://`` / ``rediss://`` URL.

    Raises:
        InvalidURLError: more than one host; TLS options without ``rediss``; a TLS file problem.
        UnknownBackendError: redis-py is not installed.
        BackendUnavailableError: see :class:`RedisBackend`.
    """
    if len(url.hosts) != 1:
        raise InvalidURLError(
            "host", ",".join(f"{h}:{p}" for h, p in url.hosts),
            "Redis takes one host: one server endpoint (Sentinel and Cluster are not supported; for a replicated "
            "backend use etcd: README, 'High availability')",
        )
    from rdzv_backends.redis._config import tls_files

    tls = tls_files(url.scheme, url.params)  # the TLS files, checked before redis-py is imported
    with _needs_redis_py(url.scheme):
        from rdzv_backends.redis.backend import open_url
    return open_url(url, tls)


@contextlib.contextmanager
def _needs_redis_py(scheme: str) -> Iterator[None]:
    """Turn the ImportError of a missing redis-py into :class:`UnknownBackendError` on ``scheme``."""
    try:
        yield
    except ImportError as exc:
        if exc.name != "redis" and not (exc.name or "").startswith("redis."):
            raise
        raise UnknownBackendError(
            "scheme", scheme, "needs the redis-py client, which is not installed: pip install 'rdzv[redis]'"
        ) from None


def _open_sentinel(url: RendezvousURL) -> SentinelBackend:
    """Open a :class:`SentinelBackend` for a parsed ``redis+sentinel://`` URL (every sentinel a host).

    Raises:
        InvalidURLError: ``master_name`` missing.
        UnknownBackendError: redis-py is not installed.
        BackendUnavailableError: see :class:`SentinelBackend`.
    """
    with _needs_redis_py(url.scheme):
        from rdzv_backends.redis.sentinel import open_sentinel_url
    return open_sentinel_url(url)


QUERY_KEYS: dict[str, Callable[[str, str], Any]] = {
    "db": lambda f, v: to_int(f, v, 0),
    "max_connections": lambda f, v: to_int(f, v, 1),
    "namespace": to_str,
    "cacert": to_str,
    "cert": to_str,
    "key": to_str,
    "allow_eviction": to_bool,  # accept a server that evicts keys (rdzv_backends.redis._server), with a WARNING
}


#: Registers ``redis://`` and ``rediss://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    BackendSpec(
        schemes=("redis", "rediss"),
        open=_open,
        capabilities=CAPABILITIES,
        default_port=DEFAULT_PORT,
        query_keys=QUERY_KEYS,
        requires_host=True,
        description="agents on many hosts, one Redis server endpoint (Lua scripts, stream log, server-side TTLs; "
                    "rediss:// for TLS)",
        server_endpoints="one",
    )
)

#: Registers ``redis+sentinel://``: the master of a Redis Sentinel group, found through its sentinels.
sentinel_plugin = backend_plugin(
    BackendSpec(
        schemes=("redis+sentinel",),
        open=_open_sentinel,
        capabilities=dataclasses.replace(CAPABILITIES, tls=False),  # plain TCP to sentinels and servers
        default_port=DEFAULT_SENTINEL_PORT,
        query_keys={
            **{k: v for k, v in QUERY_KEYS.items() if k not in ("cacert", "cert", "key")},
            MASTER_NAME_KEY: to_str,
            "sentinel_username": to_str,
            "sentinel_password": to_str,
        },
        requires_host=True,
        description="agents on many hosts, the master of a Redis Sentinel group (every sentinel a host; "
                    "?master_name=NAME): RedisBackend that follows failovers",
        server_endpoints="many (sentinels)",
    )
)

__getattr__ = lazy_attributes(__name__, {
    "RedisBackend": "rdzv_backends.redis.backend",
    "SentinelBackend": "rdzv_backends.redis.sentinel",
    "TLSFiles": "rdzv_backends.redis._config",
    "namespace_prefix": "rdzv_backends.redis._config",
    "HISTORY_LIMIT": "rdzv_backends.redis._lua",
})
