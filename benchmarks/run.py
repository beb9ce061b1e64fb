"""``python -m benchmarks.run [--smoke | --quick] [options]`` — the whole benchmark in one command.

Runs, against servers it starts itself on free loopback ports:

1. rendezvous latency of rdzv's backends and of PyTorch's handlers (``c10d``,
   ``etcd-v2``, legacy ``etcd``) at each N, with request counts;
2. re-rendezvous after a killed agent (rdzv backends);
3. c10d Store throughput (``KVStore`` on each backend, ``TCPStore`` baseline).

``--steady SECONDS`` runs only the steady scenario instead: on each rdzv target,
``--steady-n`` agents (default 1024) form a round and hold it SECONDS seconds with
their keep-alives running, watched for false evictions (see
:func:`benchmarks.scenarios.run_steady`). It is not part of the default run (the
issue's check is 5 minutes per backend); its results go to a temporary directory
(or ``--out-dir``), never ``docs/``.

Writes ``benchmarks.json`` and ``benchmarks.png`` into ``--out-dir`` (default:
``docs/`` for the full run, a fresh temporary directory for ``--quick`` and
``--smoke``) and, when that is ``docs/``, rewrites the results section of
``docs/benchmarks.md`` (between ``<!-- results:start -->`` and ``<!-- results:end -->``).

Exit status: 0 when every measured cell produced correct ranks or a recorded
timeout; 1 when an rdzv cell gave wrong ranks or failed (with ``--steady``: when
a cell is not ``ok``: a key lapsed, the round changed, or it could not be judged).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from typing import Any, Callable

from . import report
from .harness import LazyPool
from .scenarios import Plan, run_latency, run_rerendezvous, run_steady
from .servers import Servers
from .throughput import measure_store

__all__ = ["main", "MODES"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RESULTS_START, RESULTS_END = "<!-- results:start -->", "<!-- results:end -->"

#: Per mode: the plan, the targets, and the throughput settings.
MODES: dict[str, dict[str, Any]] = {
    "smoke": {
        "plan": dict(sizes=[8], reps={8: 1}, min_reps=1, rep_budget=10.0, limit=60.0,
                     rerdzv_sizes=[8], rerdzv_reps={8: 1}),
        "baselines": ["torch:c10d"],
        "throughput": {"clients": [1], "duration": 0.25},
    },
    "quick": {
        "plan": dict(sizes=[8, 64, 256], reps={8: 3, 64: 3, 256: 2}, min_reps=3, rep_budget=15.0, limit=60.0,
                     rerdzv_sizes=[256], rerdzv_reps={256: 1}),
        "baselines": ["torch:c10d", "torch:etcd-v2", "torch:etcd"],
        "throughput": {"clients": [1, 8], "duration": 0.5},
    },
    "full": {
        # 90 s per cell: the slowest baseline that completes at N=256 (PyTorch's legacy etcd handler)
        # needs about 60 s here. At N=1024, 30 s: six times the loosest 1,024-agent target (5 s).
        "plan": dict(sizes=[8, 64, 256, 1024], reps={8: 3, 64: 3, 256: 3, 1024: 3}, min_reps=3, rep_budget=20.0,
                     limit=90.0, limits={1024: 30.0}, rerdzv_sizes=[256], rerdzv_reps={256: 3}),
        "baselines": ["torch:c10d", "torch:etcd-v2", "torch:etcd"],
        "throughput": {"clients": [1, 8], "duration": 1.0},
    },
}
RDZV_TARGETS = ["memory", "file", "redis", "etcd-v2", "etcd-v3"]
#: The client mode used unless ``--client-mode`` says otherwise: a client shared by
#: every agent thread of a process, except Redis (redis-py's pool caps one client at
#: 100 connections; see docs/benchmarks.md).
AUTO_CLIENT_MODE: dict[str, str] = {}  # every backend shares one client per process


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="N=8, one repetition, c10d baseline only (< 60 s)")
    mode.add_argument("--quick", action="store_true", help="N up to 256, fewer repetitions (~4 minutes)")
    p.add_argument("--out-dir", help="where benchmarks.json/.png go (default: docs/ for the full run of the whole "
                                     "plan; a temp dir with --targets/--sizes or --quick/--smoke)")
    p.add_argument("--targets", help="comma-separated subset of: " + ",".join(RDZV_TARGETS)
                   + ",torch:c10d,torch:etcd-v2,torch:etcd")
    p.add_argument("--sizes", help="comma-separated N values (overrides the mode's)")
    p.add_argument("--cell-limit", type=float,
                   help="seconds one round may take before it counts as a timeout (every N; default: the mode's)")
    p.add_argument("--procs", type=int, default=2, help="worker processes per target (default 2 = cores here)")
    p.add_argument("--client-mode", choices=("auto", "shared", "per-agent"), default="auto",
                   help="rdzv backend clients: one per process (shared), one per agent, or auto "
                        "(= shared for every backend)")
    p.add_argument("--keep-alive-ttl", type=float, default=5.0, help="rendezvous keep-alive TTL, s (default 5)")
    p.add_argument("--last-call-timeout", type=float, default=1.0,
                   help="last call, s (default 1; matters only for the re-rendezvous scenario)")
    p.add_argument("--no-rerendezvous", action="store_true", help="skip the re-rendezvous scenario")
    p.add_argument("--no-throughput", action="store_true", help="skip the Store throughput measurement")
    p.add_argument("--steady", type=float, metavar="SECONDS",
                   help="run only the steady scenario: --steady-n agents hold one round SECONDS seconds with "
                        "their keep-alives running, watched for false evictions (rdzv targets; not in the default run)")
    p.add_argument("--steady-n", type=int, default=1024, help="agents in the steady scenario (default 1024)")
    p.add_argument("--render", metavar="JSON",
                   help="measure nothing: redo the target verdicts, tables and plot of an earlier run's JSON "
                        "(next to it; and docs/benchmarks.md when the JSON is docs/benchmarks.json)")
    args = p.parse_args(argv)
    if args.procs < 1:
        p.error(f"--procs must be >= 1, got {args.procs}")
    if args.steady is not None and not args.steady > 0:
        p.error(f"--steady must be a positive number of seconds, got {args.steady}")
    if args.steady_n < 2:
        p.error(f"--steady-n must be >= 2, got {args.steady_n}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.render:
        return _render(args.render)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    spec = MODES[mode]
    plan_kw = dict(spec["plan"])
    if args.sizes:
        plan_kw["sizes"] = sorted(int(s) for s in args.sizes.split(","))
    if args.cell_limit:
        plan_kw["limit"] = args.cell_limit
        plan_kw["limits"] = {}
    plan = Plan(keep_alive_ttl=args.keep_alive_ttl, last_call_timeout=args.last_call_timeout, **plan_kw)
    if args.steady is not None:
        return _steady(args, argv, plan)
    targets = args.targets.split(",") if args.targets else RDZV_TARGETS + spec["baselines"]
    unknown = [t for t in targets if t not in RDZV_TARGETS and t not in report.BASELINES]
    if unknown:
        print(f"unknown target(s) {unknown}; choose from {RDZV_TARGETS + list(report.BASELINES)}", file=sys.stderr)
        return 2
    recorded = mode == "full" and not (args.targets or args.sizes)  # only the whole plan replaces docs/
    out_dir = args.out_dir or (DOCS if recorded else tempfile.mkdtemp(prefix=f"rdzv-bench-{mode}-"))
    os.makedirs(out_dir, exist_ok=True)
    client_modes = {t: (AUTO_CLIENT_MODE.get(t, "shared") if args.client_mode == "auto" else args.client_mode)
                    for t in targets if t in RDZV_TARGETS}

    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {text}", flush=True)

    # The TCPStore server this process hosts logs a C++ warning per client whose host name
    # it cannot look up; they would drown the progress lines (set before torch is imported).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch

    results: dict[str, Any] = {
        "command": "python -m benchmarks.run" + ("" if not argv else " " + shlex.join(argv)),
        "mode": mode,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "config": {"procs": args.procs, "client_modes": client_modes, "plan": plan.as_dict(), "targets": targets},
        "code": _git_state(),
        "latency": [],
        "rerendezvous": [],
    }
    store_targets = [t for t in targets if t in RDZV_TARGETS] + ["tcpstore"]
    servers = Servers(targets + ([] if args.no_throughput else store_targets))
    try:
        results["servers"] = servers.versions()
        say(f"benchmark ({mode}): targets {targets}, N {plan.sizes}; writing to {out_dir}")
        tp = spec["throughput"]
        if not args.no_throughput:
            results["throughput"] = {"clients": tp["clients"], "duration_s": tp["duration"], "results": {}}
        # The c10d baseline's workers also measure the TCPStore (the same server); without it, a pool of its own.
        tcp_host = "torch:c10d" if "torch:c10d" in targets else "tcpstore"
        for target in targets + ([] if args.no_throughput or tcp_host != "tcpstore" else ["tcpstore"]):
            pools = LazyPool(_target_spec(target, servers, client_modes.get(target)),
                             1 if target == "memory" else args.procs)
            try:
                if target != "tcpstore":
                    say(f"latency: {target}")
                    results["latency"] += run_latency(target, pools, servers, plan, say)
                if target in RDZV_TARGETS and not args.no_rerendezvous:
                    say(f"re-rendezvous: {target}")
                    results["rerendezvous"] += run_rerendezvous(target, pools, servers, plan, say)
                store = "tcpstore" if target == tcp_host else target
                if store in store_targets and not args.no_throughput:
                    say(f"store throughput: {store}")
                    row = measure_store(pools, tp["clients"], tp["duration"])
                    results["throughput"]["results"][store] = row
                    say("  " + json.dumps(row))
            finally:
                pools.close()
    finally:
        servers.stop()
    json_path = _finish(results, started, out_dir, report.evaluate_targets)
    print(_write_reports(results, out_dir), flush=True)
    say(f"wrote {json_path} ({results['duration_s']:.0f} s)")
    bad = [c for c in results["latency"] + results["rerendezvous"]
           if c["target"] in RDZV_TARGETS and c["status"] == "error"]
    return 1 if bad else 0


def _steady(args: argparse.Namespace, argv: list[str], plan: Plan) -> int:
    """``--steady SECONDS``: the steady scenario on each rdzv target; JSON and a table in a temp/out dir."""
    targets = args.targets.split(",") if args.targets else list(RDZV_TARGETS)
    unknown = [t for t in targets if t not in RDZV_TARGETS]
    if unknown:
        print(f"--steady runs rdzv targets only; unknown or not rdzv: {unknown}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="rdzv-bench-steady-")
    os.makedirs(out_dir, exist_ok=True)
    client_modes = {t: (AUTO_CLIENT_MODE.get(t, "shared") if args.client_mode == "auto" else args.client_mode)
                    for t in targets}
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {text}", flush=True)

    results: dict[str, Any] = {
        "command": "python -m benchmarks.run " + shlex.join(argv),
        "mode": "steady",
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()), "platform": platform.platform(),
                    "python": platform.python_version()},
        "config": {"procs": args.procs, "client_modes": client_modes, "plan": plan.as_dict(), "targets": targets,
                   "steady_s": args.steady, "steady_n": args.steady_n},
        "code": _git_state(),
        "steady": [],
    }
    servers = Servers(targets)
    try:
        results["servers"] = servers.versions()
        say(f"steady: targets {targets}, N {args.steady_n}, {args.steady:g} s each; writing to {out_dir}")
        for target in targets:
            procs = 1 if target == "memory" else args.procs
            pools = LazyPool(_target_spec(target, servers, client_modes[target]), procs)
            try:
                results["steady"].append(run_steady(target, pools, servers, plan, args.steady_n, args.steady, say))
            finally:
                pools.close()
    finally:
        servers.stop()
    json_path = _finish(results, started, out_dir, lambda r: report.steady_targets(r["steady"]))
    table = report.steady_markdown(results)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    print(table, flush=True)
    say(f"wrote {json_path} ({results['duration_s']:.0f} s)")
    return 0 if all(c["status"] == "ok" for c in results["steady"]) else 1


def _finish(results: dict[str, Any], started: float, out_dir: str,
            verdicts: Callable[[dict[str, Any]], Any]) -> str:
    """Record the end load, duration and target verdicts; write ``out_dir/benchmarks.json``; return its path."""
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    results["duration_s"] = round(time.monotonic() - started, 1)
    results["targets"] = verdicts(results)
    json_path = os.path.join(out_dir, "benchmarks.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    return json_path


def _git_state() -> dict[str, Any]:
    """The commit the measured code is at, and whether rdzv_core/rdzv_backends differ from it (read-only git)."""
    import subprocess

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "library_changes": git("status", "--porcelain", "--", "rdzv_core", "rdzv_backends").splitlines()}


def _write_reports(results: dict[str, Any], out_dir: str) -> str:
    """Write the plot and the Markdown tables of ``results`` for ``out_dir``; return the tables."""
    table = report.markdown(results)
    try:
        report.plot(results, os.path.join(out_dir, "benchmarks.png"))
    except ImportError:
        print("matplotlib is not installed (pip install 'rdzv[bench]'): no plot", file=sys.stderr)
    if os.path.realpath(out_dir) == os.path.realpath(DOCS):
        _update_docs(table)
    else:
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(table)
    return table


def _render(json_path: str) -> int:
    """``--render``: the reports of an earlier run, from its JSON (its measurements and command unchanged)."""
    with open(json_path) as f:
        results = json.load(f)
    for key in ("reps", "limits"):  # JSON turned the int keys of these maps into strings
        results["config"]["plan"][key] = {int(k): v for k, v in results["config"]["plan"].get(key, {}).items()}
    for key in ("rerdzv_reps",):
        results["config"]["plan"][key] = {int(k): v for k, v in results["config"]["plan"].get(key, {}).items()}
    results["targets"] = report.evaluate_targets(results)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(_write_reports(results, os.path.dirname(os.path.abspath(json_path))))
    return 0


def _target_spec(target: str, servers: Servers, client_mode: str | None) -> dict[str, Any]:
    """What a worker needs to know about ``target`` (picklable)."""
    if target == "tcpstore":
        return {"kind": "tcpstore", "name": target, "endpoint": servers.endpoint(target)}
    if target.startswith("torch:"):
        return {"kind": "torch", "name": target, "torch_backend": target.split(":", 1)[1],
                "endpoint": servers.endpoint(target)}
    return {"kind": "rdzv", "name": target, "url": servers.rdzv_url(target, f"bench-{os.getpid()}"),
            "client_mode": client_mode, "prefix": "bench/store/"}


def _update_docs(table: str) -> None:
    path = os.path.join(DOCS, "benchmarks.md")
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = f"# Benchmarks\n\n{RESULTS_START}\n{RESULTS_END}\n"
    if RESULTS_START not in text or RESULTS_END not in text:
        text += f"\n{RESULTS_START}\n{RESULTS_END}\n"
    head, rest = text.split(RESULTS_START, 1)
    _, tail = rest.split(RESULTS_END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{RESULTS_START}\n{table}{RESULTS_END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
