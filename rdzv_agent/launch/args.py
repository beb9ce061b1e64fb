"""``rdzv-run`` arguments: torchrun's habits, one rendezvous URL.

::

    rdzv-run [--nnodes MIN[:MAX]] [--nproc-per-node N]
             (--rdzv URL | --rdzv-backend NAME --rdzv-endpoint HOST:PORT --rdzv-id ID | --standalone
              | [--rdzv-backend static] --node-rank R --master-addr A --master-port P)
             [--rdzv-conf k=v,...] [--max-restarts N] [--restart-window S] [--monitor-interval S] [--role NAME]
             [--log-dir DIR] [--redirects V] [--tee V] [-m | --no-python | --run-path]
             [--start-method M] [--local-addr A] [--log-level L] [--signals-to-handle SIG,...]
             [--virtual-local-rank] [--numa-binding MODE] [--shutdown-timeout S] [--exit-barrier-timeout S]
             [--local-ranks-filter R,...] [--duplicate-stdout-filters S,...] [--duplicate-stderr-filters S,...]
             [--logs-specs NAME] [--event-log-handler NAME] [--metrics-handler SPEC] [--hang-timeout S]
             [--metrics-port PORT] [--keep-orphans] [--warm-workers | --no-warm-workers]
             [--warm-imports MOD,...] [--node-check CMD] [--node-check-timeout S] [--node-check-dir DIR]...
             [--node-check-min-free-mb N] [--node-check-action {wait,exit}] [--network-check] SCRIPT [ARGS...]

``python -m rdzv_agent`` is the same command. Every option with a dash also has
torchrun's underscore spelling (``--nproc_per_node``). The URL may also come
from the environment variable ``RDZV_URL`` (keeps a password off the command
line and out of ``ps``).

As with torchrun, every option shared with it can be set with the environment
variable ``PET_<OPTION>`` (``PET_NPROC_PER_NODE=4``, ``PET_NNODES=2:4``,
``PET_RDZV_ENDPOINT``, ``PET_STANDALONE=1``, ...: torch's own
``torch.distributed.argparse_util.env``/``check_env`` actions); the command-line
flag wins. A variable's value is checked like the flag's, and a bad one is
reported naming the variable (exit status 2). ``--rdzv`` (``RDZV_URL``) and
``--log-level`` (``LOGLEVEL``) are this launcher's own; ``--node-check`` also reads
``PET_NODE_CHECK``, as the rendezvous handler does under plain torchrun.

:mod:`rdzv_agent.launch.config` turns the parsed options into a ``LaunchConfig``.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Sequence

from torch.distributed.argparse_util import check_env, env

from rdzv_core.errors import ConfigError

from ..api import DEFAULT_ROLE
from ..workers.log_specs import LOGS_SPECS_GROUP, parse_filters, parse_local_ranks
from ..workers.streams import Std, parse_std
from .worker_options import DEFAULT_SIGNALS, NUMA_MODES, SIGNALS_ENV, local_world_size, parse_signals

__all__ = [
    "build_parser", "parse_args", "strip_rdzv_options", "RDZV_OPTIONS", "URL_ENV", "START_METHODS", "RUN_PATH_CODE",
    "DEFAULT_MONITOR_INTERVAL", "DEFAULT_SHUTDOWN_TIMEOUT", "SHUTDOWN_TIMEOUT_ENV", "DEFAULT_EXIT_BARRIER_TIMEOUT",
    "STATIC_BACKEND", "STATIC_DEFAULT_ADDR", "STATIC_DEFAULT_PORT", "STATIC_DEFAULT_RUN_ID", "STATIC_DEFAULT_TIMEOUT",
    "METRICS_PORT_ENV", "NODE_CHECK_ACTIONS",
]

#: Environment variable that may hold the rendezvous URL (instead of ``--rdzv``).
URL_ENV = "RDZV_URL"
#: Environment variable that may give ``--metrics-port``.
METRICS_PORT_ENV = "RDZV_METRICS_PORT"

DEFAULT_MONITOR_INTERVAL = 0.5
#: torchrun's ``--shutdown-timeout`` default and the variable that overrides it.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: torch's ``exit_barrier_timeout`` (torchrun has no flag for it).
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0

#: torchrun's ``--start-method`` values (all mean the same here: see :mod:`rdzv_agent.launch.config`).
START_METHODS = ("spawn", "fork", "forkserver")

#: torchrun's defaults for the static rendezvous.
STATIC_BACKEND = "static"
STATIC_DEFAULT_ADDR = "127.0.0.1"
STATIC_DEFAULT_PORT = 29500
STATIC_DEFAULT_RUN_ID = "none"
STATIC_DEFAULT_TIMEOUT = 600

#: ``--node-check-action``'s values (the query key ``node_check_action``'s).
NODE_CHECK_ACTIONS = ("wait", "exit")

#: What a worker started with ``--run-path`` runs: ``python -u -c CODE SCRIPT ARGS...``.
RUN_PATH_CODE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"



def _nnodes(text: str) -> tuple[int, int]:
    lo_text, sep, hi_text = text.partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN or MIN:MAX (integers), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _module_names(text: str) -> list[str]:
    """``a,b.c``: dotted module names (empty items ignored)."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise argparse.ArgumentTypeError(f"not a module name: {name!r}")
    return names


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}")
    return value


