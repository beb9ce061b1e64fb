"""``file://``'s settings and what it can do: read by the package's registration and by
:mod:`rdzv_backends.file.backend`."""

from __future__ import annotations

from rdzv_core.kv import Capabilities

__all__ = ["CAPABILITIES", "DB_NAME", "DEFAULT_OPERATION_TIMEOUT"]

#: File name of the store inside the URL's directory.
DB_NAME = "rdzv.sqlite3"
#: Seconds an operation may wait for the write lock when the URL sets no ``operation_timeout``.
DEFAULT_OPERATION_TIMEOUT = 30.0

CAPABILITIES = Capabilities(
    multi_host=False,
    server_side_ttl=False,
    native_watch=False,
    persistent=True,
    max_value_bytes=64 * 1024 * 1024,
    ttl_resolution=0.1,
)
