"""``file:///ABS/DIR/RUN_ID`` — an embedded, server-less backend for one host, on SQLite (docs/backends/file.md).

This package holds the registration only; :mod:`rdzv_backends.file.backend` (and ``sqlite3``) is
imported when a URL is opened, or a name of it is asked for (``from rdzv_backends.file import
FileBackend``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdzv_backends._lazy import lazy_attributes
from rdzv_backends.file._settings import CAPABILITIES, DB_NAME, DEFAULT_OPERATION_TIMEOUT
from rdzv_core.errors import InvalidURLError
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL, to_positive_float

if TYPE_CHECKING:
    from rdzv_backends.file._sql import HISTORY_LIMIT
    from rdzv_backends.file._watch import _FILES as _FILES, POLL_MAX as POLL_MAX, POLL_MIN as POLL_MIN
    from rdzv_backends.file._watch import POLLER_LINGER as POLLER_LINGER
    from rdzv_backends.file.backend import FileBackend

__all__ = ["CAPABILITIES", "DB_NAME", "DEFAULT_OPERATION_TIMEOUT", "FileBackend", "HISTORY_LIMIT", "plugin"]



def _open(url: RendezvousURL) -> FileBackend:
    if any(host not in ("", "localhost") for host, _ in url.hosts):
        raise InvalidURLError("host", url.redacted(), "file:// URLs name no host (file:///ABS/DIR/RUN_ID)")
    if not url.path:
        raise InvalidURLError("path", url.redacted(), "file:// needs a directory: file:///ABS/DIR/RUN_ID")
    from rdzv_backends.file.backend import FileBackend

    return FileBackend("/" + url.path, url.params.get("operation_timeout", DEFAULT_OPERATION_TIMEOUT))


#: Registers ``file://`` through the ``rdzv`` entry point, like any plugin.
plugin = backend_plugin(
    BackendSpec(
        schemes=("file",),
        open=_open,
        capabilities=CAPABILITIES,
        query_keys={"operation_timeout": to_positive_float},
        uses_path=True,
        description="SQLite file shared by the processes of one host (no server)",
        server_endpoints="none",
    )
)

__getattr__ = lazy_attributes(__name__, {
    "FileBackend": "rdzv_backends.file.backend",
    "POOL_IDLE": "rdzv_backends.file.backend",
    "HISTORY_LIMIT": "rdzv_backends.file._sql",
    "WATCH_BATCH": "rdzv_backends.file._sql",
    "POLL_MIN": "rdzv_backends.file._watch",
    "POLL_MAX": "rdzv_backends.file._watch",
    "POLLER_LINGER": "rdzv_backends.file._watch",
    "_FILES": "rdzv_backends.file._watch",
})