def _seconds(text: str, allow_zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (0 <= value if allow_zero else 0 < value) or not value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds {'>=' if allow_zero else '>'} 0, "
                                         f"got {text!r}")
    return value


def _non_negative_seconds(text: str) -> float:
    return _seconds(text, allow_zero=True)


def _mebibytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of MiB >= 0, got {text!r}")
    return value


def _local_ranks(text: str) -> set[int] | None:
    try:
        return parse_local_ranks(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{exc.reason}: {text!r}") from None


def _std(option: str):  # type: ignore[no-untyped-def]
    def convert(text: str) -> Std | dict[int, Std]:
        try:
            return parse_std(option, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.reason) from None

    return convert


def _event_log_handler(text: str) -> str:
    """A name registered in torch's ``events.handlers`` (torch's ``get_logging_handler`` keys)."""
    from torch.distributed.elastic.events import handlers

    names = sorted(handlers._log_handlers)
    if text not in names:
        raise argparse.ArgumentTypeError(f"expected a registered event handler ({', '.join(names)}), got {text!r}")
    return text


def _metrics_handler(text: str) -> Any:
    """A torch ``MetricHandler`` (see :func:`rdzv_agent.reporting.torch_events.metric_handler`)."""
    from ..reporting.torch_events import metric_handler

    try:
        return metric_handler(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_GIVEN = "_rdzv_run_flags_given"  # namespace attribute: dests given on the command line


class _PetValue(env):
    """torch's ``env`` action: ``PET_<DEST>`` gives the default; checked here at once, like the flag.

    torch leaves the variable's text as the default for argparse to convert at
    the end; a bad one would then be reported as the flag's. Here it is
    converted (``type``, ``choices``) when the parser is built: on success the
    converted value becomes the default, on failure the option's own default
    stays and :attr:`env_error` holds the reason (reported by :func:`build_config`,
    unless the flag is given on the command line, which wins).
    """

    def __init__(self, option_strings: list[str], dest: str, default: Any = None, **kwargs: Any) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, **kwargs)
        self.env_name = f"PET_{dest.upper()}"
        self.env_raw = os.environ.get(self.env_name)
        self.env_error: str | None = None
        if self.env_raw is None:
            return
        try:
            value = self.type(self.env_raw) if callable(self.type) else self.env_raw
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            self.default, self.env_error = default, str(exc) or "invalid value"
            return
        if self.choices is not None and value not in self.choices:
            self.default, self.env_error = default, f"expected one of {', '.join(map(str, self.choices))}"
            return
        self.default = value

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        namespace.__dict__.setdefault(_GIVEN, set()).add(self.dest)
        super().__call__(parser, namespace, values, option_string)  # type: ignore[no-untyped-call]  # torch's


class _PetFlag(check_env):
    """torch's ``check_env`` action (``PET_<DEST>=1`` sets the flag); a non-integer value is an error.

    torch's raises ``ValueError`` while the parser is built; here the flag stays
    off and :attr:`env_error` holds the reason (see :class:`_PetValue`).
    """

    def __init__(self, option_strings: list[str], dest: str, default: bool = False, **kwargs: Any) -> None:
        self.env_name = f"PET_{dest.upper()}"
        self.env_raw = os.environ.get(self.env_name)
        self.env_error: str | None = None
        try:
            int(self.env_raw) if self.env_raw is not None else 0
        except ValueError:
            self.env_error = "expected an integer (0: off, other: on), as torchrun reads it"
            argparse.Action.__init__(self, option_strings=option_strings, dest=dest, const=True, default=default,
                                     nargs=0, **kwargs)
            return
        super().__init__(option_strings=option_strings, dest=dest, default=default, **kwargs)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        namespace.__dict__.setdefault(_GIVEN, set()).add(self.dest)
        super().__call__(parser, namespace, values, option_string)  # type: ignore[no-untyped-call]  # torch's


class _Parser(argparse.ArgumentParser):
    """Records, in the namespace, which values came from ``PET_*`` variables.

    After parsing, ``from_env`` maps each such dest to its variable's name and
    ``env_errors`` lists ``(variable, value, reason)`` for bad ones (flags given on
    the command line win: their variables are neither used nor checked).
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        given = ns.__dict__.pop(_GIVEN, set())
        ns.from_env, ns.env_errors = {}, []
        for action in self._actions:
            if isinstance(action, (_PetValue, _PetFlag)) and action.env_raw is not None and action.dest not in given:
                ns.from_env[action.dest] = action.env_name
                if action.env_error is not None:
                    ns.env_errors.append((action.env_name, action.env_raw, action.env_error))
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    """The ``rdzv-run`` argument parser (options shared with torchrun also read ``PET_<OPTION>``)."""
    p = _Parser(
        prog="rdzv-run",
        description="Launch elastic PyTorch workers on this node (torchrun's options, any rdzv backend).",
        epilog="As with torchrun, each option shared with torchrun can also be set with the environment variable "
               "PET_<OPTION> (e.g. PET_NPROC_PER_NODE=4, PET_STANDALONE=1); the command line wins.",
        allow_abbrev=False,
    )

    def opt(*names: str, pet: bool = True, **kwargs: Any) -> None:
        spellings = list(names)
        for name in names:
            if name.startswith("--") and "-" in name[2:]:
                spellings.append("--" + name[2:].replace("-", "_"))
        if pet:  # torchrun's option: PET_<OPTION> as well
            kwargs["action"] = _PetFlag if kwargs.get("action") == "store_true" else _PetValue
        p.add_argument(*spellings, **kwargs)

    opt("--nnodes", type=_nnodes, default=None, metavar="MIN[:MAX]",
        help="nodes in the job: a number or MIN:MAX for an elastic job (default: the URL's, else 1:1)")
    opt("--nproc-per-node", type=local_world_size, default=1, metavar="N",
        help="workers on this node: a number, or cpu, gpu, xpu, auto (accelerators, else CPUs), as torchrun "
             "(default 1)")
    opt("--signals-to-handle", type=parse_signals, default=parse_signals(DEFAULT_SIGNALS), metavar="SIG,...",
        help=f"signals that stop the launcher: forwarded to the workers, which are stopped; the node leaves the "
             f"rendezvous and exits 128+N (default {DEFAULT_SIGNALS}; the workers get it in {SIGNALS_ENV})")
    opt("--virtual-local-rank", action="store_true",
        help="every worker gets LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to its own device (item LOCAL_RANK "
             "of this process's list, else LOCAL_RANK)")
    opt("--numa-binding", default=None, choices=NUMA_MODES,
        help="bind each worker with numactl to the CPUs near its device (torch's policies; without GPUs the "
             "local ranks are spread over the NUMA nodes); needs numactl on PATH")
    opt("--rdzv", pet=False, default=None, metavar="URL",
        help=f"rendezvous URL SCHEME://HOST:PORT/RUN_ID?key=value (or env {URL_ENV})")
    opt("--rdzv-backend", default=None, metavar="NAME", help="backend scheme, with --rdzv-endpoint and --rdzv-id")
    opt("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="backend address (a directory for file)")
    opt("--rdzv-id", default=None, metavar="ID", help="run id, the same on every node")
    opt("--rdzv-conf", default=None, metavar="K=V,...", help="rendezvous settings added to the URL query")
    opt("--standalone", action="store_true",
        help="single node: a file:// rendezvous in a fresh temporary directory, no server")
    opt("--max-restarts", type=_non_negative_int, default=0, metavar="N",
        help="restarts of a failed worker group before giving up (default 0)")
    opt("--restart-window", pet=False, type=_seconds, default=None, metavar="S",
        help="count a failure restart against --max-restarts for S seconds only (default: for the job's life)")
    opt("--monitor-interval", type=_seconds, default=DEFAULT_MONITOR_INTERVAL, metavar="S",
        help=f"seconds between checks of the workers (default {DEFAULT_MONITOR_INTERVAL})")
    opt("--role", default=DEFAULT_ROLE, help=f"worker role name (default {DEFAULT_ROLE!r})")
    opt("--event-log-handler", type=_event_log_handler, default="null", metavar="NAME",
        help="where the agent's torch events go: a handler registered in torch.distributed.elastic.events.handlers "
             "(null, console, dynamic_rendezvous, or one a wrapper registered; default null)")
    opt("--metrics-handler", pet=False, type=_metrics_handler, default=None, metavar="SPEC",
        help="torch metrics handler for the agent's 'torchelastic' metrics: console, null or MODULE:ATTR (a "
             "MetricHandler, or a class/function returning one); default: leave metrics.configure(...) as it is")
    opt("--hang-timeout", pet=False, type=_seconds, default=None, metavar="S",
        help="a worker that reported progress (rdzv_agent.progress.step, or $RDZV_PROGRESS_FILE) and then none for "
             "S seconds is hung: its stacks are dumped to the log, and it counts as a failure (a restart is spent; "
             "default: off)")
    opt("--metrics-port", pet=False, type=_port, default=None, metavar="PORT",
        help=f"serve Prometheus metrics on this port (all interfaces; default: env {METRICS_PORT_ENV}, else off)")
    opt("--log-dir", default=None, metavar="DIR", help="directory for worker logs (default: a new temp dir)")
    opt("--redirects", "-r", type=_std("redirects"), default=Std.NONE, metavar="V",
        help="streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or LOCAL_RANK:V,...")
    opt("--tee", "-t", type=_std("tee"), default=Std.NONE, metavar="V",
        help="streams to log files and the console (same values as --redirects)")
    opt("--local-ranks-filter", type=_local_ranks, default=None, metavar="R,...",
        help="only these local ranks' output reaches the console (e.g. 0,1); log files are unchanged")
    opt("--duplicate-stdout-filters", type=parse_filters, default=[], metavar="S,...",
        help="tee'd stdout lines containing one of these strings also go to the attempt's filtered_stdout.log "
             "(',,' is a comma)")
    opt("--duplicate-stderr-filters", type=parse_filters, default=[], metavar="S,...",
        help="tee'd stderr lines containing one of these strings also go to the attempt's filtered_stderr.log")
    opt("--logs-specs", pet=False, default=None, metavar="NAME",
        help=f"the {LOGS_SPECS_GROUP} entry point (a torch LogsSpecs class) that places the log files "
             "(default: torch's layout; 'default' is torch's DefaultLogsSpecs)")
    opt("--module", "-m", action="store_true", help="run SCRIPT as a Python module (python -m)")
    opt("--no-python", action="store_true", help="run SCRIPT as an executable, not with Python")
    opt("--run-path", action="store_true",
        help="run SCRIPT with runpy.run_path(SCRIPT, run_name='__main__') in each worker's Python")
    opt("--start-method", default="spawn", choices=START_METHODS,
        help="accepted for torchrun compatibility and changes nothing: every worker is a new process running "
             "the program (fork+exec), which is also what torchrun does for a script, -m module, --no-python "
             "executable (torchrun uses the method only for --run-path and Python function entry points)")
    opt("--node-rank", type=_non_negative_int, default=None, metavar="R",
        help="this node's rank, with the static rendezvous (--rdzv-backend static, torchrun's default); elastic: "
             "the group rank this node asks for, given where no other node's request wins (docs/ranks.md)")
    opt("--node-labels", pet=False, default=None, metavar="K=V,...",
        help="this node's topology labels for rank_policy=topology, e.g. rack=r1,switch=s3: group ranks are "
             "contiguous per label, in this key order (default: env RDZV_NODE_LABELS, else Slurm's topology)")
    opt("--master-addr", default=None, metavar="ADDR",
        help=f"static rendezvous: node rank 0's address (default {STATIC_DEFAULT_ADDR}); "
             "elastic one-node job: the workers' MASTER_ADDR")
    opt("--master-port", type=_port, default=None, metavar="PORT",
        help=f"static rendezvous: node rank 0's store port (default {STATIC_DEFAULT_PORT}); "
             "elastic: the workers' MASTER_PORT (default: a free port each round)")
    opt("--local-addr", default=None, metavar="ADDR", help="address to publish as MASTER_ADDR (default: FQDN)")
    opt("--shutdown-timeout", type=_non_negative_int, default=None, metavar="S",
        help=f"seconds between SIGTERM and SIGKILL when stopping the workers (default: env "
             f"{SHUTDOWN_TIMEOUT_ENV}, else {DEFAULT_SHUTDOWN_TIMEOUT:g}); workers hung in a collective may ignore "
             "SIGTERM")
    opt("--keep-orphans", action="store_true",
        help="let processes the workers start outlive the job (a daemon meant to stay): by default whatever the "
             "workers leave behind is stopped with each worker group and when the launcher ends, even by kill -9")
    opt("--warm-workers", action="store_true",
        help="warm workers even for an entry point that changes what 'import torch' reads before importing it "
             "(by default they are on, but such a script starts cold): the next generation of this node's workers "
             "is kept started ahead (Python up, torch and --warm-imports imported, the slot's LOCAL_RANK/"
             "CUDA_VISIBLE_DEVICES/OMP_NUM_THREADS set), so a restart or membership change skips the start-up; "
             "one idle interpreter per local rank (docs/warm-workers.md)")
    opt("--no-warm-workers", pet=False, action="store_true",
        help="no warm workers (also PET_WARM_WORKERS=0): every start is cold (with --warm-imports: an error)")
    opt("--warm-imports", type=_module_names, default=None, metavar="MOD,...",
        help="modules the warm workers import besides torch (turns --warm-workers on); one not found on the "
             "workers' path is an error, one that fails to import a WARNING (the workers then start cold)")
    opt("--exit-barrier-timeout", type=_non_negative_seconds, default=DEFAULT_EXIT_BARRIER_TIMEOUT, metavar="S",
        help=f"seconds a node whose workers succeeded waits for the other nodes of its round to finish before it "
             f"ends and closes the run (default {DEFAULT_EXIT_BARRIER_TIMEOUT:g}, torch's; 0: do not wait)")
    opt("--node-check", default=None, metavar="CMD",
        help="shell command run before each join (exit 0: healthy); a failing node does not join "
             "(docs/node-health.md)")
    opt("--node-check-timeout", pet=False, type=_seconds, default=None, metavar="S",
        help="seconds a node check may take (default 60)")
    opt("--node-check-dir", pet=False, action="append", default=None, metavar="DIR",
        help="a directory that must be writable with --node-check-min-free-mb free (repeatable)")
    opt("--node-check-min-free-mb", pet=False, type=_mebibytes, default=None, metavar="N",
        help="MiB each --node-check-dir needs free (default 1024)")
    opt("--node-check-action", pet=False, default=None, choices=NODE_CHECK_ACTIONS,
        help="when a check fails: wait (re-check, default) or exit")
    opt("--network-check", pet=False, action="store_true",
        help="check the network of every formed round before the workers start (a ring of TCP transfers between "
             "the nodes); a node whose links are much slower than the others' is quarantined and left out while "
             "min_nodes are met (query key network_check; docs/node-health.md)")
    opt("--log-level", pet=False, default=None, metavar="LEVEL",
        help="launcher log level (default: env LOGLEVEL or WARNING)")
    p.add_argument("script", metavar="SCRIPT", help="training script, module (-m) or executable (--no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments of SCRIPT")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; exits with status 2 and a usage message on bad options."""
    return build_parser().parse_args(argv)


def _rdzv_conf(text: str | None) -> dict[str, str]:
    """``--rdzv-conf K=V,...`` as a dict (spaces around keys and values removed), or ConfigError."""
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--rdzv-conf", item, "expected KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


#: Options that name the rendezvous (both spellings); :func:`strip_rdzv_options` removes them.
RDZV_OPTIONS = frozenset({
    "--rdzv", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id",
})
_FLAGS = frozenset({
    "--standalone", "--module", "-m", "--no-python", "--no_python", "--run-path", "--run_path", "-h", "--help",
    "--warm-workers", "--warm_workers", "--no-warm-workers", "--no_warm_workers",
})


def strip_rdzv_options(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--rdzv``/``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id`` and their values.

    Only options before SCRIPT are touched; SCRIPT and its arguments are kept as given.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):
            out += argv[i:]  # SCRIPT and its arguments
            break
        name, has_value, _ = token.partition("=")
        takes_value = name not in _FLAGS and not has_value
        if name in RDZV_OPTIONS:
            i += 2 if takes_value else 1
            continue
        out.append(token)
        if takes_value and i + 1 < len(argv):
            out.append(argv[i + 1])
            i += 1
        i += 1
    return out
