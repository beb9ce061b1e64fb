""":func:`build_config` turns ``rdzv-run``'s parsed options (:mod:`rdzv_agent.launch.args`)
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

The ``--node-check*`` options become the URL's ``node_check*`` query keys (:func:`node_check_params`),
so the rendezvous handler runs the checks, as under plain torchrun (``docs/node-health.md``); so does
``--network-check`` (``network_check=1``).

What each torchrun option does here, and where it differs from torchrun, is the
parity table in ``docs/torchrun.md`` (static mode: ``--node-rank``/``--master-addr``/
``--master-port``; ``--start-method``; ``--run-path``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.machinery
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rdzv_core.errors import ConfigError, InvalidURLError
from rdzv_core.url import RendezvousURL

from ..api import DEFAULT_ROLE
from ..supervision.hang_watch import interval_from_env
from ..supervision.ops_hooks import OpsHooks, ops_from_env
from ..workers.log_specs import PREFIX_TEMPLATE_ENV, load_logs_specs
from ..workers.streams import Std
from ..workers.warm import WARM_AFTER, WARM_AFTER_ENV, entry_path0
from .args import (
    DEFAULT_EXIT_BARRIER_TIMEOUT,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_SHUTDOWN_TIMEOUT,
    METRICS_PORT_ENV,
    RUN_PATH_CODE,
    SHUTDOWN_TIMEOUT_ENV,
    _non_negative_int,
    _non_negative_seconds,
    _port,
)
from .target import (
    LaunchTarget,
    Standalone,
    StaticRendezvous,
    as_given,
    backend_url,
    check_elastic_master,
    elastic_url,
    env_source,
    mode_of,
    rank_request,
    static_of,
)
from .worker_options import (
    DEFAULT_SIGNALS,
    PYTHON_EXEC_ENV,
    HandledSignals,
    check_virtual_local_rank,
    numa_plan,
    parse_signals,
    python_exec,
)

__all__ = ["LaunchConfig", "LaunchTarget", "StaticRendezvous", "Standalone", "build_config", "backend_url",
           "node_check_params"]


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
            its worker is bound to (:func:`~rdzv_agent.launch.worker_options.numa_plan`), else ``None``.
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
    restart_window: float | None = None
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
    # log specs
    local_ranks_filter: set[int] | None = None
    duplicate_stdout_filters: list[str] = dataclasses.field(default_factory=list)
    duplicate_stderr_filters: list[str] = dataclasses.field(default_factory=list)
    logs_specs: str | None = None
    log_line_prefix_template: str | None = None
    # flags and worker variables
    signals_to_handle: HandledSignals = field(default_factory=lambda: parse_signals(DEFAULT_SIGNALS))
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    numa_cpus: dict[int, frozenset[int]] | None = None
    # operations hooks (health check, watchdog, stuck-process check), from their variables
    ops: OpsHooks = OpsHooks()
    # events, metrics and error files
    #: ``--event-log-handler``: a name registered in torch's ``events.handlers``.
    event_log_handler: str = "null"
    #: ``--metrics-handler``: a torch ``MetricHandler`` for the ``torchelastic`` group, or ``None`` (left as is).
    metrics_handler: Any = None
    # progress, hangs and metrics
    #: ``--hang-timeout``: seconds without progress before a worker is hung (``None``: off).
    hang_timeout: float | None = None
    #: ``--metrics-port`` (or ``RDZV_METRICS_PORT``): the Prometheus port, or ``None``.
    metrics_port: int | None = None
    #: ``RDZV_PROGRESS_INTERVAL``: seconds between two writes of the workers' progress to the backend.
    progress_interval: float = 5.0
    #: ``--keep-orphans`` (``PET_KEEP_ORPHANS``): processes the workers leave behind are not stopped
    #: (:mod:`rdzv_agent.workers.reaper`).
    keep_orphans: bool = False
    #: The modules warm workers import besides torch (``--warm-imports``), ``None``: no warm workers
    #: (``--no-warm-workers``, ``PET_WARM_WORKERS=0``; :mod:`rdzv_agent.workers.warm`).
    warm_imports: list[str] | None = None
    #: Warm by default (neither ``--warm-workers`` nor ``--warm-imports`` given): warm only if the entry point
    #: changes nothing torch's import reads before it imports torch (:mod:`rdzv_agent.workers.warm_check`).
    warm_checked: bool = False
    #: ``RDZV_WARM_AFTER``: seconds the workers run before the next warm generation is started.
    warm_after: float = WARM_AFTER

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
        env_name = env_source(args, exc.field)
        if env_name is None:
            raise
        raise ConfigError(env_name, exc.value, exc.reason) from None


def _build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchConfig:
    mode, url_arg = mode_of(args, environ)
    static = static_of(args) if mode == "static" else None
    if mode == "static" and static is None:
        mode = "standalone"
    target: LaunchTarget
    master_addr: str | None
    if static is not None:
        for _, option, value in _node_check_options(args):
            if value == "":  # no check asked for
                continue
            raise ConfigError(as_given(args, option), value, "the static rendezvous (torch's) runs no node or network "
                              "checks: use --rdzv, --rdzv-backend with a backend, or --standalone")
        target, nnodes = static, (static.nnodes, static.nnodes)
        master_addr, master_port = static.master_addr, static.master_port
    else:
        url = elastic_url(args, mode, url_arg)
        url = rank_request(args, url)
        url = node_check_params(args, url)
        target = Standalone(url) if mode == "standalone" else url
        nnodes = (1, 1) if mode == "standalone" else args.nnodes
        master_addr, master_port = check_elastic_master(args, url), args.master_port
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
        restart_window=args.restart_window,
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
        keep_orphans=bool(getattr(args, "keep_orphans", False)),
        warm_imports=_warm_imports(args, program, program_args, environ),
        warm_checked=not _warm_asked(args),
        warm_after=_warm_after(environ),
    )


def _node_check_options(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """The ``--node-check*`` options given (or ``PET_NODE_CHECK``, unless blank): ``(query key, option, value)``.

    Raises:
        ConfigError: a ``--node-check-dir`` that is empty or holds ``:`` (the query key's separator).
    """
    dirs = getattr(args, "node_check_dir", None)
    for path in dirs or ():
        if not path or ":" in path:
            raise ConfigError("--node-check-dir", path, "must be a non-empty path without ':'")
    given = [("node_check", "--node-check", getattr(args, "node_check", None)),
             ("node_check_timeout", "--node-check-timeout", getattr(args, "node_check_timeout", None)),
             ("node_check_dirs", "--node-check-dir", ":".join(dirs) if dirs else None),
             ("node_check_min_free_mb", "--node-check-min-free-mb", getattr(args, "node_check_min_free_mb", None)),
             ("node_check_action", "--node-check-action", getattr(args, "node_check_action", None)),
             ("network_check", "--network-check", "1" if getattr(args, "network_check", False) else None)]
    return [(key, option, value) for key, option, value in given
            if value is not None and not (value == "" and env_source(args, option))]


def node_check_params(args: argparse.Namespace, url: RendezvousURL) -> RendezvousURL:
    """``url`` with the ``--node-check*`` options as its ``node_check*`` query keys (``docs/node-health.md``).

    An option on the command line replaces the key given in the URL or ``--rdzv-conf``; ``PET_NODE_CHECK``
    only fills in a ``node_check`` the URL lacks (as the handler reads it under plain torchrun).

    Raises:
        ConfigError: a value the query key refuses, naming the option (or ``PET_NODE_CHECK``) and the value.
    """
    for key, option, value in _node_check_options(args):
        try:
            url = url.with_params({key: value}, replace=env_source(args, option) is None)
        except InvalidURLError as exc:
            raise ConfigError(as_given(args, option), value, exc.reason) from None
    return url


def _warm_asked(args: argparse.Namespace) -> bool:
    """Warm workers asked for: ``--warm-workers`` (or a non-zero ``PET_WARM_WORKERS``) or ``--warm-imports``."""
    return bool(getattr(args, "warm_workers", False)) or getattr(args, "warm_imports", None) is not None


def _warm_after(environ: Mapping[str, str]) -> float:
    """``RDZV_WARM_AFTER`` in seconds (default :data:`~rdzv_agent.workers.warm.WARM_AFTER`).

    Raises:
        ConfigError: not a finite number >= 0 (names the variable and the value).
    """
    raw = environ.get(WARM_AFTER_ENV, "").strip()
    if not raw:
        return WARM_AFTER
    try:
        return _non_negative_seconds(raw)
    except argparse.ArgumentTypeError:
        raise ConfigError(WARM_AFTER_ENV, raw, "must be a finite number of seconds >= 0") from None


def _warm_imports(args: argparse.Namespace, program: str, program_args: Sequence[str],
                  environ: Mapping[str, str]) -> list[str] | None:
    """What warm workers import besides torch, or ``None`` if they are off (``--no-warm-workers`` or
    ``PET_WARM_WORKERS=0``; on by default).

    A module the workers' Python (this one) cannot find, on the path the entry point will have, is an
    error now rather than a warning per start (a typo). One that is found but fails to import is a
    WARNING at the first start, which is then cold (:mod:`rdzv_agent.workers.warm`).

    Raises:
        ConfigError: ``--warm-imports`` with ``--no-warm-workers``, or a module that cannot be found.
    """
    imports = getattr(args, "warm_imports", None)
    if getattr(args, "no_warm_workers", False):
        if imports:
            raise ConfigError(as_given(args, "--warm-imports"), ",".join(imports),
                              "needs warm workers, which --no-warm-workers turns off")
        return None
    if not _warm_asked(args) and environ.get("PET_WARM_WORKERS", "").strip():
        return None  # PET_WARM_WORKERS=0 (an integer other than 0 sets the flag)
    path0 = entry_path0(program_args)
    if path0 is not None and program == sys.executable and PYTHON_EXEC_ENV not in environ:
        path = [path0, *sys.path[1:]]
        for name in imports or []:
            top = name.split(".")[0]
            if top not in sys.modules and top not in sys.builtin_module_names \
                    and importlib.machinery.PathFinder.find_spec(top, path) is None:
                raise ConfigError(as_given(args, "--warm-imports"), name,
                                  f"no module named {top!r} on the workers' path (sys.path[0] {path0!r})")
    return list(imports or [])


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
            raise ConfigError(as_given(args, option), ",".join(map(str, beyond)),
                              f"no such local rank: this node runs {count} worker(s), local ranks 0..{count - 1}")


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


