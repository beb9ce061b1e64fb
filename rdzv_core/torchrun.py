"""Plain ``torchrun`` with rdzv's backends, through torch's ``torchrun.handlers`` entry points.

PyTorch (2.5+) loads out-of-tree rendezvous handlers from the entry-point group
``torchrun.handlers``: each entry point is a zero-argument callable returning a
creator ``(RendezvousParameters) -> RendezvousHandler``. torch's own names
(``etcd``, ``etcd-v2``, ``c10d``, ``static``) cannot be overridden, so this
project's are prefixed with ``rdzv-``::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend rdzv-redis \\
        --rdzv-endpoint 127.0.0.1:6379 --rdzv-id job1 train.py

====================  =====================  =====================================
``--rdzv-backend``    rdzv scheme            ``--rdzv-endpoint``
====================  =====================  =====================================
rdzv-etcd             etcd (v2 API)          HOST:PORT[,HOST:PORT...]
rdzv-etcd-v3          etcd-v3                HOST:PORT[,HOST:PORT...]
rdzv-redis            redis                  HOST:PORT
rdzv-file             file                   an absolute directory path
rdzv-memory           memory                 a keyspace name (one process only)
====================  =====================  =====================================

``--rdzv-conf`` keys map onto the URL query keys (``last_call_timeout=5``,
``keep_alive_ttl=2``, ``join_timeout`` = ``timeout``, ``cacert``, ...); torch's
own keys that do not apply (``is_host``, ``close_timeout``, ``read_timeout``,
``keep_alive_interval``, ``keep_alive_max_attempt``) are accepted and ignored.
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any, Callable

from .errors import InvalidURLError
from .url import validate_run_id

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["handler_url", "etcd", "etcd_v3", "redis", "file", "memory"]

#: torch's rendezvous config keys that have no meaning here.
IGNORED_TORCH_KEYS = frozenset({"is_host", "close_timeout", "read_timeout", "keep_alive_interval",
                                "keep_alive_max_attempt", "use_agent_store"})


def handler_url(scheme: str, params: "RendezvousParameters") -> str:
    """The rdzv URL equivalent to torchrun's ``RendezvousParameters`` for ``scheme``.

    Raises:
        InvalidURLError: the endpoint is missing where the scheme needs one (``rdzv_endpoint``),
            or the run id is not one (``rdzv_id``: checked first, so that ``../x`` is not
            read as a directory of the endpoint).
    """
    try:
        validate_run_id(params.run_id)
    except InvalidURLError as exc:
        raise InvalidURLError("rdzv_id", params.run_id, exc.reason) from None
    endpoint = (params.endpoint or "").strip()
    if scheme == "file":
        if not endpoint.startswith("/"):
            raise InvalidURLError("rdzv_endpoint", endpoint, "rdzv-file needs an absolute directory path")
        netloc_path = "/" + endpoint.strip("/")
    elif scheme == "memory":
        netloc_path = endpoint or "torchrun"
    else:
        if not endpoint:
            raise InvalidURLError("rdzv_endpoint", endpoint, f"rdzv-{scheme} needs HOST:PORT")
        netloc_path = endpoint
    query: dict[str, Any] = {"min_nodes": params.min_nodes, "max_nodes": params.max_nodes}
    config = dict(params.config)
    if "join_timeout" in config:  # torchrun always adds a legacy "timeout" (900); join_timeout is explicit
        config.pop("timeout", None)
    for key, value in config.items():
        if key in IGNORED_TORCH_KEYS or value is None:
            continue
        query[key] = value
    return f"{scheme}://{netloc_path}/{params.run_id}?{urllib.parse.urlencode(query)}"


def _creator(scheme: str) -> Callable[[], Callable[["RendezvousParameters"], "RendezvousHandler"]]:
    def get_creator() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
        def create(params: "RendezvousParameters") -> "RendezvousHandler":
            from .handler import RdzvHandler

            return RdzvHandler.from_url(
                handler_url(scheme, params), local_addr=params.local_addr, backend_name=params.backend
            )

        return create

    get_creator.__name__ = f"rdzv_{scheme.replace('-', '_')}"
    return get_creator


etcd = _creator("etcd")
etcd_v3 = _creator("etcd-v3")
redis = _creator("redis")
file = _creator("file")
memory = _creator("memory")
