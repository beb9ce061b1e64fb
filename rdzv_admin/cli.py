"""``rdzv`` — the operator's command: inspect, close, reset and check rendezvous runs.

::

    rdzv backends [--json]            installed schemes, providing distribution, default port, capabilities
    rdzv status URL [--json]          round version, state, participants, waiting count, closed,
                                      version counter, the nodes' progress (stragglers, hung nodes),
                                      and a verdict (below); --watch refreshes it
    rdzv close URL [--yes]            close the run (no new rounds)
    rdzv reset URL [--yes]            delete every key of the run (state, rounds, stores)
    rdzv check URL [--json]           connect, run a short protocol self-test, report latency
    rdzv runs URL [--json]            every run under the URL's prefix: state, members, age
    rdzv nodes URL [--json]           the node ledger: each node's state, offences, quarantines, why;
                                      --forgive NODE [--yes] clears a node's offences and quarantine

Exit codes (:data:`EXIT_CODES`), the same for every command, so that a monitoring
probe can use ``rdzv status``: 0 healthy / done; 1 unhealthy or not done (status:
``degraded`` (also: a hung node), ``corrupt`` or ``absent``; a failed check; a refused confirmation);
2 bad usage (a bad option or URL, ``--forgive`` of a node not in the ledger); 3 the backend is unreachable or
did not answer.
``status --json`` carries the same verdict in ``"verdict"`` (also when unreachable).
Errors are one line on stderr saying what to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Any, Sequence

from rdzv_core.errors import (
    BackendUnavailableError,
    ConfigError,
    CorruptEntryError,
    KeyNotFoundError,
    RdzvError,
    RendezvousStateError,
)
from rdzv_core.kv import KVBackend, parse_counter
from rdzv_core.labels import incarnation_of
from rdzv_core.plugins import list_backends, parse_backend_url
from rdzv_core.rendezvous import Rendezvous, RendezvousParams, RunKeys, Status, has_state, progress_keys

from . import nodes_view, progress_view, runs_view
from .self_check import cmd_check

__all__ = ["main", "EXIT_CODES", "VERDICT_EXIT"]

#: Exit code -> meaning, for every ``rdzv`` command.
EXIT_CODES = {0: "healthy / done", 1: "unhealthy (degraded, corrupt, absent) or not done",
              2: "bad usage (option, URL)", 3: "backend unreachable"}

#: ``rdzv status``'s verdict -> its exit code. ``degraded``: a member of the current round has no live
#: keep-alive key, or is hung (no progress within its hang timeout); ``corrupt``: stored state a round
#: cannot use (``rdzv reset`` clears it); ``absent``: nothing stored for the run (not started, reset,
#: or a mistyped URL or run id).
VERDICT_EXIT = {"healthy": 0, "degraded": 1, "corrupt": 1, "absent": 1, "unreachable": 3}

#: How many incarnations after the last one with state ``rdzv status`` looks at for a later one (a requeued job's).
LATEST_PROBES = 8


def _open(url: str, latest: bool = False) -> tuple[KVBackend, Rendezvous]:
    """The backend and the run of ``url``: its incarnation is the URL's ``incarnation``, else the scheduler's
    restart counter in this environment (as a node's: :func:`rdzv_core.labels.incarnation_of`), else 0 -- or,
    with ``latest``, the latest incarnation with state (a job requeued N times runs in incarnation N): counting up
    from 0 while the next one, or one of the :data:`LATEST_PROBES` after it, has state.

    Raises:
        InvalidURLError, UnknownBackendError, ConfigError: a bad URL, or a bad ``SLURM_RESTART_COUNT``.
        BackendUnavailableError: the backend cannot be reached.
    """
    info, parsed = parse_backend_url(url)
    incarnation, source = incarnation_of(parsed.params)
    # the URL's keep_alive_ttl dates keep-alive refreshes
    params = RendezvousParams.from_query({**parsed.params, "incarnation": incarnation})
    kv = info.spec.open(parsed)
    if latest and source == "default":
        try:
            probe, misses = 1, 0
            while misses < LATEST_PROBES:
                if has_state(kv, RunKeys(params.prefix, parsed.run_id, probe)):
                    incarnation, misses = probe, 0
                else:
                    misses += 1
                probe += 1
        except BaseException:
            kv.close()
            raise
        params = dataclasses.replace(params, incarnation=incarnation)
    return kv, Rendezvous(kv, parsed.run_id, params)


def _run_name(rdzv: Rendezvous) -> str:
    """``run RUN_ID``, with ``(incarnation N)`` when N is not 0."""
    return f"run {rdzv.run_id}" + (f" (incarnation {rdzv.incarnation})" if rdzv.incarnation else "")


def _confirm(args: argparse.Namespace, what: str) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print(f"rdzv: refusing to {what} without --yes (no terminal to ask)", file=sys.stderr)
        return False
    return input(f"{what}? [y/N] ").strip().lower() in ("y", "yes")


def cmd_backends(args: argparse.Namespace) -> int:
    """The installed backends. ``multi_host`` is whether agents on many hosts can meet through it;
    ``server_endpoints`` how many servers its URL may name (the backend's
    :attr:`~rdzv_core.plugins.BackendSpec.server_endpoints`; Redis: one; ``None`` if not said)."""
    rows = {s: {"distribution": b.distribution, "name": b.spec.name, "default_port": b.spec.default_port,
                "server_endpoints": b.spec.server_endpoints, **b.spec.capabilities.as_dict()}
            for s, b in list_backends().items()}
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0

    def yes(flag: object) -> str:
        return "yes" if flag else "no"

    table = [["scheme", "backend", "distribution", "port", "agents on many hosts", "server endpoints", "server_ttl",
              "watch", "tls"]]
    for scheme, r in rows.items():
        port = "-" if r["default_port"] is None else str(r["default_port"])
        table.append([scheme, str(r["name"]), str(r["distribution"]), port, yes(r["multi_host"]),
                      str(r["server_endpoints"] or "?"), yes(r["server_side_ttl"]), yes(r["native_watch"]),
                      yes(r["tls"])])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]  # columns as wide as their longest
    for row in table:
        print(" ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


#: Hint printed (stderr, one line) when ``rdzv status`` finds a problem that only a reset clears.
RESET_HINT = "to start the run afresh: rdzv reset <the same URL>"


def cmd_status(args: argparse.Namespace) -> int:
    """Show the run's round record, members and version counter, and a verdict (:data:`VERDICT_EXIT`).

    The run's incarnation: the URL's, else the scheduler's restart counter here, else the latest one with state
    (:func:`_open`), so that a probe outside a requeued job follows the job.

    ``corrupt`` (with a one-line hint to ``rdzv reset``) when the counter
    ``ROOT/counter/version`` is corrupt (not ASCII decimal) or lower than the round
    record's version (the next round would then reuse the keys of an old one), or the
    round record cannot be read; ``degraded`` when a member of a frozen or final round
    has no live keep-alive key, or a member is hung (:mod:`rdzv_admin.progress_view`);
    ``absent`` when nothing is stored for the run. Nodes the ledger keeps out (quarantined, unhealthy) are listed
    (``kept_out``: :func:`rdzv_admin.nodes_view.kept_out`) and do not change the verdict. ``--watch``: again every
    ``--interval`` seconds (in place on a terminal) until interrupted or ``--count`` views were shown;
    the exit code is the last view's.
    """
    shown_views = 0
    while True:
        code = _status_once(args, clear=args.watch and sys.stdout.isatty())
        shown_views += 1
        if not args.watch or (args.count is not None and shown_views >= args.count):
            return code
        try:
            sys.stdout.flush()
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return code


def _status_once(args: argparse.Namespace, clear: bool = False) -> int:
    """One view of ``rdzv status`` (see :func:`cmd_status`); returns its exit code."""
    try:
        kv, rdzv = _open(args.url, latest=True)
        with kv:
            state = rdzv.describe()
            state["counter"], shown, problem = _version_counter(kv, rdzv, state)
            for member in state.get("alive", []):
                _keep_alive_age(kv, rdzv.params.keep_alive_ttl, member)
            if state.get("status") in (Status.FROZEN.value, Status.FINAL.value):
                records = progress_keys.read(kv, rdzv.keys, int(state["version"]), state.get("id"))
                state["progress"] = progress_view.analyse(
                    records, state.get("alive", []), state.get("participants"), args.hang_timeout,
                    args.straggler_steps, args.straggler_seconds)
            state["kept_out"], ledger_warnings = nodes_view.kept_out(rdzv.ledger)  # no effect on the verdict
    except (BackendUnavailableError, RendezvousStateError, CorruptEntryError) as exc:
        if args.json:  # a probe reading --json gets the verdict too; main() prints the error line
            verdict = "unreachable" if isinstance(exc, BackendUnavailableError) else "corrupt"
            print(json.dumps({"verdict": verdict, "error": f"{type(exc).__name__}: {exc}"},
                             indent=None if args.watch else 2))
        raise
    state["problems"] = [problem] if problem else []
    state["warnings"], degraded = _status_warnings(state)
    state["warnings"] += ledger_warnings
    hung = state.get("progress", {}).get("summary", {}).get("hung", [])
    if hung:
        state["warnings"].append(f"rank(s) {hung[:20]} of round {state.get('version')} are hung: no progress "
                                 f"within their hang timeout")
    absent = state.get("status") == "absent" and state.get("counter") is None
    state["verdict"] = "corrupt" if problem else "degraded" if degraded or hung else "absent" if absent else "healthy"
    if args.json:
        print(json.dumps(state, indent=None if args.watch else 2, default=str))
    else:
        if clear:
            print("\x1b[H\x1b[2J", end="")
        rows = _row_limit(args, clear)
        _print_status(state, shown, rows, rows if args.limit is not None or clear else None)
    if problem:
        print(f"rdzv: {problem}; {RESET_HINT}", file=sys.stderr)
    return VERDICT_EXIT[state["verdict"]]


def _row_limit(args: argparse.Namespace, in_place: bool) -> int:
    """Progress rows to show: ``--limit``, else (in place) what fits the terminal, else 20."""
    if args.limit is not None:
        return int(args.limit)
    return max(5, shutil.get_terminal_size().lines - 16) if in_place else 20


def _version_counter(
    kv: KVBackend, rdzv: Rendezvous, state: dict[str, Any]
) -> tuple[int | None, str, str | None]:
    """The run's version counter: ``(value or None, as shown, what is wrong with it or None)``.

    ``Rendezvous`` numbers rounds with ``add`` on ``ROOT/counter/version`` (see
    :mod:`rdzv_core.rendezvous`), so the counter is never below the version in the
    round record; when it is (lost or rewritten), or is not a counter at all, the
    next round would fail or reuse an old round's keys.
    """
    key = rdzv.keys.version_counter
    try:
        entry = kv.get(key)
        counter = None if entry is None else parse_counter(key, entry.value)
    except CorruptEntryError as exc:
        return None, "corrupt", f"the version counter is corrupt: {exc}"
    shown = "absent" if counter is None else str(counter)
    version = state.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > (counter or 0):
        return counter, shown, (f"the version counter at {key!r} ({shown}) is behind the round record's version "
                                f"{version}: the next round would reuse an old round's keys")
    return counter, shown, None


def _keep_alive_age(kv: KVBackend, keep_alive_ttl: float, member: dict[str, Any]) -> None:
    """Add ``ttl_left`` (seconds until the member's keep-alive key expires) and
    ``keep_alive_age`` (seconds since it was last refreshed: ``keep_alive_ttl - ttl_left``,
    with the URL's ``keep_alive_ttl``) to ``member``; ``None`` where the backend cannot
    tell, and ``ttl_left = 0`` if the key lapsed since it was listed."""
    member["ttl_left"] = member["keep_alive_age"] = None
    if "corrupt" in member:
        return
    try:
        left = kv.ttl_remaining(member["key"])
    except NotImplementedError:
        return
    except KeyNotFoundError:
        left = 0.0
    if left is not None:
        member["ttl_left"] = round(left, 3)
        member["keep_alive_age"] = round(max(0.0, keep_alive_ttl - left), 3)


def _status_warnings(state: dict[str, Any]) -> tuple[list[str], bool]:
    """``rdzv status``'s warnings and whether the round is degraded: ranks of a frozen or final round
    without a live keep-alive key (degraded), or a run with no state at all (``([], False)`` if neither).

    Degraded even if transient (a member that stalled writes its key again; one that died does not,
    and a node waiting to join then destroys the round, see ``rdzv_core.rendezvous``): a probe asks
    again later.
    """
    if state.get("status") == "absent" and state.get("counter") is None:
        return ["nothing is stored for this run id at this URL: not started yet, reset, or a mistyped "
                "URL or run id"], False
    world = state.get("participants")
    if state.get("status") not in (Status.FROZEN.value, Status.FINAL.value) or not isinstance(world, int):
        return [], False
    ranks = {m.get("rank") for m in state.get("alive", []) if "corrupt" not in m}
    missing = [r for r in range(world) if r not in ranks]
    if not missing:
        return [], False
    if len(missing) == world:
        return [f"no member of round {state.get('version')} has a live keep-alive key: every node left or "
                f"died"], True
    return [f"rank(s) {missing[:20]} of round {state.get('version')} have no live keep-alive key: those nodes "
            f"died, left or stalled (a stalled one writes its key again; a node waiting to join destroys the "
            f"round)"], True


def _print_status(state: dict[str, Any], counter: str, limit: int = 20, members_limit: int | None = None) -> None:
    print(f"{'run id':<13} {state['run_id']}")
    print(f"{'incarnation':<13} {state.get('incarnation', 0)}")
    print(f"{'state':<13} {state['status']}")
    for key in ("version", "participants", "joined", "waiting"):
        if key in state:
            print(f"{key:<13} {state[key]}")
    print(f"{'counter':<13} {counter}")
    print(f"{'verdict':<13} {state['verdict']}")
    for problem in state["problems"]:
        print(f"{'PROBLEM':<13} {problem}")
    for warning in state["warnings"]:
        print(f"{'WARNING':<13} {warning}")
    for line in nodes_view.render_kept_out(state.get("kept_out", []), limit):
        print(line)
    if "progress" in state:
        for line in progress_view.render(state["progress"], limit):
            print(line)
    now = time.time()
    members = state.get("alive", [])
    shown_members = len(members) if members_limit is None else members_limit
    for member in members[:shown_members]:
        if "corrupt" in member:
            print(f"  {member['key']}: not a keep-alive record: {member['corrupt']}")
            continue
        since = member.get("since")
        age = f", member for {max(0.0, now - since):.0f} s" if isinstance(since, (int, float)) else ""
        left, kage = member.get("ttl_left"), member.get("keep_alive_age")
        if isinstance(member.get("finished"), (int, float)):
            alive = f"finished {max(0.0, now - member['finished']):.0f} s ago (left the round, work done)"
        elif left is None:
            alive = "keep-alive live (the backend does not report its age)"
        elif left <= 0:
            alive = "keep-alive LAPSED"
        else:
            alive = f"keep-alive refreshed {kage:.1f} s ago, expires in {left:.1f} s"
        name = member.get("name")  # the node's name in the ledger, where it is not the host's
        named = f" node {name}," if name and name != member.get("host") else ""
        print(f"  rank {member.get('rank')}:{named} {member.get('host')} ({member.get('node')}){age}; {alive}")
    if len(members) > shown_members:
        print(f"  ... {len(members) - shown_members} more member(s)")


def cmd_close(args: argparse.Namespace) -> int:
    kv, rdzv = _open(args.url)
    with kv:
        if not _confirm(args, f"close {_run_name(rdzv)}"):
            return 1
        rdzv.set_closed()
    print("closed")
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    """Delete every key of the run. Members with a live keep-alive are named first (in the question,
    or on stderr with ``--yes``): their agents will see their round gone and re-rendezvous."""
    kv, rdzv = _open(args.url)
    with kv:
        live = _live_members(kv, rdzv)
        what = f"delete all state of {_run_name(rdzv)}"
        if live:
            what += (f" while {len(live)} member(s) are live ({', '.join(live[:5])}"
                     f"{', ...' if len(live) > 5 else ''}; their agents will re-rendezvous)")
            if args.yes:
                print(f"rdzv: warning: {what}", file=sys.stderr)
        if not _confirm(args, what):
            return 1
        deleted = _delete_tree(kv, rdzv.keys.tree)
    print(f"deleted {deleted} keys")
    return 0


def _live_members(kv: KVBackend, rdzv: Rendezvous) -> list[str]:
    """``"rank R on HOST"`` for every live keep-alive key of the run's current round (``[]`` if none
    or if the round record cannot be read: a reset is how corrupt state is cleared)."""
    try:
        state = rdzv.describe()
    except (RendezvousStateError, CorruptEntryError):
        return []
    return [f"rank {m.get('rank')} on {m.get('host')}" for m in state.get("alive", []) if "corrupt" not in m]


def _delete_tree(kv: KVBackend, prefix: str) -> int:
    """Delete every key under ``prefix``, corrupt ones included; return how many.

    A key holding data the protocol did not write makes ``list`` raise
    :class:`CorruptEntryError` naming it: that key is deleted and the listing repeated
    (at most once per key found so, then the error is passed on).
    """
    deleted, corrupt = 0, set()
    while True:
        try:
            entries, _ = kv.list(prefix)
        except CorruptEntryError as exc:
            if exc.key is None or not exc.key.startswith(prefix) or exc.key in corrupt:
                raise
            corrupt.add(exc.key)
            kv.delete(exc.key)
            deleted += 1
            continue
        for entry in entries:
            kv.delete(entry.key)
        return deleted + len(entries)


def cmd_runs(args: argparse.Namespace) -> int:
    """Every run under the URL's prefix (:mod:`rdzv_admin.runs_view`); ``--json``: as a list of objects."""
    info, parsed = parse_backend_url(args.url, require_run_id=False)
    params = RendezvousParams.from_query(parsed.params)
    with info.spec.open(parsed) as kv:
        rows = runs_view.list_runs(kv, params)
    print(json.dumps(rows, indent=2) if args.json else "\n".join(runs_view.render(rows)))
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    """The run's node ledger (:mod:`rdzv_admin.nodes_view`), of the same incarnation as ``rdzv status``'s;
    ``--forgive NODE``: clear its offences and end its quarantine (asks first, unless ``--yes``)."""
    kv, rdzv = _open(args.url, latest=True)
    with kv:
        ledger = rdzv.ledger
        if ledger.scope == "prefix":
            return nodes_view.command(ledger, f"the runs under prefix {rdzv.keys.prefix!r} (ledger_scope=prefix)",
                                      args.forgive, args.json, lambda q: _confirm(args, q))
        shared = nodes_view.shared_count(ledger)
        if shared:  # the jobs under this prefix may keep their nodes in the shared ledger: say where to look
            print(f"rdzv: {shared} node(s) in the ledger shared by the runs under prefix {rdzv.keys.prefix!r}: add "
                  "?ledger_scope=prefix to the URL to see them", file=sys.stderr)
        return nodes_view.command(ledger, _run_name(rdzv), args.forgive, args.json, lambda q: _confirm(args, q))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdzv", description="Inspect and manage rdzv rendezvous runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list installed backends")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_backends)
    commands = (("status", cmd_status, "show a run's round"), ("check", cmd_check, "self-test a backend"),
                ("runs", cmd_runs, "list the runs under a prefix"), ("nodes", cmd_nodes, "list a run's node ledger"))
    for name, fn, helptext in commands:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("url")
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=fn)
        if name == "status":
            _status_options(p)
        if name == "nodes":
            p.add_argument("--forgive", metavar="NODE", help="clear NODE's offences and end its quarantine")
            p.add_argument("--yes", action="store_true", help="with --forgive: do not ask for confirmation")
    for name, fn, helptext in (("close", cmd_close, "close a run"), ("reset", cmd_reset, "delete a run's state")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("url")
        p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        p.set_defaults(fn=fn)
    return parser


def _positive(kind: type, allow_zero: bool = False) -> Any:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value >= 0 if allow_zero else value > 0) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text!r}")
        return value

    return convert


