"""The launch *target* of ``rdzv-run``'s options (:mod:`rdzv_agent.launch.config` builds the rest): the mode
(elastic URL, torchrun's static rendezvous, standalone), the rendezvous URL built from ``--rdzv`` or
``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id`` (checked and quoted, so none of them can add a query key
or another path segment) with ``--rdzv-conf``, ``--nnodes`` and a ``--node-rank`` request set in its query,
and the static rendezvous's node rank and master address.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Union

from rdzv_core.errors import ConfigError, InvalidURLError
from rdzv_core.plugins import parse_backend_url
from rdzv_core.torch_api.torchrun import checked_run_id, endpoint_url
from rdzv_core.url import RendezvousURL, parse_netloc, parse_node_labels, redact_text

from .args import (
    STATIC_BACKEND,
    STATIC_DEFAULT_ADDR,
    STATIC_DEFAULT_PORT,
    STATIC_DEFAULT_RUN_ID,
    STATIC_DEFAULT_TIMEOUT,
    URL_ENV,
    _rdzv_conf,
)

__all__ = ["LaunchTarget", "StaticRendezvous", "Standalone", "backend_url", "env_source", "as_given", "mode_of",
           "static_of", "elastic_url", "rank_request", "check_elastic_master"]



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


def env_source(args: argparse.Namespace, option: str) -> str | None:
    """The ``PET_*`` variable that gave ``option``'s value (``"--nnodes"`` -> ``"PET_NNODES"``), else ``None``."""
    dest = {"-m": "module", "-r": "redirects", "-t": "tee"}.get(option, option.lstrip("-").replace("-", "_"))
    from_env: dict[str, str] = getattr(args, "from_env", {})
    return from_env.get(dest) if option.startswith("-") else None


def as_given(args: argparse.Namespace, option: str) -> str:
    """``option``, or the ``PET_*`` variable its value came from (for messages)."""
    return env_source(args, option) or option


def mode_of(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str | None]:
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
        shown = [as_given(args, backend_opts[0] if m == "--rdzv-backend" else m) for m in modes]
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


def static_of(args: argparse.Namespace) -> StaticRendezvous | None:
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
    run_id = _run_id(args.rdzv_id if args.rdzv_id is not None else STATIC_DEFAULT_RUN_ID)
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


def elastic_url(args: argparse.Namespace, mode: str, url_arg: str | None) -> RendezvousURL:
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
        run_id = _run_id(run_id)
        _, url = parse_backend_url(RendezvousURL("file", (), "", run_id))
        nnodes: tuple[int, int] | None = (1, 1)
    elif mode == "url":
        _, url = parse_backend_url(str(url_arg))
        nnodes = args.nnodes
    else:
        for name, value in zip(("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"),
                               (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id), strict=True):
            if value == "":
                raise ConfigError(name, value, "empty")
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
    flag = as_given(args, "--nnodes")
    for key, wanted in (("min_nodes", lo), ("max_nodes", hi)):
        value = url.params.get(key)
        if value is not None and value != wanted:
            where = "--rdzv-conf" if url.key_name(key) in conf or key in conf else "the URL's query"
            raise ConfigError(flag, f"{lo}:{hi}", f"disagrees with {url.key_name(key)}={value} in {where}; "
                              "give the node counts once, or the same in both")
    return url.with_params({"min_nodes": lo, "max_nodes": hi}, replace=False)


def rank_request(args: argparse.Namespace, url: RendezvousURL) -> RendezvousURL:
    """``url`` with ``--node-rank`` (a rank request, elastic) and ``--node-labels`` as its query keys.

    Raises:
        ConfigError: ``--node-rank`` with ``rank_policy=join`` (join order only: nothing to request), or not
            below ``max_nodes``; ``--node-labels`` not ``KEY=VALUE[,KEY=VALUE...]``.
    """
    values: dict[str, Any] = {}
    if args.node_rank is not None:
        flag = as_given(args, "--node-rank")
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


def check_elastic_master(args: argparse.Namespace, url: RendezvousURL) -> str | None:
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


def backend_url(backend: str, endpoint: str, run_id: str) -> str:
    """``BACKEND://ENDPOINT/RUN_ID`` from ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``.

    See :func:`_backend_url` (the checks and the errors raised).
    """
    return _backend_url(backend, endpoint, run_id)[0]


def _backend_url(backend: str, endpoint: str, run_id: str) -> tuple[str, RendezvousURL]:
    """``BACKEND://ENDPOINT/RUN_ID`` from ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``, and it parsed.

    Built by torchrun's converter, :func:`rdzv_core.torch_api.torchrun.endpoint_url` (its rules: a scheme or
    ``rdzv-`` handler name, ``HOST[:PORT][,...]`` or a ``file`` directory, the run-id rule), without
    credentials (they go in a ``--rdzv`` URL or ``RDZV_URL``); the text has the directory's segments
    percent-quoted, so that parsing it gives back exactly that directory.

    Raises:
        ConfigError: naming ``--rdzv-backend``, ``--rdzv-endpoint`` or ``--rdzv-id`` and the value.
        UnknownBackendError: no installed backend has that name.
    """
    try:
        parsed = endpoint_url(backend, endpoint, run_id, credentials=False)
    except InvalidURLError as exc:
        raise _flag_error(exc, redact_text(endpoint)) from None
    quoted = dataclasses.replace(parsed, path="/".join(urllib.parse.quote(s, safe="") for s in parsed.path.split("/")))
    return quoted.redacted(), parsed


def _flag_error(exc: InvalidURLError, endpoint_shown: str) -> ConfigError:
    """:func:`~rdzv_core.torch_api.torchrun.endpoint_url`'s error as the error of the ``rdzv-run`` option it is
    about."""
    if exc.field in ("rdzv_backend", "rdzv_id"):
        return ConfigError("--" + exc.field.replace("_", "-"), exc.value, exc.reason)
    if exc.field == "rdzv_endpoint":
        return ConfigError("--rdzv-endpoint", endpoint_shown, exc.reason)
    return ConfigError("--rdzv-endpoint", endpoint_shown, f"{exc.field}: {exc.reason}")


def _run_id(run_id: str) -> str:
    """``--rdzv-id``'s value, checked by the one run-id rule (:func:`rdzv_core.torch_api.torchrun.checked_run_id`).

    Raises:
        ConfigError: naming ``--rdzv-id`` and the value.
    """
    try:
        return checked_run_id(run_id)
    except InvalidURLError as exc:
        raise _flag_error(exc, "") from None
