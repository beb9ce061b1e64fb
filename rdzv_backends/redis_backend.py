"""The old import path of the Redis backend's public names, now in :mod:`rdzv_backends.redis`
(served on first use, so importing this module imports no client)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdzv_backends._lazy import lazy_attributes
from rdzv_backends.redis import __all__ as __all__

if TYPE_CHECKING:
    from rdzv_backends.redis import (
        CAPABILITIES as CAPABILITIES,
        DEFAULT_MAX_CONNECTIONS as DEFAULT_MAX_CONNECTIONS,
        DEFAULT_OPERATION_TIMEOUT as DEFAULT_OPERATION_TIMEOUT,
        DEFAULT_PORT as DEFAULT_PORT,
        HISTORY_LIMIT as HISTORY_LIMIT,
        MAX_VALUE_BYTES as MAX_VALUE_BYTES,
        QUERY_KEYS as QUERY_KEYS,
        RedisBackend as RedisBackend,
        TLSFiles as TLSFiles,
        namespace_prefix as namespace_prefix,
        plugin as plugin,
    )

__getattr__ = lazy_attributes(__name__, dict.fromkeys(__all__, "rdzv_backends.redis"))
