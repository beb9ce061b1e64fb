"""``rdzv-run`` arguments: torchrun's habits, one rendezvous URL.

::

    rdzv-run [--nnodes MIN[:MAX]] [--nproc-per-node N]
             (--rdzv URL | --rdzv-backend NAME --rdzv-endpoint HOST:PORT --rdzv-id ID | --standalone
              | [--rdzv-backend static] --node-rank R --master-addr A --master-port P)
             [--rdzv-conf k=v,...] [--max-restarts N] [--monitor-interval S] [--role NAME]
             [--log-dir DIR] [--redirects V] [--tee V] [-m | --no-python | --run-path]
             [--start-method M] [--local-addr A] [--log-level L] SCRIPT [ARGS...]

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
``--log-level`` (``LOGLEVEL``) are this launcher's own.

:func:`build_config` turns the arguments into a :class:`LaunchConfig`: the final
rendezvous URL (``--rdzv-conf`` merged into its query, overriding the same keys
there; ``--nnodes`` fills in ``min_nodes``/``max_nodes`` and must agree with them
where the URL or ``--rdzv-conf`` gives them) and the worker command. ``--rdzv-backend``,
``--rdzv-endpoint`` and ``--rdzv-id`` are checked and quoted before they become
a URL, so none of them can add a query key or another path segment.

torchrun's options without a rendezvous of their own, and what they do here:

* ``--node-rank R``, ``--master-addr A``, ``--master-port P``: as in torchrun,
  with the *static* rendezvous (``--rdzv-backend static``, or none of
  ``--rdzv``/``--standalone``/``--rdzv-backend`` given: torchrun's default) the
  node ranks are fixed, node rank 0's agent serves a TCP store at ``A:P`` and
  the workers get ``MASTER_ADDR=A``/``MASTER_PORT=P`` and reuse that store
  (``TORCHELASTIC_USE_AGENT_STORE=True``). A static job of one node without a
  port runs like ``--standalone`` (torchrun does the same). With an elastic
  rendezvous, ``--master-port`` is the ``MASTER_PORT`` the workers get (group
  rank 0 binds it; no new port is picked if it is taken), and ``--master-addr``
  the ``MASTER_ADDR`` they get, on a one-node job only (in a multi-node job
  group rank 0 changes between rounds and publishes its own address:
  ``--local-addr``). ``--node-rank`` is refused there unless it is the only
  possible one (0 of 1 node): an elastic rendezvous assigns node ranks.
* ``--start-method spawn|fork|forkserver``: accepted; it changes nothing,
  because the workers are always new processes (``fork`` + ``exec`` of the
  program, in their own session), which is also what torchrun does for a
  script, a module (``-m``) or an executable (``--no-python``).
* ``--run-path``: each worker is a new Python that runs SCRIPT with
  ``runpy.run_path(SCRIPT, run_name="__main__")`` (torchrun runs it that way in
  a process of its own, too).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch.distributed.argparse_util import check_env, env

from rdzv_core.errors import ConfigError, InvalidURLError
from rdzv_core.url import QUERY_ALIASES, RENDEZVOUS_QUERY_KEYS, parse_url, redact_text, split_scheme, validate_run_id

from .api import DEFAULT_ROLE
from .streams import Std, parse_std

__all__ = [
    "LaunchConfig", "StaticRendezvous", "build_parser", "parse_args", "build_config", "merge_query", "backend_url",
    "strip_rdzv_options", "URL_ENV", "START_METHODS",
]

#: Environment variable that may hold the rendezvous URL (instead of ``--rdzv``).
URL_ENV = "RDZV_URL"

DEFAULT_MONITOR_INTERVAL = 0.5
#: torchrun's ``--shutdown-timeout`` default and the variable that overrides it.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: torch's ``exit_barrier_timeout`` (torchrun has no flag for it).
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0

#: torchrun's ``--start-method`` values (all mean the same here: see the module docstring).
START_METHODS = ("spawn", "fork", "forkserver")

#: torchrun's defaults for the static rendezvous.
STATIC_BACKEND = "static"
STATIC_DEFAULT_ADDR = "127.0.0.1"
STATIC_DEFAULT_PORT = 29500
STATIC_DEFAULT_RUN_ID = "none"
STATIC_DEFAULT_TIMEOUT = 600

#: What a worker started with ``--run-path`` runs: ``python -u -c CODE SCRIPT ARGS...``.
RUN_PATH_CODE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

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


@dataclass
class LaunchConfig:
    """Everything the launcher needs, validated.

    Attributes:
        url: the rendezvous URL to open (may hold a password: never print it);
            ``""`` for the static rendezvous.
        static: the static rendezvous (``--rdzv-backend static``), else ``None``.
        min_nodes, max_nodes: from ``--nnodes`` (``None`` when the URL decides).
        master_addr: ``MASTER_ADDR`` for the workers (``--master-addr``, one-node
            elastic jobs), else ``None`` (group rank 0 publishes its address).
        master_port: ``MASTER_PORT`` for the workers (``--master-port``), else
            ``None`` (group rank 0 picks a free port each round).
        start_method: ``--start-method`` as given (it changes nothing).
        nproc_per_node: workers on this node.
        program, program_args: the worker command ``[program, *program_args]``.
        standalone: ``--standalone``: the launcher creates (and removes) a
            temporary directory for a ``file://`` rendezvous; ``url`` holds the
            placeholder ``{standalone_dir}``.
        (other attributes mirror the options)
    """

    url: str
    min_nodes: int | None
    max_nodes: int | None
    nproc_per_node: int
    program: str
    program_args: list[str]
    standalone: bool = False
    role: str = DEFAULT_ROLE
    max_restarts: int = 0
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL
    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_addr: str | None = None
    static: StaticRendezvous | None = None
    master_addr: str | None = None
    master_port: int | None = None
    start_method: str = "spawn"
    shutdown_timeout: float = 30.0
    exit_barrier_timeout: float = 300.0


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


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'cpu' or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


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


def _std(option: str):  # type: ignore[no-untyped-def]
    def convert(text: str) -> Std | dict[int, Std]:
        try:
            return parse_std(option, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.reason) from None

    return convert


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
        super().__call__(parser, namespace, values, option_string)


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
        super().__call__(parser, namespace, values, option_string)


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
    opt("--nproc-per-node", type=_nproc, default=1, metavar="N", help="workers on this node (default 1)")
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
    opt("--monitor-interval", type=_seconds, default=DEFAULT_MONITOR_INTERVAL, metavar="S",
        help=f"seconds between checks of the workers (default {DEFAULT_MONITOR_INTERVAL})")
    opt("--role", default=DEFAULT_ROLE, help=f"worker role name (default {DEFAULT_ROLE!r})")
    opt("--log-dir", default=None, metavar="DIR", help="directory for worker logs (default: a new temp dir)")
    opt("--redirects", "-r", type=_std("redirects"), default=Std.NONE, metavar="V",
        help="streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or LOCAL_RANK:V,...")
    opt("--tee", "-t", type=_std("tee"), default=Std.NONE, metavar="V",
        help="streams to log files and the console (same values as --redirects)")
    opt("--module", "-m", action="store_true", help="run SCRIPT as a Python module (python -m)")
    opt("--no-python", action="store_true", help="run SCRIPT as an executable, not with Python")
    opt("--run-path", action="store_true",
        help="run SCRIPT with runpy.run_path(SCRIPT, run_name='__main__') in each worker's Python")
    opt("--start-method", default="spawn", choices=START_METHODS,
        help="accepted for torchrun compatibility; changes nothing: workers are always new processes "
             "(fork+exec of the program), as torchrun does for a script, module or executable")
    opt("--node-rank", type=_non_negative_int, default=None, metavar="R",
        help="this node's rank, with the static rendezvous (--rdzv-backend static, torchrun's default)")
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
    opt("--exit-barrier-timeout", type=_non_negative_seconds, default=DEFAULT_EXIT_BARRIER_TIMEOUT, metavar="S",
        help=f"seconds a node whose workers succeeded waits for the other nodes of its round to finish before it "
             f"ends and closes the run (default {DEFAULT_EXIT_BARRIER_TIMEOUT:g}, torch's; 0: do not wait)")
    opt("--log-level", pet=False, default=None, metavar="LEVEL",
        help="launcher log level (default: env LOGLEVEL or WARNING)")
    p.add_argument("script", metavar="SCRIPT", help="training script, module (-m) or executable (--no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments of SCRIPT")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; exits with status 2 and a usage message on bad options."""
    return build_parser().parse_args(argv)


