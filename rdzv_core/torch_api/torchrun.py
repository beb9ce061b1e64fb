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
rdzv-redis-sentinel   redis+sentinel         SENTINEL:PORT[,SENTINEL:PORT...]
                                             (``--rdzv-conf master_name=NAME``)
rdzv-file             file                   an absolute directory path
rdzv-memory           memory                 a keyspace name (one process only)
====================  =====================  =====================================

``--rdzv-conf`` keys map onto the URL query keys (``last_call_timeout=5``,
``keep_alive_ttl=2``, ``join_timeout`` = ``timeout``, ``cacert``, ...); torch's
own keys that do not apply (``is_host``, ``close_timeout``, ``read_timeout``,
``keep_alive_interval``, ``keep_alive_max_attempt``) are accepted and ignored.

Without ``--rdzv-id`` torch passes the run id ``none``, the same for every job:
two unrelated jobs on one server (or one ``rdzv-file`` directory) would form one
world, and a later job would find the run closed. So every handler but
``rdzv-memory`` (one process: no other job can share its keyspace) takes the run
id from the environment where a launcher or scheduler gives one, and logs which
(:func:`derived_run_id`), else refuses ``none`` with an
:class:`~rdzv_core.errors.InvalidURLError` on ``rdzv_id`` that says to pass
``--rdzv-id``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import InvalidURLError
from ..plugins import BackendSpec, get_registry, parse_backend_url
from ..url import RendezvousURL, parse_netloc, parse_path, redact_text, validate_run_id

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["rendezvous_url", "endpoint_url", "checked_run_id", "handler_url", "derived_run_id",
           "TORCH_DEFAULT_RUN_ID", "RUN_ID_SOURCES", "HANDLER_PREFIX",
           "handler_creator", "etcd", "etcd_v3", "redis", "redis_sentinel", "file", "memory"]

log = logging.getLogger(__name__)

#: The prefix of the handler names registered for torchrun (``rdzv-redis`` is the ``redis`` backend).
HANDLER_PREFIX = "rdzv-"

#: The run id torchrun passes when ``--rdzv-id`` is not given.
TORCH_DEFAULT_RUN_ID = "none"

#: Where a run id comes from without ``--rdzv-id``, first found wins: ``(run id prefix, variables)``.
#: Each names one job (and, for SLURM and LSF, one step / array element) and is the same on every
#: node of it. TORCHELASTIC_RUN_ID is taken as given (a launcher's explicit choice).
RUN_ID_SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("", ("TORCHELASTIC_RUN_ID",)),
    ("slurm-", ("SLURM_JOB_ID", "SLURM_STEP_ID")),
    ("pbs-", ("PBS_JOBID",)),
    ("lsf-", ("LSB_JOBID", "LSB_JOBINDEX")),
)

#: Set by torch's agent in its workers' environment: a torchrun started by a worker inherits the
#: parent job's ids, which would merge it into the parent's run.
_WORKER_MARKER = "TORCHELASTIC_RESTART_COUNT"

#: Values that say "no such thing": an LSF job outside an array has index 0; torch's own default id.
_SKIP = {"LSB_JOBINDEX": "0", "TORCHELASTIC_RUN_ID": TORCH_DEFAULT_RUN_ID}

_NOT_RUN_ID_CHARS = re.compile(r"[^A-Za-z0-9_.\-=+:@~]")
_SCHEME_NAME = re.compile(r"[a-z][a-z0-9+.\-]*")


