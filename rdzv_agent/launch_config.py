""":func:`build_config` turns ``rdzv-run``'s parsed options (:mod:`rdzv_agent.launch_args`)
into a :class:`LaunchConfig`: the worker command and the launch *target*, one of

* a :class:`~rdzv_core.url.RendezvousURL`, parsed once with its backend's rules
  (:func:`rdzv_core.parse_backend_url`), ``--rdzv-conf`` set in its query
  (:meth:`~rdzv_core.url.RendezvousURL.with_params`: overriding the same keys there;
  ``--nnodes`` fills in ``min_nodes``/``max_nodes`` and must agree with them where the URL
  or ``--rdzv-conf`` gives them). ``--rdzv-backend``, ``--rdzv-endpoint`` and ``--rdzv-id``
  are checked and quoted before they become a URL, so none of them can add a query key
  or another path segment;
* a :class:`StaticRendezvous` (torchrun's ``static`` backend);
* :class:`Standalone`: a ``file://`` rendezvous in a directory the launcher creates.

What each torchrun option does here, and where it differs from torchrun, is the
parity table in ``docs/torchrun.md`` (static mode: ``--node-rank``/``--master-addr``/
``--master-port``; ``--start-method``; ``--run-path``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from rdzv_core.errors import ConfigError, InvalidURLError
from rdzv_core.plugins import parse_backend_url
from rdzv_core.torchrun import HANDLER_PREFIX
from rdzv_core.url import RendezvousURL, parse_netloc, parse_node_labels, redact_text, validate_run_id

from .api import DEFAULT_ROLE
from .launch_args import (
    DEFAULT_EXIT_BARRIER_TIMEOUT,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_SHUTDOWN_TIMEOUT,
    RUN_PATH_CODE,
    SHUTDOWN_TIMEOUT_ENV,
    STATIC_BACKEND,
    STATIC_DEFAULT_ADDR,
    STATIC_DEFAULT_PORT,
    STATIC_DEFAULT_RUN_ID,
    STATIC_DEFAULT_TIMEOUT,
    METRICS_PORT_ENV,
    URL_ENV,
    _non_negative_int,
    _port,
    _rdzv_conf,
)
from .hang import interval_from_env
from .logs import PREFIX_TEMPLATE_ENV, load_logs_specs
from .ops import OpsHooks, ops_from_env
from .streams import Std
from .worker_options import (
    DEFAULT_SIGNALS,
    HandledSignals,
    check_virtual_local_rank,
    numa_plan,
    parse_signals,
    python_exec,
)

__all__ = ["LaunchConfig", "LaunchTarget", "StaticRendezvous", "Standalone", "build_config", "backend_url"]

_SCHEME = re.compile(r"[a-z][a-z0-9+.\-]*")
_HOSTS = re.compile(r"[A-Za-z0-9_.\-:,\[\]%]+")  # % only as an IPv6 zone: [fe80::1%25eth0]


@dataclass(frozen=True)
class StaticRendezvous:
    """torchrun's static rendezvous: fixed node ranks, a TCP store on node rank 0's agent.

    Attributes:
        master_addr, master_port: the store's address (node rank 0 listens there);
            also the workers' ``MASTER_ADDR``/``MASTER_PORT``.
        node_rank: this node's rank, ``0 <= node_rank < nnodes``.
        nnodes: the fixed number of nodes.
        run_id: the run id (torchrun's default ``"none"``).
        timeout: seconds to wait for every node's agent to connect (int > 0).
    """

    master_addr: str
    master_port: int
    node_rank: int
    nnodes: int
    run_id: str = STATIC_DEFAULT_RUN_ID
    timeout: int = STATIC_DEFAULT_TIMEOUT

    def describe(self) -> str:
        """``static://ADDR:PORT/RUN_ID`` (for messages; not an openable URL)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"static://{host}:{self.master_port}/{self.run_id}"


@dataclass(frozen=True)
class Standalone:
    """``--standalone``: a ``file://`` rendezvous in a temporary directory the launcher creates (and removes).

    Attributes:
        url: the rendezvous URL without its directory (:meth:`in_directory` adds it).
    """

    url: RendezvousURL

    @property
    def run_id(self) -> str:
        return self.url.run_id

    def in_directory(self, directory: str) -> RendezvousURL:
        """The URL of the rendezvous in ``directory`` (absolute, as created by ``tempfile.mkdtemp``)."""
        return dataclasses.replace(self.url, path=directory.strip("/"))


#: What ``rdzv-run`` launches against.
LaunchTarget = Union[RendezvousURL, StaticRendezvous, Standalone]


@dataclass
class LaunchConfig:
    """Everything the launcher needs, validated.

    Attributes:
        target: the rendezvous: a :class:`~rdzv_core.url.RendezvousURL` (may hold a
            password: show it with ``redacted()`` only), a :class:`StaticRendezvous` or
            :class:`Standalone`.
        min_nodes, max_nodes: from ``--nnodes`` (``None`` when the URL decides).
        master_addr: ``MASTER_ADDR`` for the workers (``--master-addr``, one-node
            elastic jobs), else ``None`` (group rank 0 publishes its address).
        master_port: ``MASTER_PORT`` for the workers (``--master-port``), else
            ``None`` (group rank 0 picks a free port each round).
        start_method: ``--start-method`` as given (it changes nothing).
        nproc_per_node: workers on this node.
        signals_to_handle: the signals that stop the launcher (``--signals-to-handle``).
        virtual_local_rank: ``--virtual-local-rank`` (checked against ``CUDA_VISIBLE_DEVICES``).
        numa_binding, numa_cpus: ``--numa-binding``'s policy and, per local rank, the CPUs
            its worker is bound to (:func:`~rdzv_agent.worker_options.numa_plan`), else ``None``.
        program, program_args: the worker command ``[program, *program_args]``.
        (other attributes mirror the options)
    """

    target: LaunchTarget
    min_nodes: int | None
    max_nodes: int | None
    nproc_per_node: int
    program: str
    program_args: list[str]
    role: str = DEFAULT_ROLE
    max_restarts: int = 0
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL
    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_addr: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    start_method: str = "spawn"
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT
    # issue 16: log specs
    local_ranks_filter: set[int] | None = None
    duplicate_stdout_filters: list[str] = dataclasses.field(default_factory=list)
    duplicate_stderr_filters: list[str] = dataclasses.field(default_factory=list)
    logs_specs: str | None = None
    log_line_prefix_template: str | None = None
    # issue 16: flags and worker variables
    signals_to_handle: HandledSignals = field(default_factory=lambda: parse_signals(DEFAULT_SIGNALS))
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    numa_cpus: dict[int, frozenset[int]] | None = None
    # issue 16: operations hooks (health check, watchdog, stuck-process check), from their variables
    ops: OpsHooks = OpsHooks()
    # issue 16: events, metrics and error files
    #: ``--event-log-handler``: a name registered in torch's ``events.handlers``.
    event_log_handler: str = "null"
    #: ``--metrics-handler``: a torch ``MetricHandler`` for the ``torchelastic`` group, or ``None`` (left as is).
    metrics_handler: Any = None
    # issue 18: progress, hangs and metrics
    #: ``--hang-timeout``: seconds without progress before a worker is hung (``None``: off).
    hang_timeout: float | None = None
    #: ``--metrics-port`` (or ``RDZV_METRICS_PORT``): the Prometheus port, or ``None``.
    metrics_port: int | None = None
    #: ``RDZV_PROGRESS_INTERVAL``: seconds between two writes of the workers' progress to the backend.
    progress_interval: float = 5.0

    @property
    def url(self) -> RendezvousURL | None:
        """The target if it is a URL, else ``None``."""
        return self.target if isinstance(self.target, RendezvousURL) else None

    @property
    def static(self) -> StaticRendezvous | None:
        """The target if it is the static rendezvous, else ``None``."""
        return self.target if isinstance(self.target, StaticRendezvous) else None

    @property
    def standalone(self) -> bool:
        """The target is :class:`Standalone`."""
        return isinstance(self.target, Standalone)


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Validate the parsed arguments and build the :class:`LaunchConfig`.

    Raises:
        ConfigError: conflicting, missing or unsupported options, or a bad ``PET_*``
            variable (names the option, or the variable it came from, and the value).
    """
    for name, raw, reason in getattr(args, "env_errors", ()):
        raise ConfigError(name, raw, reason)
    try:
        return _build_config(args, os.environ if environ is None else environ)
    except ConfigError as exc:
        env_name = _env_source(args, exc.field)
        if env_name is None:
            raise
        raise ConfigError(env_name, exc.value, exc.reason) from None


def _env_source(args: argparse.Namespace, option: str) -> str | None:
    """The ``PET_*`` variable that gave ``option``'s value (``"--nnodes"`` -> ``"PET_NNODES"``), else ``None``."""
    dest = {"-m": "module", "-r": "redirects", "-t": "tee"}.get(option, option.lstrip("-").replace("-", "_"))
    from_env: dict[str, str] = getattr(args, "from_env", {})
    return from_env.get(dest) if option.startswith("-") else None


def _shown(args: argparse.Namespace, option: str) -> str:
    """``option``, or the ``PET_*`` variable its value came from (for messages)."""
    return _env_source(args, option) or option


def _build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchConfig:
    mode, url_arg = _mode(args, environ)
    static = _static(args) if mode == "static" else None
    if mode == "static" and static is None:
        mode = "standalone"
    target: LaunchTarget
    master_addr: str | None
    if static is not None:
        target, nnodes = static, (static.nnodes, static.nnodes)
        master_addr, master_port = static.master_addr, static.master_port
    else:
        url = _elastic_url(args, mode, url_arg)
        url = _rank_request(args, url)
        target = Standalone(url) if mode == "standalone" else url
        nnodes = (1, 1) if mode == "standalone" else args.nnodes
        master_addr, master_port = _check_elastic_master(args, url), args.master_port
    min_nodes, max_nodes = nnodes if nnodes is not None else (None, None)
    program, program_args = _worker_command(args, environ)
    load_logs_specs(args.logs_specs)  # a bad --logs-specs fails here, before the rendezvous
    _check_local_ranks(args)
    if args.virtual_local_rank:
        check_virtual_local_rank(environ, args.nproc_per_node)
    numa_cpus = numa_plan(args.numa_binding, args.nproc_per_node) if args.numa_binding is not None else None

    return LaunchConfig(
        target=target,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=args.nproc_per_node,
        program=program,
        program_args=program_args,
        role=args.role,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
        local_addr=args.local_addr,
        master_addr=master_addr,
        master_port=master_port,
        start_method=args.start_method,
        shutdown_timeout=_shutdown_timeout(args, environ),
        exit_barrier_timeout=args.exit_barrier_timeout,
        local_ranks_filter=args.local_ranks_filter,
        duplicate_stdout_filters=list(args.duplicate_stdout_filters),
        duplicate_stderr_filters=list(args.duplicate_stderr_filters),
        logs_specs=args.logs_specs,
        log_line_prefix_template=environ.get(PREFIX_TEMPLATE_ENV) or None,
        signals_to_handle=args.signals_to_handle,
        virtual_local_rank=args.virtual_local_rank,
        numa_binding=args.numa_binding,
        numa_cpus=numa_cpus,
        ops=ops_from_env(environ),
        event_log_handler=getattr(args, "event_log_handler", "null"),
        metrics_handler=getattr(args, "metrics_handler", None),
        hang_timeout=getattr(args, "hang_timeout", None),
        metrics_port=_metrics_port(getattr(args, "metrics_port", None), environ),
        progress_interval=interval_from_env(environ),
    )


def _metrics_port(given: int | None, environ: Mapping[str, str]) -> int | None:
    """``--metrics-port``, else ``RDZV_METRICS_PORT`` (empty: unset), else ``None``.

    Raises:
        ConfigError: the variable is not a TCP port (names it and the value).
    """
    raw = environ.get(METRICS_PORT_ENV, "").strip()
    if given is not None or not raw:
        return given
    try:
        return _port(raw)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(METRICS_PORT_ENV, raw, str(exc)) from None


def _check_local_ranks(args: argparse.Namespace) -> None:
    """``--local-ranks-filter``, ``--redirects`` and ``--tee`` name only local ranks this node has.

    torch accepts any rank there, so a typo silently hides every worker's output.

    Raises:
        ConfigError: naming the option (or its ``PET_*`` variable) and the value.
    """
    count = args.nproc_per_node
    for option, ranks in (("--local-ranks-filter", args.local_ranks_filter or ()),
                          ("--redirects", args.redirects if isinstance(args.redirects, dict) else ()),
                          ("--tee", args.tee if isinstance(args.tee, dict) else ())):
        beyond = sorted(r for r in ranks if r >= count)
        if beyond:
            raise ConfigError(_shown(args, option), ",".join(map(str, beyond)),
                              f"no such local rank: this node runs {count} worker(s), local ranks 0..{count - 1}")


def _mode(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """Which rendezvous the options ask for: ``(mode, url)``.

    ``mode`` is ``"standalone"``, ``"url"`` (``--rdzv`` or ``RDZV_URL``; ``url`` is
    set), ``"backend"`` (``--rdzv-backend`` with endpoint and id) or ``"static"`` (also when
    no rendezvous is named: torchrun's default).
    """
    parts = [args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id]
    modes = [name for name, used in (("--standalone", args.standalone), ("--rdzv", args.rdzv is not None),
                                     ("--rdzv-backend", any(x is not None for x in parts))) if used]
    if len(modes) > 1:
        backend_opts = [o for o, v in zip(("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"), parts, strict=True)
                        if v is not None]
        shown = [_shown(args, backend_opts[0] if m == "--rdzv-backend" else m) for m in modes]
        raise ConfigError("rendezvous", " and ".join(shown), "give only one of --rdzv, --rdzv-backend/"
                          "--rdzv-endpoint/--rdzv-id and --standalone")
    if modes == ["--standalone"]:
        return "standalone", None
    if modes == ["--rdzv"]:
        if not args.rdzv:
            raise ConfigError("--rdzv", args.rdzv, "empty URL")
        return "url", str(args.rdzv)
    if modes == ["--rdzv-backend"]:
        return ("static" if args.rdzv_backend == STATIC_BACKEND else "backend"), None
    if environ.get(URL_ENV):
        return "url", environ[URL_ENV]
    return "static", None  # torchrun's default backend (one node without a port: standalone)


def _host(option: str, text: str) -> str:
    """A host name or address (IPv6 brackets removed), or ConfigError naming ``option``."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not host or not re.fullmatch(r"[A-Za-z0-9_.\-:]+", host):
        raise ConfigError(option, text, "not a host name or address")
    return host


def _static(args: argparse.Namespace) -> StaticRendezvous | None:
    """The static rendezvous of the options; ``None`` for a one-node job without a port (runs standalone).

    Raises:
        ConfigError: naming the option and value.
    """
    lo, hi = args.nnodes if args.nnodes is not None else (1, 1)
    if lo != hi:
        raise ConfigError("--nnodes", f"{lo}:{hi}", "the static rendezvous needs a fixed number of nodes "
                          "(an elastic MIN:MAX needs --rdzv or --rdzv-backend with a backend)")
    node_rank = args.node_rank if args.node_rank is not None else 0
    if node_rank >= hi:
        raise ConfigError("--node-rank", node_rank, f"must be less than --nnodes ({hi})")
    if hi == 1 and args.master_port is None and args.rdzv_endpoint is None:
        return None  # torchrun: a one-node static job without a port runs as standalone
    if args.local_addr is not None:
        raise ConfigError("--local-addr", args.local_addr, "not used by the static rendezvous: node rank 0 "
                          "serves at --master-addr, which is also the workers' MASTER_ADDR")
    run_id = args.rdzv_id if args.rdzv_id is not None else STATIC_DEFAULT_RUN_ID
    try:
        validate_run_id(run_id)
    except InvalidURLError as exc:
        raise ConfigError("--rdzv-id", run_id, exc.reason) from None
    timeout = STATIC_DEFAULT_TIMEOUT
    for key, value in _rdzv_conf(args.rdzv_conf).items():
        if key not in ("timeout", "join_timeout"):
            raise ConfigError("--rdzv-conf", f"{key}={value}", "the static rendezvous understands only timeout=SECONDS")
        if not value.isdigit() or int(value) < 1:
            raise ConfigError("--rdzv-conf", f"{key}={value}", "expected a whole number of seconds >= 1")
        timeout = int(value)
    if args.rdzv_endpoint is not None:
        shown = redact_text(args.rdzv_endpoint)  # never echo a USER:PASSWORD@ given here
        if args.master_addr is not None or args.master_port is not None:
            raise ConfigError("--rdzv-endpoint", shown,
                              "give either --rdzv-endpoint HOST:PORT or --master-addr/--master-port")
        if any(c in args.rdzv_endpoint for c in "/?#"):
            raise ConfigError("--rdzv-endpoint", shown, "the static rendezvous needs one HOST:PORT")
        try:
            hosts, user, password = parse_netloc(args.rdzv_endpoint)
        except InvalidURLError as exc:
            raise ConfigError("--rdzv-endpoint", shown, f"{exc.field}: {exc.reason}") from None
        addr, port = hosts[0] if len(hosts) == 1 else ("", None)
        if port is None or user is not None or password is not None:
            raise ConfigError("--rdzv-endpoint", shown, "the static rendezvous needs one HOST:PORT")
        return StaticRendezvous(addr, port, node_rank, hi, run_id, timeout)
    addr = _host("--master-addr", args.master_addr) if args.master_addr is not None else STATIC_DEFAULT_ADDR
    port = args.master_port if args.master_port is not None else STATIC_DEFAULT_PORT
    return StaticRendezvous(addr, port, node_rank, hi, run_id, timeout)


def _elastic_url(args: argparse.Namespace, mode: str, url_arg: str | None) -> RendezvousURL:
    """The URL of an elastic rendezvous (``--standalone``'s without its directory), parsed once,
    with ``--rdzv-conf`` and ``--nnodes`` in its query.

    Raises:
        ConfigError: a bad option, URL or value (naming it).
    """
    if mode == "standalone":
        if args.nnodes is not None and args.nnodes != (1, 1):
            raise ConfigError("--nnodes", f"{args.nnodes[0]}:{args.nnodes[1]}", "--standalone runs one node")
        run_id = args.rdzv_id  # set only when a one-node static job runs standalone
        if run_id is None:
            run_id = "standalone-" + uuid.uuid4().hex[:12]
        try:
            validate_run_id(run_id)
        except InvalidURLError as exc:
            raise ConfigError("--rdzv-id", run_id, exc.reason) from None
        _, url = parse_backend_url(RendezvousURL("file", (), "", run_id))
        nnodes: tuple[int, int] | None = (1, 1)
    elif mode == "url":
        _, url = parse_backend_url(str(url_arg))
        nnodes = args.nnodes
    else:
        for name, value in zip(("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"),
                               (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id), strict=True):
            if not value:
                raise ConfigError(name, value, "--rdzv-backend, --rdzv-endpoint and --rdzv-id go together")
        url = _backend_url(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id)[1]
        nnodes = args.nnodes
    conf = _rdzv_conf(args.rdzv_conf)
    url = url.with_params(conf)
    if nnodes is not None:
        return _merge_nnodes(args, url, conf, *nnodes)
    if "min_nodes" not in url.params and "max_nodes" not in url.params:
        return url.with_params({"min_nodes": 1, "max_nodes": 1})  # torchrun's default --nnodes 1:1
    return url


def _merge_nnodes(args: argparse.Namespace, url: RendezvousURL, conf: Mapping[str, str], lo: int, hi: int
                  ) -> RendezvousURL:
    """``url`` with ``--nnodes LO:HI`` as ``min_nodes``/``max_nodes`` where the query does not give them.

    Where the URL (or ``--rdzv-conf``) gives them they must equal ``--nnodes``'s: the flag
    never silently overrides the URL.

    Raises:
        ConfigError: naming ``--nnodes`` (or ``PET_NNODES``), the query key and both values when they disagree.
    """
    flag = _shown(args, "--nnodes")
    for key, wanted in (("min_nodes", lo), ("max_nodes", hi)):
        value = url.params.get(key)
        if value is not None and value != wanted:
            where = "--rdzv-conf" if url.key_name(key) in conf or key in conf else "the URL's query"
            raise ConfigError(flag, f"{lo}:{hi}", f"disagrees with {url.key_name(key)}={value} in {where}; "
                              "give the node counts once, or the same in both")
    return url.with_params({"min_nodes": lo, "max_nodes": hi}, replace=False)


def _rank_request(args: argparse.Namespace, url: RendezvousURL) -> RendezvousURL:
    """``url`` with ``--node-rank`` (a rank request, elastic) and ``--node-labels`` as its query keys.

    Raises:
        ConfigError: ``--node-rank`` with ``rank_policy=join`` (join order only: nothing to request), or not
            below ``max_nodes``; ``--node-labels`` not ``KEY=VALUE[,KEY=VALUE...]``.
    """
    values: dict[str, Any] = {}
    if args.node_rank is not None:
        flag = _shown(args, "--node-rank")
        if url.params.get("rank_policy") == "join":
            raise ConfigError(flag, args.node_rank, "rank_policy=join gives ranks in join order only; a "
                              "rank request needs rank_policy=stable or topology (docs/ranks.md)")
        most = url.params.get("max_nodes")
        if most is not None and args.node_rank >= most:
            raise ConfigError(flag, args.node_rank, f"must be less than the most nodes ({most})")
        values["node_rank"] = args.node_rank
    if args.node_labels is not None:
        parse_node_labels("--node-labels", args.node_labels)  # names the flag, not the query key
        values["node_labels"] = args.node_labels
    return url.with_params(values) if values else url


def _check_elastic_master(args: argparse.Namespace, url: RendezvousURL) -> str | None:
    """Check ``--node-rank``/``--master-addr`` against an elastic rendezvous; return the MASTER_ADDR to give.

    Both only make sense when the job has one node (``max_nodes == 1``).
    """
    one_node = url.params.get("max_nodes") == 1
    if args.master_addr is None:
        return None
    if not one_node:
        raise ConfigError("--master-addr", args.master_addr, "in a multi-node elastic job group rank 0 changes "
                          "between rounds and publishes its own address (set it with --local-addr on each node), "
                          "or use the static rendezvous (--rdzv-backend static)")
    return _host("--master-addr", args.master_addr)


def _worker_command(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, list[str]]:
    """``(program, program_args)`` for ``SCRIPT ARGS`` under ``-m``/``--no-python``/``--run-path``.

    A script or ``-m`` module runs with ``PYTHON_EXEC`` if set, else this Python (torch's
    ``config_from_args``); ``--run-path`` always with this Python (torch runs it in a
    ``multiprocessing`` child of its own interpreter).

    Raises:
        ConfigError: conflicting modes, a missing script, or ``PYTHON_EXEC`` not an executable.
    """
    chosen = [name for name, on in (("-m", args.module), ("--no-python", args.no_python),
                                    ("--run-path", args.run_path)) if on]
    if len(chosen) > 1:
        raise ConfigError(chosen[0], True, f"{' and '.join(chosen)} cannot be combined")
    if args.no_python:
        program = args.script if os.sep in args.script else (shutil.which(args.script) or args.script)
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ConfigError("script", args.script, "not an executable file (--no-python)")
        return program, list(args.script_args)
    python = python_exec(environ) if not args.run_path else sys.executable
    if args.module:
        return python, ["-u", "-m", args.script, *args.script_args]
    if not os.path.isfile(args.script):
        raise ConfigError("script", args.script, "no such file")
    if args.run_path:  # torchrun wants an absolute path here; make it one
        return python, ["-u", "-c", RUN_PATH_CODE, os.path.abspath(args.script), *args.script_args]
    return python, ["-u", args.script, *args.script_args]



def _shutdown_timeout(args: argparse.Namespace, environ: Mapping[str, str]) -> float:
    """``--shutdown-timeout``, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 (torch's ``LaunchConfig``).

    Raises:
        ConfigError: the variable is not a non-negative integer (names it).
    """
    if args.shutdown_timeout is not None:
        return float(args.shutdown_timeout)
    raw = environ.get(SHUTDOWN_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_SHUTDOWN_TIMEOUT
    try:
        return float(_non_negative_int(raw))
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(SHUTDOWN_TIMEOUT_ENV, raw, str(exc)) from None


def backend_url(backend: str, endpoint: str, run_id: str) -> str:
    """``BACKEND://ENDPOINT/RUN_ID`` from ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``.

    See :func:`_backend_url` (the checks and the errors raised).
    """
    return _backend_url(backend, endpoint, run_id)[0]


def _backend_url(backend: str, endpoint: str, run_id: str) -> tuple[str, RendezvousURL]:
    """``BACKEND://ENDPOINT/RUN_ID`` from ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``, and it parsed.

    Nothing in the three values can add a query key, a fragment, credentials
    or a path segment: the backend must be a scheme name, the run id must pass
    :func:`rdzv_core.url.validate_run_id` (so ``%``, ``?``, ``/`` are refused
    rather than decoded), and ``endpoint`` is ``HOST[:PORT][,HOST[:PORT]...]``
    optionally followed by a directory (``/tmp/rdzv`` for ``file://``), whose
    segments are percent-quoted so that parsing the URL gives back exactly that
    directory. The text is parsed with the backend's rules (:func:`rdzv_core.parse_backend_url`),
    which also proves it.

    Raises:
        ConfigError: naming ``--rdzv-backend``, ``--rdzv-endpoint`` or ``--rdzv-id`` and the value.
        UnknownBackendError: no installed backend has that name.
    """
    if not _SCHEME.fullmatch(backend):
        raise ConfigError("--rdzv-backend", backend, "not a backend name (lower-case letters, digits, '+', '.', '-')")
    backend = backend.removeprefix(HANDLER_PREFIX)  # torchrun's name of the same backend: rdzv-redis
    try:
        validate_run_id(run_id)
    except InvalidURLError as exc:
        raise ConfigError("--rdzv-id", run_id, exc.reason) from None
    shown = redact_text(endpoint)  # a user may put USER:PASSWORD@ here: never echo the password
    if not endpoint or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in endpoint):
        raise ConfigError("--rdzv-endpoint", shown, "empty, or contains whitespace or control characters")
    hosts, _, directory = endpoint.partition("/")
    if hosts and not _HOSTS.fullmatch(hosts):
        raise ConfigError("--rdzv-endpoint", shown, "expected HOST[:PORT][,HOST[:PORT]...] and/or a directory; "
                          "credentials and query keys go in --rdzv URL (or RDZV_URL) and --rdzv-conf")
    segments = [seg for seg in directory.split("/") if seg]
    if any(seg in (".", "..") for seg in segments):
        raise ConfigError("--rdzv-endpoint", shown, "'.' and '..' are not allowed in the directory")
    url = f"{backend}://{hosts}/" + "".join(urllib.parse.quote(seg, safe="") + "/" for seg in segments) + run_id
    try:
        _, parsed = parse_backend_url(url)
    except InvalidURLError as exc:
        raise ConfigError("--rdzv-endpoint", shown, f"{exc.field}: {exc.reason}") from None
    if (parsed.run_id, parsed.path, dict(parsed.params), parsed.username) != (run_id, "/".join(segments), {}, None):
        raise ConfigError("--rdzv-endpoint", shown, "does not give a URL with exactly this endpoint and run id")
    return url, parsed
