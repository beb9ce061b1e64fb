"""rdzv_core: backend-neutral rendezvous for elastic PyTorch.

Public entry points:

* :func:`open_backend` — a :class:`~rdzv_core.kv.KVBackend` for a URL;
* :func:`create_handler` — a torch ``RendezvousHandler`` for a URL;
* :func:`list_backends` — scheme -> :class:`~rdzv_core.plugins.BackendInfo`.

Importing this package does not import torch; the Store and the handler import it
when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BackendClosed,
    BackendConnectionError,
    BackendTimeout,
    BackendUnavailable,
    CompareFailed,
    ConfigError,
    HistoryCompacted,
    InvalidKeyError,
    InvalidURLError,
    KeyExists,
    KeyNotFound,
    KVError,
    PluginError,
    RdzvError,
    RendezvousClosed,
    RendezvousGracefulExit,
    RendezvousStateError,
    RendezvousTimeout,
    UnknownBackendError,
    ValueTooLarge,
    CorruptEntry,
)
from .kv import Capabilities, Entry, Event, EventType, KVBackend, escape_segment, unescape_segment
from .plugins import BackendInfo, BackendSpec, get_registry, hookimpl
from .rendezvous import Progress, Rendezvous, RendezvousParams, RoundResult
from .url import RendezvousURL, parse_url

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = [
    "open_backend",
    "create_handler",
    "list_backends",
    "parse_backend_url",
    # protocol
    "KVBackend",
    "Entry",
    "Event",
    "EventType",
    "Capabilities",
    "escape_segment",
    "unescape_segment",
    # plugins
    "BackendSpec",
    "BackendInfo",
    "hookimpl",
    # rendezvous
    "Rendezvous",
    "RendezvousParams",
    "RoundResult",
    "Progress",
    "RendezvousClosed",
    "RendezvousGracefulExit",
    "RendezvousTimeout",
    "RendezvousURL",
    "parse_url",
    # errors
    "RdzvError",
    "KVError",
    "KeyExists",
    "KeyNotFound",
    "CompareFailed",
    "HistoryCompacted",
    "ValueTooLarge",
    "CorruptEntry",
    "BackendClosed",
    "BackendUnavailable",
    "BackendConnectionError",
    "BackendTimeout",
    "ConfigError",
    "InvalidKeyError",
    "InvalidURLError",
    "UnknownBackendError",
    "PluginError",
    "RendezvousStateError",
]


def parse_backend_url(url: str, *, require_run_id: bool = True) -> tuple[BackendInfo, RendezvousURL]:
    """Find the backend for ``url``'s scheme and parse the URL with that backend's rules.

    Raises:
        UnknownBackendError: no installed backend claims the scheme.
        InvalidURLError: the URL or one of its values is invalid.
    """
    scheme = url.partition("://")[0].lower() if isinstance(url, str) else ""
    if not scheme or "://" not in url:
        parse_url(url)  # raises the precise InvalidURLError
    info = get_registry().lookup(scheme)
    spec = info.spec
    parsed = parse_url(
        url,
        default_port=spec.default_port,
        extra_keys=spec.query_keys,
        require_host=spec.requires_host,
        require_run_id=require_run_id,
    )
    if parsed.path and not spec.uses_path:
        raise InvalidURLError(
            "path",
            parsed.path,
            f"{scheme}:// URLs take no path before the run id ({scheme}://HOST/RUN_ID); "
            "keys of different jobs are separated by the run id (and ?prefix= where the backend has it)",
        )
    if (parsed.username or parsed.password) and not spec.capabilities.auth:
        raise InvalidURLError(
            "user", parsed.username or "", f"{scheme}:// backends take no credentials (user:password@); remove them"
        )
    return info, parsed


def open_backend(url: str) -> KVBackend:
    """Open the KV backend named by ``url`` (the run id segment may be empty).

    Returns:
        A :class:`KVBackend`; close it (or use it as a context manager) when done.

    Raises:
        UnknownBackendError, InvalidURLError: see :func:`parse_backend_url`.
        BackendUnavailable: the server cannot be reached.
    """
    info, parsed = parse_backend_url(url, require_run_id=False)
    return info.spec.open(parsed)


def list_backends() -> dict[str, BackendInfo]:
    """Every registered scheme -> :class:`BackendInfo` (spec with capabilities, distribution)."""
    return get_registry().backends()


def create_handler(url: str, **overrides: Any) -> "RendezvousHandler":
    """Create a torch ``RendezvousHandler`` for ``url``.

    Args:
        url: ``SCHEME://HOSTS/[PATH/]RUN_ID?key=value...`` (see :mod:`rdzv_core.url`).
        **overrides: rendezvous parameters that take precedence over the query
            (``min_nodes``, ``max_nodes``, ``timeout``, ``last_call_timeout``,
            ``keep_alive_ttl``, ``prefix``, ``local_addr``).

    Raises:
        UnknownBackendError, InvalidURLError: bad URL or value.
    """
    from .handler import RdzvHandler

    return RdzvHandler.from_url(url, **overrides)
