"""The two rendezvous scenarios, run on a target's :class:`~benchmarks.harness.LazyPool`, and their records.

``latency``
    N agents with ``min_nodes = max_nodes = N`` start together; the time until
    every agent's ``next_rendezvous`` returned (and, for rdzv, until every agent
    held its rank). Repeated; a target that times out at some N is not run at
    larger N (recorded as ``skipped``).
``rerendezvous``
    N agents with ``min_nodes = N - 1``, ``max_nodes = N`` form a round; then one
    agent crashes (its client is closed: its keep-alive stops, its key stays until
    the TTL) and the N - 1 survivors call ``next_rendezvous`` again, as agents do
    once their workers fail. Measured: from the crash until every survivor holds
    its new rank. The new round has N - 1 = ``min_nodes`` members, so it includes
    one ``last_call_timeout``.
``steady``
    N agents with ``min_nodes = max_nodes = N`` form a round, then hold it for a
    given number of seconds with their keep-alives running (nothing else calls the
    backend but the monitor below). Judged, not hoped: a monitor in one worker
    watches the round's ``alive/`` keys for ``DELETE`` events and, every
    :data:`STEADY_CHECK_INTERVAL` seconds, lists them, reads the round record and
    calls one agent's ``num_nodes_waiting()``; at the end every agent reports its
    ``KeepAlive.lapsed``, recreations and ``num_nodes_waiting()``, and the largest
    gap between two refreshes of its key (the refresh lateness, timed on its
    counting proxy). The cell is ``ok`` when no key lapsed or was deleted, no
    ``lapsed`` event was set, the record stayed the same final round and nobody
    was told to re-rendezvous.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from .counting import READ_OPS, WRITE_OPS
from .harness import CellTimeout, LazyPool, WorkerPool, check_ranks

__all__ = ["Plan", "run_latency", "run_rerendezvous", "run_steady", "summarise_counts", "SMALL_N",
           "STEADY_CHECK_INTERVAL"]

#: N up to this is "small": it always gets ``Plan.min_reps`` repetitions.
SMALL_N = 64
#: Seconds between the steady monitor's checks (list ``alive/``, read the record, ``num_nodes_waiting``).
STEADY_CHECK_INTERVAL = 1.0
#: Seconds after a steady hold for the workers' reports (each agent's final ``num_nodes_waiting``).
STEADY_REPORT_GRACE = 120.0


class Plan:
    """What one mode runs (sizes, repetitions, limits); see :mod:`benchmarks.run` for the values.

    Attributes:
        sizes: N values (ints, ascending).
        reps: N -> repetitions wanted (at least :attr:`min_reps` are made unless a rep fails).
        min_reps: repetitions always made at N <= :data:`SMALL_N` (at least 3 there,
            as the brief asks); larger N always get one.
        rep_budget: seconds; past those minimums, stop repeating a cell once its
            repetitions so far took longer than this (recorded in the cell's ``note``).
        limit: per-cell time limit of one round (seconds), for every N not in :attr:`limits`.
        limits: N -> a different limit (seconds) for that N.
        keep_alive_ttl, last_call_timeout: rendezvous parameters (seconds).
        rerdzv_sizes, rerdzv_reps: the re-rendezvous scenario's N values and repetitions.
    """

    def __init__(self, *, sizes: list[int], reps: dict[int, int], min_reps: int, rep_budget: float, limit: float,
                 keep_alive_ttl: float, last_call_timeout: float, rerdzv_sizes: list[int],
                 rerdzv_reps: dict[int, int], limits: dict[int, float] | None = None) -> None:
        self.sizes, self.reps, self.min_reps, self.rep_budget = sizes, reps, min_reps, rep_budget
        self.limit, self.keep_alive_ttl, self.last_call_timeout = limit, keep_alive_ttl, last_call_timeout
        self.limits = dict(limits or {})
        self.rerdzv_sizes, self.rerdzv_reps = rerdzv_sizes, rerdzv_reps

    def limit_for(self, n: int) -> float:
        """The time limit (seconds) of one round with ``n`` agents."""
        return self.limits.get(n, self.limit)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


# -- counting ---------------------------------------------------------------------------------
def summarise_counts(agents: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-agent means of the :class:`~benchmarks.counting.CountingKV` counts of one round.

    Returns ``None`` for PyTorch agents (no proxy), else per phase (``round``,
    ``bootstrap``, ``keepalive``): ``reads``, ``writes``, ``conflicts`` (lost
    compare-and-swap/compare-and-delete/create), ``not_found`` and ``ops`` (mean
    calls per operation); plus ``round_writes_max``: the most writes any one agent
    made in ``next_round``.
    """
    counted = [a["counts"] for a in agents if "counts" in a]
    if not counted:
        return None
    n = len(counted)
    out: dict[str, Any] = {}
    for phase in ("round", "bootstrap", "keepalive"):
        ops: dict[str, float] = {}
        for counts in counted:
            for op, k in counts.get(phase, {}).items():
                ops[op] = ops.get(op, 0.0) + k
        ops = {op: round(k / n, 3) for op, k in sorted(ops.items())}
        out[phase] = {
            "reads": round(sum(ops.get(op, 0.0) for op in READ_OPS), 3),
            "writes": round(sum(ops.get(op, 0.0) for op in WRITE_OPS), 3),
            "conflicts": round(sum(v for op, v in ops.items() if op.startswith("conflict:")), 3),
            "not_found": round(sum(v for op, v in ops.items() if op.startswith("not_found:")), 3),
            "ops": ops,
        }
    out["round_writes_max"] = max(sum(c.get("round", {}).get(op, 0) for op in WRITE_OPS) for c in counted)
    return out


def _per_agent(server: dict[str, float] | None, n: int) -> dict[str, float] | None:
    if server is None:
        return None
    out = {k: round(v / n, 2) for k, v in server.items()}
    out["total"] = round(sum(server.values()) / n, 2)
    return out


def _record(t_from: float, agents: list[dict[str, Any]], world: int, server: dict[str, float] | None,
            tally: dict[str, Any], server_cpu: float | None = None) -> dict[str, Any]:
    finished = [a for a in agents if "t_done" in a and "error" not in a]
    problem = check_ranks(agents, world)
    rec: dict[str, Any] = {
        "n_agents": len(agents),
        "finished": len(finished),
        "ranks_ok": problem is None,
        "problem": problem,
        "latency_s": round(max(a["t_done"] for a in agents) - t_from, 4) if problem is None else None,
        "rank_s": round(max(a["t_rank"] for a in agents) - t_from, 4) if problem is None else None,
        "agent_median_s": round(statistics.median(a["t_done"] - t_from for a in finished), 4) if finished else None,
        "counts_per_agent": summarise_counts(agents),
        "server_requests_per_agent": _per_agent(server, len(agents)),
        "server_cpu_s": None if server_cpu is None else round(server_cpu, 3),
        "client_cpu_s": round(sum(a.get("worker_cpu_s", 0.0) for a in agents), 3),  # the worker processes'
        "agent_errors": _errors(agents),
        "log": tally,
    }
    return rec


def _errors(agents: list[dict[str, Any]]) -> dict[str, int]:
    """How many agents ended with each error (``"message @ where it was raised"``); unfinished ones excluded."""
    out: dict[str, int] = {}
    for a in agents:
        if "error" in a and not a.get("unfinished"):
            key = f"{a['error'][:160]} @ {a.get('where', '?')}"
            out[key] = out.get(key, 0) + 1
    return out


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


# -- latency ---------------------------------------------------------------------------------------
def run_latency(name: str, pools: LazyPool, servers: Any, plan: Plan,
                say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The latency cells of one target (one per N of ``plan.sizes``).

    A target is not run at an N after it failed or timed out at a smaller N. A
    PyTorch baseline is also not run when it grew at least linearly between the
    last two sizes and its median at the previous N, scaled linearly to this N,
    already exceeds this N's limit (the cell gets ``predicted_s``, a conservative
    estimate given that trend); rdzv backends are always measured. Such cells are
    ``skipped`` with the reason in ``note``.
    """
    cells: list[dict[str, Any]] = []
    stop_reason: str | None = None
    prev: dict[str, Any] | None = None
    prev2: dict[str, Any] | None = None
    for n in plan.sizes:
        cell: dict[str, Any] = {"target": name, "n": n, "reps": [], "status": "ok"}
        cells.append(cell)
        if stop_reason is None and name.startswith("torch:") and _superlinear(prev2, prev):
            predicted = prev["median_s"] * n / prev["n"]
            if predicted > plan.limit_for(n):
                cell["predicted_s"] = round(predicted, 1)
                stop_reason = (f"linear extrapolation from N={prev['n']} ({prev['median_s']:.1f} s x {n // prev['n']})"
                               f" = {predicted:.0f} s exceeds the {plan.limit_for(n):.0f} s limit")
        if stop_reason is not None:
            cell.update(status="skipped", note=stop_reason)
            say(f"  {name:14s} N={n:5d}  skipped: {stop_reason}")
            continue
        prev2, prev = prev, cell
        started = time.monotonic()
        wanted = plan.reps.get(n, 1)
        while len(cell["reps"]) < wanted:
            floor = plan.min_reps if n <= SMALL_N else 1
            if len(cell["reps"]) >= floor and time.monotonic() - started > plan.rep_budget:
                cell["note"] = (f"{len(cell['reps'])} of {wanted} repetitions: the cell's "
                                f"{plan.rep_budget:.0f} s repetition budget was spent")
                break
            rec = _latency_round(pools.get(), name, n, servers, plan)
            cell["reps"].append(rec)
            status = rec.get("status", "ok")
            say(f"  {name:14s} N={n:5d}  rep {len(cell['reps'])}: " + (
                f"{rec['latency_s']:.3f} s (rank {rec['rank_s']:.3f} s)" if rec["ranks_ok"]
                else f"{status}: {rec['problem']}"))
            if not rec["ranks_ok"]:
                cell["status"] = status
                stop_reason = f"{status} at N={n}"
                pools.kill()  # its agents may still be running
                break
        ok = [r for r in cell["reps"] if r["ranks_ok"]]
        cell["median_s"] = _median([r["latency_s"] for r in ok]) if cell["status"] == "ok" else None
        cell["median_rank_s"] = _median([r["rank_s"] for r in ok]) if cell["status"] == "ok" else None
        cell["min_s"] = min((r["latency_s"] for r in ok), default=None)
        cell["max_s"] = max((r["latency_s"] for r in ok), default=None)
    return cells


def _superlinear(older: dict[str, Any] | None, newer: dict[str, Any] | None) -> bool:
    """Whether the median grew at least in proportion to N from ``older`` to ``newer`` (both measured)."""
    if older is None or newer is None or not older.get("median_s") or not newer.get("median_s"):
        return False
    return newer["median_s"] / older["median_s"] >= newer["n"] / older["n"]


def _latency_round(pool: WorkerPool, name: str, n: int, servers: Any, plan: Plan) -> dict[str, Any]:
    limit = plan.limit_for(n)
    try:
        t_setup = time.monotonic()
        pool.setup(n, min_nodes=n, max_nodes=n, timeout=limit, last_call_timeout=plan.last_call_timeout,
                   keep_alive_ttl=plan.keep_alive_ttl)
        t_setup = time.monotonic() - t_setup
        before, cpu = servers.request_counts(name), servers.cpu_seconds(name)
        t0, agents, tally = pool.round(limit)
    except CellTimeout as exc:
        return {"ranks_ok": False, "status": "timeout", "problem": str(exc), "latency_s": None, "rank_s": None,
                "n_agents": n, "finished": None, "counts_per_agent": None, "server_requests_per_agent": None,
                "limit_s": limit}
    cpu_after = servers.cpu_seconds(name)
    server = servers.diff(before, servers.request_counts(name))
    rec = _record(t0, agents, n, server, tally, None if cpu is None or cpu_after is None else cpu_after - cpu)
    rec["setup_s"] = round(t_setup, 3)  # building the agents (handlers, clients): not timed
    if not rec["ranks_ok"]:
        rec["status"] = "timeout" if any(a.get("unfinished") for a in agents) else "error"
        rec["limit_s"] = limit
    else:
        t_clean = time.monotonic()
        pool.cleanup()
        rec["cleanup_s"] = round(time.monotonic() - t_clean, 3)
    return rec


# -- re-rendezvous ---------------------------------------------------------------------------------
def run_rerendezvous(name: str, pools: LazyPool, servers: Any, plan: Plan,
                     say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The re-rendezvous cells of one rdzv target (one per N of ``plan.rerdzv_sizes``)."""
    cells: list[dict[str, Any]] = []
    for n in plan.rerdzv_sizes:
        cell: dict[str, Any] = {"target": name, "n": n, "reps": [], "status": "ok",
                                "keep_alive_ttl": plan.keep_alive_ttl,
                                "last_call_timeout": plan.last_call_timeout}
        cells.append(cell)
        started = time.monotonic()
        wanted = plan.rerdzv_reps.get(n, 1)
        while len(cell["reps"]) < wanted:
            if cell["reps"] and time.monotonic() - started > plan.rep_budget:
                cell["note"] = f"{len(cell['reps'])} of {wanted} repetitions (repetition budget spent)"
                break
            rec = _rerdzv_round(pools.get(), name, n, servers, plan)
            cell["reps"].append(rec)
            say(f"  {name:14s} N={n:5d}  re-rendezvous rep {len(cell['reps'])}: " + (
                f"{rec['latency_s']:.3f} s after the kill" if rec["ranks_ok"] else f"failed: {rec['problem']}"))
            if not rec["ranks_ok"]:
                cell["status"] = rec.get("status", "error")
                pools.kill()
                break
        ok = [r for r in cell["reps"] if r["ranks_ok"]]
        cell["median_s"] = _median([r["latency_s"] for r in ok]) if cell["status"] == "ok" else None
        if cell["status"] != "ok":
            break
    return cells


def _rerdzv_round(pool: WorkerPool, name: str, n: int, servers: Any, plan: Plan) -> dict[str, Any]:
    failed = {"ranks_ok": False, "latency_s": None, "rank_s": None, "counts_per_agent": None}
    try:
        limit = plan.limit_for(n)
        pool.setup(n, min_nodes=n - 1, max_nodes=n, timeout=limit, last_call_timeout=plan.last_call_timeout,
                   keep_alive_ttl=plan.keep_alive_ttl, victim=True)
        t0, agents, tally = pool.round(limit)
        problem = check_ranks(agents, n)
        if problem is not None:
            status = "timeout" if any(a.get("unfinished") for a in agents) else "error"
            return {**failed, "status": status, "problem": f"first round: {problem}",
                    "agent_errors": _errors(agents), "log": tally, "limit_s": limit}
        first = max(a["t_done"] for a in agents) - t0
        t_kill = pool.kill_victim()
        before, cpu = servers.request_counts(name), servers.cpu_seconds(name)
        _, agents, tally = pool.round(limit, who="survivors")
    except CellTimeout as exc:
        return {**failed, "status": "timeout", "problem": str(exc)}
    cpu_after = servers.cpu_seconds(name)
    server = servers.diff(before, servers.request_counts(name))
    rec = _record(t_kill, agents, n - 1, server, tally,
                  None if cpu is None or cpu_after is None else cpu_after - cpu)
    rec["first_round_s"] = round(first, 4)
    if rec["ranks_ok"]:
        pool.cleanup()
    else:
        rec["status"] = "timeout" if any(a.get("unfinished") for a in agents) else "error"
    return rec


# -- steady state ------------------------------------------------------------------------------------
def run_steady(name: str, pools: LazyPool, servers: Any, plan: Plan, n: int, seconds: float,
               say: Callable[[str], None]) -> dict[str, Any]:
    """The steady cell of one rdzv target: ``n`` agents hold one round for ``seconds`` seconds.

    Returns the cell: ``status`` (``ok``; ``evicted`` when a key lapsed, the record
    changed or an agent was told to re-rendezvous; ``timeout``/``error`` when the
    round did not form or a worker failed), the counts behind it and the refresh
    lateness (``refresh_gap_max_s``: the longest time any key went unrefreshed, in
    seconds; a key lapses once that reaches ``keep_alive_ttl``).
    """
    cell: dict[str, Any] = {"target": name, "n": n, "seconds": seconds, "keep_alive_ttl": plan.keep_alive_ttl,
                            "check_interval_s": STEADY_CHECK_INTERVAL}
    pool = pools.get()
    limit = plan.limit_for(n)
    try:
        pool.setup(n, min_nodes=n, max_nodes=n, timeout=limit, last_call_timeout=plan.last_call_timeout,
                   keep_alive_ttl=plan.keep_alive_ttl)
        t0, agents, _ = pool.round(limit)
        problem = check_ranks(agents, n)
        if problem is not None:
            pools.kill()
            cell.update(status="timeout" if any(a.get("unfinished") for a in agents) else "error",
                        problem=f"the round did not form: {problem}")
            say(f"  {name:14s} N={n:5d}  steady: {cell['status']}: {cell['problem']}")
            return cell
        cell["formation_s"] = round(max(a["t_done"] for a in agents) - t0, 3)
        say(f"  {name:14s} N={n:5d}  steady: round formed in {cell['formation_s']:.2f} s; holding {seconds:g} s")
        before, cpu = servers.request_counts(name), servers.cpu_seconds(name)
        reports = pool.call([("steady", seconds, i == 0, STEADY_CHECK_INTERVAL) for i in range(pool.procs)],
                            "held", seconds + STEADY_REPORT_GRACE)
    except (CellTimeout, RuntimeError) as exc:
        pools.kill()
        cell.update(status="error", problem=str(exc)[:2000])
        say(f"  {name:14s} N={n:5d}  steady: error: {cell['problem'][:300]}")
        return cell
    cpu_after = servers.cpu_seconds(name)
    server = servers.diff(before, servers.request_counts(name))
    cell.update(_steady_summary(reports, n, seconds))
    cell["server_requests_per_agent_s"] = (None if server is None else
                                           round(sum(server.values()) / n / max(seconds, 1e-9), 3))
    cell["server_cpu_s"] = None if cpu is None or cpu_after is None else round(cpu_after - cpu, 3)
    pool.cleanup()
    say(f"  {name:14s} N={n:5d}  steady: {cell['status']}: {cell['alive_deletes']} key deletions, "
        f"{cell['lapsed_events']} lapsed events, {cell['record_changes']} record changes, "
        f"num_nodes_waiting max {cell['num_nodes_waiting_max']}, refresh gap max {cell['refresh_gap_max_s']:.2f} s")
    return cell


def _steady_summary(reports: list[dict[str, Any]], n: int, seconds: float) -> dict[str, Any]:
    """One steady cell's verdict and counts from the workers' ``held`` reports (worker 0 monitored)."""
    mon = reports[0]["monitor"]
    total = {k: sum(r[k] for r in reports) for k in ("lapsed_events", "recreated", "keepalives_not_running",
                                                    "agents_told_to_rejoin", "num_nodes_waiting_errors",
                                                    "refreshes", "agents")}
    ops: dict[str, int] = {}
    for r in reports:
        for op, k in r["keepalive_ops"].items():
            ops[op] = ops.get(op, 0) + k
    log: dict[str, int] = {}
    for r in reports:
        for key, k in r["log"]["counts"].items():
            log[key] = log.get(key, 0) + k
    out: dict[str, Any] = {
        "alive_deletes": mon["alive_deletes"], "alive_keys_at_start": mon["alive_keys_at_start"],
        "alive_keys_min": mon["alive_keys_min"], "record_changes": mon["record_changes"],
        "num_nodes_waiting_max": mon["num_nodes_waiting_max"], "monitor_checks": mon["checks"],
        "monitor_errors": mon["errors"], "deleted_examples": mon["deleted_examples"],
        "watch_compacted": mon["watch_compacted"], **total,
        "refresh_gap_max_s": max(r["refresh_gap_max_s"] for r in reports),
        "refresh_gaps_worst_s": sorted(g for r in reports for g in r["refresh_gaps_s"])[-5:],
        "refreshes_per_agent_s": round(total["refreshes"] / n / max(seconds, 1e-9), 3),
        "keepalive_ops": ops, "threads_per_worker": [r["threads"] for r in reports],
        "held_s": max(r["held_s"] for r in reports), "log": log,
    }
    evicted = (out["alive_deletes"] or out["alive_keys_min"] != n or out["alive_keys_at_start"] != n
               or out["record_changes"] or out["num_nodes_waiting_max"] or out["lapsed_events"]
               or out["recreated"] or out["keepalives_not_running"] or out["agents_told_to_rejoin"])
    incomplete = out["monitor_errors"] or out["num_nodes_waiting_errors"] or out["agents"] != n
    out["status"] = "evicted" if evicted else "error" if incomplete else "ok"
    return out