def merge_query(url: str, extra: dict[str, str]) -> str:
    """``url`` with ``extra`` query keys set, replacing the same keys (and their aliases) there."""
    base, sep, query = url.partition("?")
    if not extra:
        return url
    canonical = {QUERY_ALIASES.get(k, k) for k in extra}
    kept = [(k, v) for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)
            if QUERY_ALIASES.get(k, k) not in canonical]
    return base + "?" + urllib.parse.urlencode(kept + list(extra.items()))


def _rdzv_conf(text: str | None) -> dict[str, str]:
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


def backend_url(backend: str, endpoint: str, run_id: str) -> str:
    """``BACKEND://ENDPOINT/RUN_ID`` from ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``.

    Nothing in the three values can add a query key, a fragment, credentials
    or a path segment: the backend must be a scheme name, the run id must pass
    :func:`rdzv_core.url.validate_run_id` (so ``%``, ``?``, ``/`` are refused
    rather than decoded), and ``endpoint`` is ``HOST[:PORT][,HOST[:PORT]...]``
    optionally followed by a directory (``/tmp/rdzv`` for ``file://``), whose
    segments are percent-quoted so that parsing the URL gives back exactly that
    directory. The result is parsed once more to prove it.

    Raises:
        ConfigError: naming ``--rdzv-backend``, ``--rdzv-endpoint`` or ``--rdzv-id`` and the value.
    """
    if not _SCHEME.fullmatch(backend):
        raise ConfigError("--rdzv-backend", backend, "not a backend name (lower-case letters, digits, '+', '.', '-')")
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
        parsed = parse_url(url)
    except InvalidURLError as exc:
        raise ConfigError("--rdzv-endpoint", shown, f"{exc.field}: {exc.reason}") from None
    if (parsed.run_id, parsed.path, dict(parsed.params), parsed.username) != (run_id, "/".join(segments), {}, None):
        raise ConfigError("--rdzv-endpoint", shown, "does not give a URL with exactly this endpoint and run id")
    return url


