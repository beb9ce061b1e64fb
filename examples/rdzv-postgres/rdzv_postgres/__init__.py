"""``postgresql://`` for rdzv — a backend added from outside the core, through the ``rdzv`` entry point.

URL::

    postgresql://[USER[:PASSWORD]@]HOST[:PORT]/RUN_ID?dbname=NAME&namespace=NS&...

(``postgres://`` is accepted too.) The run id is the URL's last path segment, as
for every rdzv backend, so the database is chosen with the ``dbname`` query key
(default ``postgres``); a URL with more path segments is an error. The port
defaults to 5432. Query keys, besides the rendezvous keys every backend takes
(``min_nodes``, ``operation_timeout``, ...):

=================  ====================================================================
``dbname``         database name (default ``postgres``)
``namespace``      table-name prefix, ``[a-z_][a-z0-9_]{0,39}`` (default ``rdzv``)
``history_limit``  events kept for watchers (int >= 100, default 10000)
``sslmode``        libpq's: ``disable``, ``allow``, ``prefer``, ``require``, ``verify-ca``, ``verify-full``
``sslrootcert``    CA certificate file (PEM) to verify the server with
``sslcert``        client certificate file (PEM), with ``sslkey``
``sslkey``         client key file (PEM)
=================  ====================================================================

User, password and anything the URL leaves out fall back to libpq's defaults
(``PGUSER``, ``PGPASSWORD``, ``~/.pgpass``, ...). The password never appears in
``repr``, logs or error messages.

Importing this module does not import psycopg: :func:`open_postgres` does, when
a ``postgresql://`` URL is first opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rdzv_core.errors import InvalidURLError, UnknownBackendError
from rdzv_core.kv import Capabilities
from rdzv_core.plugins import BackendSpec, hookimpl
from rdzv_core.torch_api.torchrun import handler_creator
from rdzv_core.url import RendezvousURL, to_int, to_str

if TYPE_CHECKING:
    from .backend import PostgresBackend

__all__ = ["plugin", "torchrun_handler", "open_postgres", "CAPABILITIES", "DEFAULT_PORT", "QUERY_KEYS"]

DEFAULT_PORT = 5432
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")

#: Defined here, not in .backend (which imports it from here), so that registering costs no psycopg import.
CAPABILITIES = Capabilities(
    multi_host=True,
    server_side_ttl=True,
    native_watch=True,
    persistent=True,
    tls=True,
    auth=True,
    max_value_bytes=64 * 1024 * 1024,
    ttl_resolution=0.1,
)


def _ssl_mode(field: str, raw: str) -> str:
    if raw not in SSL_MODES:
        raise InvalidURLError(field, raw, f"must be one of {', '.join(SSL_MODES)}")
    return raw


QUERY_KEYS = {
    "dbname": to_str,
    "namespace": to_str,  # its grammar is checked by PostgresBackend
    "history_limit": lambda f, v: to_int(f, v, 100),
    "sslmode": _ssl_mode,
    "sslrootcert": to_str,
    "sslcert": to_str,
    "sslkey": to_str,
}
_LIBPQ_KEYS = ("dbname", "sslmode", "sslrootcert", "sslcert", "sslkey")


def open_postgres(url: RendezvousURL) -> "PostgresBackend":
    """Open a :class:`~rdzv_postgres.backend.PostgresBackend` for a parsed ``postgresql://`` URL.

    Raises:
        InvalidURLError: not exactly one host; path segments before the run id; a bad query value.
        UnknownBackendError: psycopg is not installed.
        BackendUnavailableError: the server cannot be reached (see :class:`PostgresBackend`).
    """
    if len(url.hosts) != 1:
        raise InvalidURLError(
            "host", ",".join(f"{h}:{p}" for h, p in url.hosts) or "(none)", "postgresql:// takes exactly one host"
        )
    if url.path:
        raise InvalidURLError(
            "path", url.path, "name the database with ?dbname=NAME: the URL's last path segment is the run id"
        )
    try:
        from .backend import PostgresBackend
    except ImportError as exc:
        raise UnknownBackendError(
            "scheme", url.scheme, f"needs psycopg 3, which is not importable ({exc}): pip install 'psycopg[binary]'"
        ) from None
    host, port = url.hosts[0]
    conninfo: dict[str, Any] = {"host": host, "port": port or DEFAULT_PORT, "dbname": "postgres"}
    conninfo.update({k: url.params[k] for k in _LIBPQ_KEYS if k in url.params})
    if url.username is not None:
        conninfo["user"] = url.username
    if url.password is not None:
        conninfo["password"] = url.password
    options: dict[str, Any] = {k: url.params[k] for k in ("namespace", "history_limit", "operation_timeout")
                               if k in url.params}
    return PostgresBackend(conninfo, **options)


class plugin:  # noqa: N801 - entry-point object, named like a module attribute
    """Registers ``postgresql://`` (and ``postgres://``) through the ``rdzv`` entry point."""

    @staticmethod
    @hookimpl
    def rdzv_register_backends() -> list[BackendSpec]:
        return [
            BackendSpec(
                schemes=("postgresql", "postgres"),
                open=open_postgres,
                capabilities=CAPABILITIES,
                default_port=DEFAULT_PORT,
                query_keys=QUERY_KEYS,
                requires_host=True,
                description="one PostgreSQL server (row-lock transactions, LISTEN/NOTIFY, server-clock TTLs)",
                server_endpoints="one",
            )
        ]


#: Plain torchrun's ``--rdzv-backend rdzv-postgresql`` (the ``torchrun.handlers`` entry point in pyproject.toml).
torchrun_handler = handler_creator("postgresql")
