"""The Redis backends' defaults and what they can do: read by the package's registration and by
:mod:`rdzv_backends.redis.backend` and :mod:`rdzv_backends.redis.sentinel`."""

from __future__ import annotations

from rdzv_core.kv import Capabilities

__all__ = [
    "CAPABILITIES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_OPERATION_TIMEOUT",
    "DEFAULT_PORT",
    "DEFAULT_SENTINEL_PORT",
    "MASTER_NAME_KEY",
    "MAX_VALUE_BYTES",
]

DEFAULT_PORT = 6379
#: Port of a sentinel that a ``redis+sentinel://`` host gives none for.
DEFAULT_SENTINEL_PORT = 26379
#: The ``redis+sentinel://`` query key naming the master the sentinels monitor (as kombu/celery call it).
MASTER_NAME_KEY = "master_name"
#: Seconds a call may take when the URL sets no ``operation_timeout``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Pooled connections per backend object when the URL sets no ``max_connections`` (more
#: calls at once wait for a free one; docs/backends/redis.md, "The connection pool").
DEFAULT_MAX_CONNECTIONS = 1024
#: Largest value accepted (bytes). The value is held twice (data + log), so 64 MiB, not Redis' 512 MiB.
MAX_VALUE_BYTES = 64 * 1024 * 1024

CAPABILITIES = Capabilities(
    multi_host=True,
    server_side_ttl=True,
    native_watch=True,
    persistent=True,
    tls=True,
    auth=True,
    max_value_bytes=MAX_VALUE_BYTES,
    # A watcher sleeps until the next deadline (server clock) and records the expiry
    # itself: measured lateness is a few ms on loopback; 0.1 s covers a loaded host.
    ttl_resolution=0.1,
)
