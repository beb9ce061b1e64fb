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
    BackendClosedError,
    BackendConnectionError,
    BackendTimeoutError,
    BackendUnavailableError,
    CompareFailedError,
    ConfigError,
    CorruptEntryError,
    HistoryCompactedError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidURLError,
    KeyExistsError,
    KeyNotFoundError,
    KVError,
    NodeExcludedError,
    PluginError,
    RdzvError,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    RunConfigMismatchError,
    UnknownBackendError,
    UnsuitableServerError,
    ValueTooLargeError,
)
from .kv import Capabilities, Entry, Event, EventType, KVBackend, escape_segment, unescape_segment
from .plugins import BackendInfo, BackendSpec, hookimpl, list_backends, open_backend, parse_backend_url
from .rendezvous import Progress, Rendezvous, RendezvousParams, RoundResult
from .rendezvous.record import RoundRecord, RunKeys, Status
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
    "RoundRecord",
    "RunKeys",
    "Status",
    "RendezvousURL",
    "parse_url",
    # errors
    "RdzvError",
    "KVError",
    "KeyExistsError",
    "KeyNotFoundError",
    "CompareFailedError",
    "HistoryCompactedError",
    "ValueTooLargeError",
    "CorruptEntryError",
    "BackendClosedError",
    "BackendUnavailableError",
    "BackendConnectionError",
    "BackendTimeoutError",
    "ConfigError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidURLError",
    "UnknownBackendError",
    "UnsuitableServerError",
    "RunConfigMismatchError",
    "PluginError",
    "NodeExcludedError",
    "RendezvousClosedError",
    "RendezvousGracefulExitError",
    "RendezvousTimeoutError",
    "RendezvousStateError",
]


def create_handler(url: str | RendezvousURL, **overrides: Any) -> "RendezvousHandler":
    """Create a torch ``RendezvousHandler`` for ``url``.

    Args:
        url: ``SCHEME://HOSTS/[PATH/]RUN_ID?key=value...`` (see :mod:`rdzv_core.url`), or
            that URL already parsed (:func:`parse_backend_url`; not parsed again).
        **overrides: rendezvous parameters that take precedence over the query
            (``min_nodes``, ``max_nodes``, ``timeout``, ``last_call_timeout``,
            ``keep_alive_ttl``, ``prefix``, ``local_addr``).

    Raises:
        UnknownBackendError, InvalidURLError: bad URL or value.
    """
    from .torch_api.handler import RdzvHandler

    return RdzvHandler.from_url(url, **overrides)
