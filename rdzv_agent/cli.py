"""``rdzv-run`` arguments: torchrun's habits, one rendezvous URL.

::

    rdzv-run [--nnodes MIN[:MAX]] [--nproc-per-node N]
             (--rdzv URL | --rdzv-backend NAME --rdzv-endpoint HOST:PORT --rdzv-id ID | --standalone)
             [--rdzv-conf k=v,...] [--max-restarts N] [--monitor-interval S] [--role NAME]
             [--log-dir DIR] [--redirects V] [--tee V] [-m | --no-python] [--local-addr A]
             [--log-level L] SCRIPT [ARGS...]

Every option with a dash also has torchrun's underscore spelling
(``--nproc_per_node``). The URL may also come from the environment variable
``RDZV_URL`` (keeps a password off the command line and out of ``ps``).

:func:`build_config` turns the arguments into a :class:`LaunchConfig`: the final
rendezvous URL (``--nnodes`` and ``--rdzv-conf`` merged into its query,
overriding the same keys there) and the worker command.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from rdzv_core.errors import ConfigError
from rdzv_core.url import QUERY_ALIASES

from .api import DEFAULT_ROLE
from .streams import Std, parse_std

__all__ = [
    "LaunchConfig", "build_parser", "parse_args", "build_config", "merge_query", "strip_rdzv_options", "URL_ENV",
]

#: Environment variable that may hold the rendezvous URL (instead of ``--rdzv``).
URL_ENV = "RDZV_URL"

DEFAULT_MONITOR_INTERVAL = 0.5


@dataclass
class LaunchConfig:
    """Everything the launcher needs, validated.

    Attributes:
        url: the rendezvous URL to open (may hold a password: never print it).
        min_nodes, max_nodes: from ``--nnodes`` (``None`` when the URL decides).
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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _std(option: str):  # type: ignore[no-untyped-def]
    def convert(text: str) -> Std | dict[int, Std]:
        try:
            return parse_std(option, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.reason) from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    """The ``rdzv-run`` argument parser."""
    p = argparse.ArgumentParser(
        prog="rdzv-run",
        description="Launch elastic PyTorch workers on this node (torchrun's options, any rdzv backend).",
        allow_abbrev=False,
    )

    def opt(*names: str, **kwargs: Any) -> None:
        spellings = list(names)
        for name in names:
            if name.startswith("--") and "-" in name[2:]:
                spellings.append("--" + name[2:].replace("-", "_"))
        p.add_argument(*spellings, **kwargs)

    opt("--nnodes", type=_nnodes, default=None, metavar="MIN[:MAX]",
        help="nodes in the job: a number or MIN:MAX for an elastic job (default: the URL's, else 1:1)")
    opt("--nproc-per-node", type=_nproc, default=1, metavar="N", help="workers on this node (default 1)")
    opt("--rdzv", default=None, metavar="URL",
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
    opt("--local-addr", default=None, metavar="ADDR", help="address to publish as MASTER_ADDR (default: FQDN)")
    opt("--log-level", default=None, metavar="LEVEL", help="launcher log level (default: env LOGLEVEL or WARNING)")
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
            raise ConfigError("rdzv_conf", item, "expected KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def build_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> LaunchConfig:
    """Validate the parsed arguments and build the :class:`LaunchConfig`.

    Raises:
        ConfigError: conflicting or missing options (names the option and value).
    """
    environ = dict(os.environ if environ is None else environ)
    url_arg = args.rdzv or None
    parts = [args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id]
    modes = [name for name, used in (("--standalone", args.standalone), ("--rdzv", url_arg is not None),
                                     ("--rdzv-backend", any(x is not None for x in parts))) if used]
    if len(modes) > 1:
        raise ConfigError("rendezvous", " and ".join(modes), "give only one of --rdzv, --rdzv-backend/"
                          "--rdzv-endpoint/--rdzv-id and --standalone")
    if not modes and environ.get(URL_ENV):
        url_arg, modes = environ[URL_ENV], ["--rdzv"]
    if not modes:
        raise ConfigError("rendezvous", None, f"give --rdzv URL (or env {URL_ENV}), --rdzv-backend/"
                          "--rdzv-endpoint/--rdzv-id, or --standalone")

    min_nodes, max_nodes = args.nnodes if args.nnodes is not None else (None, None)
    standalone = bool(args.standalone)
    if standalone:
        if args.nnodes is not None and args.nnodes != (1, 1):
            raise ConfigError("nnodes", f"{args.nnodes[0]}:{args.nnodes[1]}", "--standalone runs one node")
        url = "file://{standalone_dir}/standalone-" + uuid.uuid4().hex[:12]
        min_nodes = max_nodes = 1
    elif modes == ["--rdzv"]:
        url = str(url_arg)
    else:
        for name, value in zip(("rdzv_backend", "rdzv_endpoint", "rdzv_id"), parts, strict=True):
            if not value:
                raise ConfigError(name, value, "--rdzv-backend, --rdzv-endpoint and --rdzv-id go together")
        url = f"{args.rdzv_backend}://{args.rdzv_endpoint.rstrip('/')}/{args.rdzv_id}"

    url = merge_query(url, _rdzv_conf(args.rdzv_conf))
    if min_nodes is not None:
        url = merge_query(url, {"min_nodes": str(min_nodes), "max_nodes": str(max_nodes)})
    elif not _query_has(url, ("min_nodes", "max_nodes")):
        url = merge_query(url, {"min_nodes": "1", "max_nodes": "1"})  # torchrun's default --nnodes 1:1

    if args.module and args.no_python:
        raise ConfigError("module", True, "-m and --no-python cannot be combined")
    if args.no_python:
        program = args.script if os.sep in args.script else (shutil.which(args.script) or args.script)
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ConfigError("script", args.script, "not an executable file (--no-python)")
        program_args = list(args.script_args)
    elif args.module:
        program, program_args = sys.executable, ["-u", "-m", args.script, *args.script_args]
    else:
        if not os.path.isfile(args.script):
            raise ConfigError("script", args.script, "no such file")
        program, program_args = sys.executable, ["-u", args.script, *args.script_args]

    return LaunchConfig(
        url=url,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=args.nproc_per_node,
        program=program,
        program_args=program_args,
        standalone=standalone,
        role=args.role,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
        local_addr=args.local_addr,
    )


def _query_has(url: str, keys: Sequence[str]) -> bool:
    query = url.partition("?")[2]
    present = {QUERY_ALIASES.get(k, k) for k, _ in urllib.parse.parse_qsl(query, keep_blank_values=True)}
    return any(k in present for k in keys)


#: Options that name the rendezvous (both spellings); :func:`strip_rdzv_options` removes them.
RDZV_OPTIONS = frozenset({
    "--rdzv", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id",
})
_FLAGS = frozenset({"--standalone", "--module", "-m", "--no-python", "--no_python", "-h", "--help"})


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