def _status_options(p: argparse.ArgumentParser) -> None:
    """``rdzv status``'s progress and ``--watch`` options (:mod:`rdzv_admin.progress_view`)."""
    p.add_argument("--hang-timeout", type=_positive(float), default=None, metavar="S",
                   help="a node whose slowest worker reported no progress for S seconds is hung (verdict degraded; "
                        "default: the --hang-timeout its agent runs with, else no hang check)")
    p.add_argument("--straggler-steps", type=_positive(int, allow_zero=True),
                   default=progress_view.DEFAULT_STRAGGLER_STEPS, metavar="K",
                   help=f"a node more than K steps behind the median step is a straggler "
                        f"(default {progress_view.DEFAULT_STRAGGLER_STEPS})")
    p.add_argument("--straggler-seconds", type=_positive(float, allow_zero=True),
                   default=progress_view.DEFAULT_STRAGGLER_SECONDS, metavar="T",
                   help=f"a node whose last report is more than T seconds older than the median node's is a "
                        f"straggler (default {progress_view.DEFAULT_STRAGGLER_SECONDS:g})")
    p.add_argument("--watch", action="store_true",
                   help="show the status again every --interval seconds, in place on a terminal (with --json: one "
                        "JSON object per line per view), until Ctrl-C")
    p.add_argument("--interval", type=_positive(float), default=2.0, metavar="S",
                   help="seconds between views of --watch (default 2)")
    p.add_argument("--count", type=_positive(int), default=None, metavar="N",
                   help="with --watch: stop after N views")
    p.add_argument("--limit", type=_positive(int, allow_zero=True), default=None, metavar="N",
                   help="nodes listed at most, worst first (default 20; in place: what fits the terminal)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rdzv`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        code = int(args.fn(args))
        if sys.stdout is None:  # started with stdout closed (`rdzv status URL >&-`): print() wrote nothing
            print("rdzv: standard output is closed: the command's output was lost", file=sys.stderr)
            return max(code, 1)
        sys.stdout.flush()  # here, so a reader that left is caught below, not at interpreter exit
        return code
    except ConfigError as exc:
        print(f"rdzv: {exc}", file=sys.stderr)
        return 2
    except (RendezvousStateError, CorruptEntryError) as exc:
        # a key of the run can be reset; bad backend bookkeeping (key None) names its own remedy
        hint = " (to start the run afresh: rdzv reset <the same URL>)" if exc.key is not None else ""
        print(f"rdzv: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return 1
    except BackendUnavailableError as exc:
        hint = "" if "running there?" in str(exc) else " (is the server running and the URL right?)"  # once
        print(f"rdzv: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return 3
    except RdzvError as exc:
        print(f"rdzv: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `rdzv status URL | head`: the reader left; exit as a shell tool does (SIGPIPE)
        # Python's recipe: point stdout at devnull so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