def _mode(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """Which rendezvous the options ask for: ``(mode, url)``.

    ``mode`` is ``"standalone"``, ``"url"`` (``--rdzv`` or ``RDZV_URL``; ``url`` is
    set), ``"backend"`` (``--rdzv-backend`` with endpoint and id) or ``"static"``.
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
    if any(x is not None for x in (args.node_rank, args.master_addr, args.master_port)):
        return "static", None  # torchrun's default backend
    raise ConfigError("rendezvous", None, f"give --rdzv URL (or env {URL_ENV}), --rdzv-backend/--rdzv-endpoint/"
                      "--rdzv-id, --standalone, or --node-rank/--master-addr/--master-port (static)")


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
        try:
            parsed = parse_url(f"tcp://{args.rdzv_endpoint}/{run_id}")
        except InvalidURLError as exc:
            raise ConfigError("--rdzv-endpoint", shown, f"{exc.field}: {exc.reason}") from None
        if len(parsed.hosts) != 1 or parsed.hosts[0][1] is None or parsed.path or parsed.params or parsed.username:
            raise ConfigError("--rdzv-endpoint", shown, "the static rendezvous needs one HOST:PORT")
        addr, port = parsed.hosts[0]
        return StaticRendezvous(addr, int(port), node_rank, hi, run_id, timeout)  # type: ignore[arg-type]
    addr = _host("--master-addr", args.master_addr) if args.master_addr is not None else STATIC_DEFAULT_ADDR
    port = args.master_port if args.master_port is not None else STATIC_DEFAULT_PORT
    return StaticRendezvous(addr, port, node_rank, hi, run_id, timeout)


def _elastic_url(args: argparse.Namespace, mode: str, url_arg: str | None) -> tuple[str, int | None, int | None]:
    """The final URL of an elastic rendezvous, and ``(min_nodes, max_nodes)`` from ``--nnodes``."""
    min_nodes, max_nodes = args.nnodes if args.nnodes is not None else (None, None)
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
        url = "file://{standalone_dir}/" + run_id
        min_nodes = max_nodes = 1
    elif mode == "url":
        url = str(url_arg)
        split_scheme(url)  # errors about the URL as a whole echo it as given, before keys are merged in
    else:
        for name, value in zip(("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"),
                               (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id), strict=True):
            if not value:
                raise ConfigError(name, value, "--rdzv-backend, --rdzv-endpoint and --rdzv-id go together")
        url = backend_url(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id)

    conf = _rdzv_conf(args.rdzv_conf)
    url = merge_query(url, conf)
    if min_nodes is not None:
        url = _merge_nnodes(args, url, conf, min_nodes, max_nodes)  # type: ignore[arg-type]
    elif not _query_has(url, ("min_nodes", "max_nodes")):
        url = merge_query(url, {"min_nodes": "1", "max_nodes": "1"})  # torchrun's default --nnodes 1:1
    return url, min_nodes, max_nodes


def _merge_nnodes(args: argparse.Namespace, url: str, conf: Mapping[str, str], lo: int, hi: int) -> str:
    """``url`` with ``--nnodes LO:HI`` as ``min_nodes``/``max_nodes`` where the query does not give them.

    Where the URL (or ``--rdzv-conf``) gives them, their values are checked as the
    URL parser does and must equal ``--nnodes``'s: the flag never silently
    overrides the URL.

    Raises:
        InvalidURLError: a bad ``min_nodes``/``max_nodes`` value (names the key and value).
        ConfigError: naming ``--nnodes`` (or ``PET_NNODES``), the query key and both values when they disagree.
    """
    in_url: dict[str, tuple[str, int]] = {}  # canonical key -> (key as written, value)
    for raw_key, raw in urllib.parse.parse_qsl(url.partition("?")[2], keep_blank_values=True):
        key = QUERY_ALIASES.get(raw_key, raw_key)
        if key in ("min_nodes", "max_nodes"):
            in_url[key] = (raw_key, RENDEZVOUS_QUERY_KEYS[key](raw_key, raw))
    if "min_nodes" in in_url and "max_nodes" in in_url and in_url["min_nodes"][1] > in_url["max_nodes"][1]:
        raise InvalidURLError(in_url["min_nodes"][0], in_url["min_nodes"][1],
                              f"greater than {in_url['max_nodes'][0]}={in_url['max_nodes'][1]}")
    flag = _shown(args, "--nnodes")
    for key, wanted in (("min_nodes", lo), ("max_nodes", hi)):
        if key in in_url and in_url[key][1] != wanted:
            raw_key, value = in_url[key]
            where = "--rdzv-conf" if any(QUERY_ALIASES.get(k, k) == key for k in conf) else "the URL's query"
            raise ConfigError(flag, f"{lo}:{hi}", f"disagrees with {raw_key}={value} in {where}; "
                              f"give the node counts once, or the same in both")
    missing = {k: str(v) for k, v in (("min_nodes", lo), ("max_nodes", hi)) if k not in in_url}
    return merge_query(url, missing) if missing else url


def _check_elastic_master(args: argparse.Namespace, url: str) -> str | None:
    """Check ``--node-rank``/``--master-addr`` against an elastic rendezvous; return the MASTER_ADDR to give.

    Both only make sense when the job has one node (``max_nodes == 1``).
    """
    one_node = _query_value(url, "max_nodes") == "1"
    if args.node_rank is not None and not (args.node_rank == 0 and one_node):
        raise ConfigError("--node-rank", args.node_rank, "an elastic rendezvous assigns node ranks at each round; "
                          "a fixed node rank needs the static rendezvous (--rdzv-backend static)")
    if args.master_addr is None:
        return None
    if not one_node:
        raise ConfigError("--master-addr", args.master_addr, "in a multi-node elastic job group rank 0 changes "
                          "between rounds and publishes its own address (set it with --local-addr on each node), "
                          "or use the static rendezvous (--rdzv-backend static)")
    return _host("--master-addr", args.master_addr)


def _worker_command(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``(program, program_args)`` for ``SCRIPT ARGS`` under ``-m``/``--no-python``/``--run-path``."""
    chosen = [name for name, on in (("-m", args.module), ("--no-python", args.no_python),
                                    ("--run-path", args.run_path)) if on]
    if len(chosen) > 1:
        raise ConfigError(chosen[0], True, f"{' and '.join(chosen)} cannot be combined")
    if args.no_python:
        program = args.script if os.sep in args.script else (shutil.which(args.script) or args.script)
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ConfigError("script", args.script, "not an executable file (--no-python)")
        return program, list(args.script_args)
    if args.module:
        return sys.executable, ["-u", "-m", args.script, *args.script_args]
    if not os.path.isfile(args.script):
        raise ConfigError("script", args.script, "no such file")
    if args.run_path:  # torchrun wants an absolute path here; make it one
        return sys.executable, ["-u", "-c", RUN_PATH_CODE, os.path.abspath(args.script), *args.script_args]
    return sys.executable, ["-u", args.script, *args.script_args]


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
    min_nodes: int | None
    max_nodes: int | None
    master_addr: str | None
    master_port: int | None
    if static is not None:
        url, min_nodes, max_nodes = "", static.nnodes, static.nnodes
        master_addr, master_port = static.master_addr, static.master_port
    else:
        url, min_nodes, max_nodes = _elastic_url(args, mode, url_arg)
        master_addr, master_port = _check_elastic_master(args, url), args.master_port
    program, program_args = _worker_command(args)

    return LaunchConfig(
        url=url,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=args.nproc_per_node,
        program=program,
        program_args=program_args,
        standalone=mode == "standalone",
        role=args.role,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
        local_addr=args.local_addr,
        static=static,
        master_addr=master_addr,
        master_port=master_port,
        start_method=args.start_method,
        shutdown_timeout=_shutdown_timeout(args, environ),
        exit_barrier_timeout=args.exit_barrier_timeout,
    )


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


def _query_value(url: str, key: str) -> str | None:
    """The last value of query ``key`` (or an alias of it) in ``url``, or ``None``."""
    found = None
    for k, v in urllib.parse.parse_qsl(url.partition("?")[2], keep_blank_values=True):
        if QUERY_ALIASES.get(k, k) == key:
            found = v
    return found


def _query_has(url: str, keys: Sequence[str]) -> bool:
    query = url.partition("?")[2]
    present = {QUERY_ALIASES.get(k, k) for k, _ in urllib.parse.parse_qsl(query, keep_blank_values=True)}
    return any(k in present for k in keys)


#: Options that name the rendezvous (both spellings); :func:`strip_rdzv_options` removes them.
RDZV_OPTIONS = frozenset({
    "--rdzv", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id",
})
_FLAGS = frozenset({
    "--standalone", "--module", "-m", "--no-python", "--no_python", "--run-path", "--run_path", "-h", "--help",
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