def derived_run_id(scheme: str, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The run id to use when torchrun was given no ``--rdzv-id``: ``(run id, where it came from)``.

    Raises:
        InvalidURLError: on ``rdzv_id`` when the environment names no job (or this process is a
            torchelastic worker, whose job ids are its parent's), saying to pass ``--rdzv-id``; on the
            variable when its value is not a run id.
    """
    env = os.environ if environ is None else environ
    why = (f"torchrun was given no --rdzv-id, so every job gets the run id {TORCH_DEFAULT_RUN_ID!r}: unrelated jobs "
           f"on the same rdzv-{scheme} endpoint would join one run (one world), and a job after a finished one would "
           f"find the run closed. Pass --rdzv-id with a value unique to this job (the same on every node)")
    if env.get(_WORKER_MARKER) is not None:
        raise InvalidURLError("rdzv_id", TORCH_DEFAULT_RUN_ID, f"{why}; the job ids in this environment are "
                              f"inherited from the torchelastic job that started this process ({_WORKER_MARKER} "
                              f"is set), so none is derived from them")
    for prefix, names in RUN_ID_SOURCES:
        given = [n for n in names if env.get(n, "").strip() not in ("", _SKIP.get(n))]
        if not given or given[0] != names[0]:
            continue
        first = env[names[0]].strip()
        run_id = ".".join(env[n].strip() for n in given)
        if prefix:  # a scheduler's id ("123[4].server"): made a run id; an explicit one is taken as given
            run_id = prefix + _NOT_RUN_ID_CHARS.sub("_", run_id)
        source = "/".join(given)
        try:
            validate_run_id(run_id)
        except InvalidURLError as exc:
            raise InvalidURLError(names[0], first,
                                  f"cannot serve as the run id ({exc.reason}); pass --rdzv-id") from None
        return run_id, source
    sources = ", ".join(n for _, names in RUN_ID_SOURCES for n in names[:1])
    raise InvalidURLError("rdzv_id", TORCH_DEFAULT_RUN_ID, f"{why} (or run under a scheduler that sets one of "
                          f"{sources})")

#: torch's rendezvous config keys that have no meaning here.
IGNORED_TORCH_KEYS = frozenset({"is_host", "close_timeout", "read_timeout", "keep_alive_interval",
                                "keep_alive_max_attempt", "use_agent_store"})


def rendezvous_url(scheme: str, params: "RendezvousParameters") -> RendezvousURL:
    """The rdzv URL equivalent to torchrun's ``RendezvousParameters`` for ``scheme``, built (not parsed).

    ``--rdzv-endpoint`` is ``[USER[:PASSWORD]@]HOST:PORT[,...]`` (``rdzv-file``: an absolute
    directory, taken literally; ``rdzv-memory``: a keyspace name, default ``torchrun``);
    ``--rdzv-conf`` keys and the node counts are set as the URL's query keys
    (:meth:`RendezvousURL.with_params`). Run id ``none`` (no ``--rdzv-id``) becomes
    :func:`derived_run_id`'s, except for ``memory``.

    Raises:
        InvalidURLError: the endpoint is missing where the scheme needs one (``rdzv_endpoint``),
            or the run id is not one (``rdzv_id``: checked first), or is ``none`` and none can be
            derived; a bad host, directory or ``--rdzv-conf`` key or value.
        UnknownBackendError: ``scheme``'s backend is not installed.
    """
    run_id = params.run_id
    if run_id == TORCH_DEFAULT_RUN_ID and _spec(scheme).capabilities.multi_process:  # else no other job meets it
        run_id, source = derived_run_id(scheme)
        log.warning("rdzv-%s: torchrun was given no --rdzv-id: run id %r from %s (the same on every node of this "
                    "job; pass --rdzv-id to choose)", scheme, run_id, source)
    url = endpoint_url(scheme, params.endpoint or "", run_id)
    query: dict[str, Any] = {"min_nodes": params.min_nodes, "max_nodes": params.max_nodes}
    config = dict(params.config)
    if "join_timeout" in config:  # torchrun always adds a legacy "timeout" (900); join_timeout is explicit
        config.pop("timeout", None)
    for key, value in config.items():
        if key in IGNORED_TORCH_KEYS or value is None:
            continue
        query[key] = value
    return url.with_params(query)


def checked_run_id(run_id: str) -> str:
    """``run_id`` if it is a run id (:func:`~rdzv_core.url.validate_run_id`: one key segment); the rule of
    ``--rdzv-id`` for torchrun's handlers and ``rdzv-run`` alike.

    Raises:
        InvalidURLError: on ``rdzv_id``, with the reason.
    """
    try:
        return validate_run_id(run_id)
    except InvalidURLError as exc:
        raise InvalidURLError("rdzv_id", run_id, exc.reason) from None


def _spec(scheme: str) -> BackendSpec:
    """The installed backend of ``scheme`` (:class:`~rdzv_core.plugins.BackendSpec`).

    Raises:
        UnknownBackendError: none is installed.
    """
    return get_registry().lookup(scheme).spec


def endpoint_url(backend: str, endpoint: str, run_id: str, *, credentials: bool = True) -> RendezvousURL:
    """The URL of torchrun's ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``, built (never parsed from
    text, so none of them can add a query key or a path segment) and checked by the backend; no query keys.

    ``backend``: a scheme, or torchrun's handler name for it (``rdzv-redis``). ``endpoint``:
    ``[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...]`` (a trailing ``/`` is ignored) -- for a backend that
    reads a directory (:attr:`BackendSpec.uses_path <rdzv_core.plugins.BackendSpec.uses_path>`: ``file``)
    an absolute directory, taken literally; when empty, the backend's
    :attr:`~rdzv_core.plugins.BackendSpec.default_endpoint` (``memory``: ``torchrun``), if it has one.
    ``run_id``: :func:`checked_run_id`. The torchrun handlers (:func:`rendezvous_url`) and ``rdzv-run``
    (``rdzv_agent.launch.target``) both build their URL here.

    Args:
        credentials: whether ``USER:PASSWORD@`` may be given (``rdzv-run`` takes them only in a URL).

    Raises:
        InvalidURLError: on ``rdzv_backend`` (not a scheme name), ``rdzv_id`` (checked first after it),
            ``rdzv_endpoint`` (missing, control characters, a path where the scheme takes none, credentials where
            refused; the value shown without its password), or what the host list, directory or the
            backend refuses (``host``, ``port``, ``path``, ...).
        UnknownBackendError: no installed backend has that scheme.
    """
    if not _SCHEME_NAME.fullmatch(backend):
        raise InvalidURLError("rdzv_backend", backend, "not a backend name (lower-case letters, digits, '+', '.', '-')")
    scheme = backend.removeprefix(HANDLER_PREFIX)
    spec = _spec(scheme)
    checked_run_id(run_id)
    endpoint = endpoint.strip()
    shown = redact_text(endpoint)
    if any(ord(c) < 32 or ord(c) == 127 for c in endpoint):
        raise InvalidURLError("rdzv_endpoint", shown, "contains control characters")
    hosts: tuple[tuple[str, int | None], ...] = ()
    username = password = None
    path = ""
    if spec.uses_path:
        if not endpoint.startswith("/"):
            raise InvalidURLError("rdzv_endpoint", shown, f"rdzv-{scheme} needs an absolute directory path")
        path = parse_path(endpoint)
    else:
        endpoint = endpoint or spec.default_endpoint or ""
        if not endpoint:
            raise InvalidURLError("rdzv_endpoint", shown, f"rdzv-{scheme} needs HOST:PORT")
        netloc, _, rest = endpoint.partition("/")
        if rest.strip("/"):  # a trailing "/" is harmless; a path is not what this endpoint names
            raise InvalidURLError("rdzv_endpoint", shown, f"rdzv-{scheme} takes HOST:PORT[,HOST:PORT...], no path")
        if not credentials and "@" in netloc:
            raise InvalidURLError("rdzv_endpoint", shown, "takes no credentials: give them in a URL")
        hosts, username, password = parse_netloc(netloc)
    return parse_backend_url(RendezvousURL(scheme, hosts, path, run_id, {}, username, password))[1]


def handler_url(scheme: str, params: "RendezvousParameters") -> str:
    """:func:`rendezvous_url` as text, the password shown as ``***`` (for messages)."""
    return rendezvous_url(scheme, params).redacted()


def handler_creator(scheme: str) -> Callable[[], Callable[["RendezvousParameters"], "RendezvousHandler"]]:
    """The object a ``torchrun.handlers`` entry point names for ``scheme``'s backend: a zero-argument callable
    returning torch's creator ``(RendezvousParameters) -> RendezvousHandler`` (an :class:`RdzvHandler` on
    :func:`rendezvous_url`'s URL). The built-ins' are below (``rdzv-redis = "rdzv_core.torch_api.torchrun:redis"``); a
    plugin registers its own the same way (``rdzv-postgresql = "rdzv_postgres:torchrun_handler"``).
    """

    def get_creator() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
        def create(params: "RendezvousParameters") -> "RendezvousHandler":
            from .handler import RdzvHandler

            return RdzvHandler.from_url(
                rendezvous_url(scheme, params), local_addr=params.local_addr, backend_name=params.backend
            )

        return create

    get_creator.__name__ = f"rdzv_{scheme.replace('-', '_')}"
    return get_creator


etcd = handler_creator("etcd")
etcd_v3 = handler_creator("etcd-v3")
redis = handler_creator("redis")
redis_sentinel = handler_creator("redis+sentinel")
file = handler_creator("file")
memory = handler_creator("memory")
