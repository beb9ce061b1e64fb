"""Turn the raw records into ratios, target verdicts, Markdown tables and the plot.

Ratios are ``baseline median / rdzv median`` (how many times faster rdzv is);
when the baseline timed out at that N the ratio is a lower bound,
``limit / rdzv median``, written ``>x``. Target verdicts carry the measured
value, the threshold and the margin (value - threshold; negative is better).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TARGETS_1024", "evaluate_targets", "markdown", "plot", "steady_targets", "steady_markdown"]

RDZV = ("memory", "file", "redis", "etcd-v2", "etcd-v3")
BASELINES = ("torch:c10d", "torch:etcd-v2", "torch:etcd")
#: The brief's latency targets at N = 1,024 (seconds).
TARGETS_1024 = {"etcd-v3": 2.0, "redis": 1.0, "memory": 1.0, "file": 5.0}
#: Baselines that use the same server as an rdzv backend.
SAME_SERVER = {"etcd-v2": ("torch:etcd-v2", "torch:etcd"), "etcd-v3": ("torch:etcd-v2", "torch:etcd")}
WRITES_TARGET = 4.0
SPEEDUP_TARGET = 10.0
RERDZV_SLACK = 2.0
#: The issue's steady-state target: no false eviction at N = 1,024 over 5 minutes (seconds).
STEADY_TARGET_N, STEADY_TARGET_S = 1024, 300.0


def _cell(results: dict[str, Any], target: str, n: int) -> dict[str, Any] | None:
    for cell in results["latency"]:
        if cell["target"] == target and cell["n"] == n:
            return cell
    return None


def _value(cell: dict[str, Any] | None) -> tuple[float | None, bool]:
    """``(seconds, is_lower_bound)`` of a cell: its median, or its limit if it timed out."""
    if cell is None:
        return None, False
    if cell["status"] == "ok":
        return cell.get("median_s"), False
    if cell["status"] == "timeout":
        limit = next((r.get("limit_s") for r in cell["reps"] if r.get("limit_s")), None)
        return limit, True
    if cell["status"] == "skipped" and cell.get("predicted_s"):
        return cell["predicted_s"], True
    return None, False


def ratio(results: dict[str, Any], ours: str, baseline: str, n: int) -> dict[str, Any] | None:
    """How many times faster ``ours`` is than ``baseline`` at ``n`` (``None`` if not measurable)."""
    mine, mine_bound = _value(_cell(results, ours, n))
    theirs, theirs_bound = _value(_cell(results, baseline, n))
    if mine is None or theirs is None or mine_bound or mine <= 0:
        return None
    return {"ratio": round(theirs / mine, 2), "lower_bound": theirs_bound}


def _fmt_ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    return (">" if r["lower_bound"] else "") + f"{r['ratio']:.1f}×"


def _fmt_s(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "–"
    if cell["status"] == "ok":
        return f"{cell['median_s']:.3f}"
    if cell["status"] == "timeout":
        value, _ = _value(cell)
        return f"timeout (>{value:.0f})" if value else "timeout"
    if cell["status"] == "skipped" and cell.get("predicted_s"):
        return f"skipped (≥{cell['predicted_s']:.0f} predicted)"
    return cell["status"]


# -- targets ----------------------------------------------------------------------------------------
def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the brief that this run measured, with ``met`` and ``margin``."""
    out: list[dict[str, Any]] = []
    sizes = results["config"]["plan"]["sizes"]
    for target, threshold in TARGETS_1024.items():
        cell = _cell(results, target, 1024)
        if cell is None or 1024 not in sizes:
            continue
        value, bound = _value(cell)
        out.append(_verdict(f"latency N=1024 {target}", value, threshold, bound, "s", cell["status"]))
    for target in RDZV:
        for n in sizes:
            cell = _cell(results, target, n)
            if cell is None or not cell["reps"]:
                continue
            rep = _typical_rep(cell)  # the same repetition the tables show
            if rep is not None and rep.get("ranks_ok") and rep.get("counts_per_agent"):
                value = rep["counts_per_agent"]["round"]["writes"]
                out.append(_verdict(f"writes/agent N={n} {target}", value, WRITES_TARGET, False, "writes", "ok"))
    if 256 in sizes:
        for target, baselines in SAME_SERVER.items():
            cands = [(b, ratio(results, target, b, 256)) for b in baselines]
            cands = [(b, r) for b, r in cands if r is not None]
            if not cands:
                continue
            # The fastest baseline is the one with the smallest ratio.
            b, r = min(cands, key=lambda c: c[1]["ratio"])
            v = _verdict(f"speed-up N=256 {target} vs fastest same-server baseline ({b})",
                         r["ratio"], SPEEDUP_TARGET, r["lower_bound"], "×", "ok", higher_is_better=True)
            out.append(v)
    for cell in results.get("rerendezvous", []):
        if cell["n"] != 256:
            continue
        limit = cell["keep_alive_ttl"] + RERDZV_SLACK
        value = cell.get("median_s")
        out.append(_verdict(f"re-rendezvous N=256 {cell['target']}", value, limit, False, "s", cell["status"]))
    return out


def _verdict(name: str, value: float | None, threshold: float, lower_bound: bool, unit: str, status: str,
             higher_is_better: bool = False) -> dict[str, Any]:
    if value is None:
        return {"target": name, "threshold": threshold, "unit": unit, "value": None, "met": False,
                "margin": None, "status": status}
    if higher_is_better:
        # A lower bound below the threshold decides nothing: the true value may be above it.
        met = True if value >= threshold else (None if lower_bound else False)
        margin = round(value - threshold, 3)
    else:
        met = value <= threshold and not lower_bound
        margin = round(value - threshold, 3)
    return {"target": name, "threshold": threshold, "unit": unit, "value": round(value, 4),
            "value_is_lower_bound": lower_bound, "met": met, "margin": margin, "status": status}


def steady_targets(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Verdicts of the steady cells: false evictions (lapsed or deleted keys, round changes,
    agents told to re-rendezvous) must be 0. A cell shorter than :data:`STEADY_TARGET_S` or with
    fewer than :data:`STEADY_TARGET_N` agents is judged too, but its name says it is not the
    issue's target."""
    out = []
    for cell in cells:
        full = cell["n"] >= STEADY_TARGET_N and cell["seconds"] >= STEADY_TARGET_S
        name = (f"no false eviction N={cell['n']} over {cell['seconds']:g} s {cell['target']}"
                + ("" if full else f" (the issue's target is N={STEADY_TARGET_N} over {STEADY_TARGET_S:g} s)"))
        if cell["status"] not in ("ok", "evicted"):
            out.append(_verdict(name, None, 0, False, "evictions", cell["status"]))
            continue
        # Each sign of an eviction counts: a deleted or lapsed key (one lapse shows as both: the larger),
        # a changed round record, an agent told to re-rendezvous.
        value = (max(cell["alive_deletes"], cell["lapsed_events"]) + cell["record_changes"]
                 + max(cell["agents_told_to_rejoin"], 1 if cell["num_nodes_waiting_max"] else 0))
        out.append(_verdict(name, value, 0, False, "evictions", cell["status"]))
    return out


def _run_line(results: dict[str, Any]) -> str:
    """``Run: <start> (<s>) at commit <sha>[ with local changes]; <n> CPUs; load average before .., after ..``."""
    code = results.get("code") or {}
    machine = results["machine"]
    return (f"Run: {results['started']} ({results['duration_s']:.0f} s) at commit {code.get('commit') or '?'}"
            + (" with local changes to the library" if code.get("library_changes") else "")
            + f"; {machine['cpus']} CPUs; load average before {_load(machine['loadavg_start'])}, "
            f"after {_load(machine['loadavg_end'])}")


def steady_markdown(results: dict[str, Any]) -> str:
    """The table of a ``--steady`` run (not part of ``docs/benchmarks.md``'s recorded results)."""
    lines = [
        f"Command: `{results['command']}`  ",
        _run_line(results) + ".",
        "",
        "### Steady keep-alives (one round held with every keep-alive running)",
        "",
        "Key deletions: `DELETE` events of the round's alive/ keys seen by a watch; lapsed: agents whose "
        "`KeepAlive.lapsed` was set; record changes: reads of the round record that differed from the "
        "final round; waiting max: the largest `num_nodes_waiting()` seen; refresh gap: the longest time a key "
        "went unrefreshed (s; it lapses at the TTL).",
        "",
        "| backend | N | held s | TTL s | status | key deletions | lapsed | recreated | record changes | "
        "waiting max | refresh gap max s | refreshes/agent/s | server req./agent/s | threads/worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["steady"]:
        if "alive_deletes" not in c:
            lines.append(f"| {c['target']} | {c['n']} | – | {c['keep_alive_ttl']} | {c['status']}: "
                         f"{c.get('problem', '')[:120]} |" + " |" * 9)
            continue
        srv = c.get("server_requests_per_agent_s")
        lines.append(
            f"| {c['target']} | {c['n']} | {c['held_s']:.0f} | {c['keep_alive_ttl']} | {c['status']} | "
            f"{c['alive_deletes']} | {c['lapsed_events']} | {c['recreated']} | {c['record_changes']} | "
            f"{c['num_nodes_waiting_max']} | {c['refresh_gap_max_s']:.2f} | {c['refreshes_per_agent_s']:.3f} | "
            f"{'–' if srv is None else f'{srv:.2f}'} | {', '.join(map(str, c['threads_per_worker']))} |")
    lines += ["", "### Targets", "", "| target | threshold | measured | verdict |", "|---|---|---|---|"]
    for t in results["targets"]:
        verdict = "met" if t["met"] else "**missed**"
        lines.append(f"| {t['target']} | {t['threshold']} {t['unit']} | {t['value']} | {verdict} |")
    return "\n".join(lines) + "\n"


# -- Markdown -----------------------------------------------------------------------------------------
def markdown(results: dict[str, Any]) -> str:
    """The results section of ``docs/benchmarks.md`` (tables only, regenerated by every run)."""
    cfg = results["config"]
    plan = cfg["plan"]
    sizes = plan["sizes"]
    lines = [
        f"Command: `{results['command']}`  ",
        _run_line(results) + f"; torch {results['machine']['torch']}; "
        f"servers {', '.join(f'{k} {v}' for k, v in results['servers'].items()) or 'none'}.  ",
        f"Agents: {cfg['procs']} worker processes (memory: 1), N/P threads each; rdzv client mode "
        f"{cfg['client_modes']}; keep-alive TTL {plan['keep_alive_ttl']} s; per-cell limit {plan['limit']:g} s"
        + "".join(f" (N={k}: {v:g} s)" for k, v in plan.get("limits", {}).items()) + ".",
        "",
        "### Rendezvous latency (median seconds until every agent's `next_rendezvous` returned)",
        "",
        "| target | " + " | ".join(f"N={n}" for n in sizes) + " | repetitions |",
        "|---|" + "---|" * len(sizes) + "---|",
    ]
    for target in RDZV + BASELINES:
        cells = [_cell(results, target, n) for n in sizes]
        if all(c is None for c in cells):
            continue
        reps = ", ".join(f"{c['n']}:{len(c['reps'])}" for c in cells if c is not None and c["reps"])
        lines.append(f"| {target} | " + " | ".join(_fmt_s(c) for c in cells) + f" | {reps} |")
    lines += [
        "",
        "### rdzv per backend and N: ratios to each baseline and backend requests per agent",
        "",
        "Ratio = baseline median / rdzv median (×, higher is better; `>` = the baseline timed out, "
        "so the ratio is at least that). Reads/writes/conflicts: mean per agent in `next_round` "
        "(CountingKV), `+b` = the MASTER_ADDR/PORT exchange after it; server = requests per agent "
        "the server counted (etcd metrics, Redis INFO commandstats) for the whole `next_rendezvous`.",
        "",
        "| backend | N | median s | rank held s | vs c10d | vs torch etcd-v2 | vs torch etcd | "
        "reads (+b) | writes (+b) | max writes | conflicts | server req. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for target in RDZV:
        for n in sizes:
            cell = _cell(results, target, n)
            if cell is None:
                continue
            rep = _typical_rep(cell)
            counts = rep.get("counts_per_agent") if rep else None
            server = rep.get("server_requests_per_agent") if rep else None
            rank = f"{cell['median_rank_s']:.3f}" if cell.get("median_rank_s") is not None else "–"
            if counts:
                r, b = counts["round"], counts["bootstrap"]
                reads = f"{r['reads']:.2f} (+{b['reads']:.2f})"
                writes = f"{r['writes']:.3f} (+{b['writes']:.3f})"
                maxw = str(counts["round_writes_max"])
                conflicts = f"{r['conflicts']:.2f}"
            else:
                reads = writes = maxw = conflicts = "–"
            srv = f"{server['total']:.1f}" if server else "–"
            lines.append(
                f"| {target} | {n} | {_fmt_s(cell)} | {rank} | "
                + " | ".join(_fmt_ratio(ratio(results, target, b, n)) for b in BASELINES)
                + f" | {reads} | {writes} | {maxw} | {conflicts} | {srv} |"
            )
    base_rows = [(t, n, _cell(results, t, n)) for t in BASELINES for n in sizes]
    if any(c is not None for _, _, c in base_rows):
        lines += ["", "### PyTorch baselines: server requests per agent", "",
                  "| baseline | N | median s | server requests per agent (by kind) |", "|---|---|---|---|"]
        for t, n, cell in base_rows:
            if cell is None:
                continue
            rep = _typical_rep(cell)
            server = rep.get("server_requests_per_agent") if rep else None
            detail = ", ".join(f"{k} {v}" for k, v in server.items()) if server else "– (TCPStore: no counters)" \
                if t == "torch:c10d" else "–"
            lines.append(f"| {t} | {n} | {_fmt_s(cell)} | {detail} |")
    if results.get("rerendezvous"):
        lines += ["", "### Re-rendezvous after a killed agent", "",
                  f"From the crash (victim's client closed) until all N-1 survivors hold new ranks; "
                  f"min_nodes = N-1, so the new round includes last_call_timeout = {plan['last_call_timeout']} s.",
                  "", "| backend | N | median s | repetitions | first round s | writes/agent | target (TTL+2 s) |",
                  "|---|---|---|---|---|---|---|"]
        for cell in results["rerendezvous"]:
            ok = [r for r in cell["reps"] if r.get("ranks_ok")]
            first = sorted(r["first_round_s"] for r in ok)[len(ok) // 2] if ok else None
            rep = _typical_rep(cell)
            writes = rep["counts_per_agent"]["round"]["writes"] if rep and rep.get("counts_per_agent") else None
            failed = next((r for r in cell["reps"] if not r.get("ranks_ok")), None)
            med = f"{cell['median_s']:.3f}" if cell.get("median_s") is not None else (
                f"{cell['status']}: {failed['problem']}" if failed else cell["status"])
            tgt = cell["keep_alive_ttl"] + RERDZV_SLACK
            verdict = "" if cell["n"] != 256 else " MISSED" if cell.get("median_s") is None else (
                " met" if cell["median_s"] <= tgt else " MISSED")
            lines.append(f"| {cell['target']} | {cell['n']} | {med} | {len(cell['reps'])} | "
                         f"{first if first is not None else '–'} | {writes if writes is not None else '–'} | "
                         f"{tgt:.1f} s{verdict} |")
    if results.get("throughput"):
        tp = results["throughput"]
        counts = tp["clients"]
        base = tp["results"].get("tcpstore", {})
        lines += ["", f"### Store throughput (operations per second, {tp['duration_s']} s per measurement; "
                  "in brackets: the ratio to TCPStore)", "",
                  "| store | " + " | ".join(f"{op} ×{c}" for c in counts for op in ("set", "get", "add")) + " |",
                  "|---|" + "---|" * (3 * len(counts))]
        for target, rows in tp["results"].items():
            if "error" in rows:
                lines.append(f"| {target} | error: {rows['error'][:80]} |")
                continue
            cells = []
            for c in counts:
                for op in ("set", "get", "add"):
                    value = rows[str(c)][op]
                    ref = base.get(str(c), {}).get(op) if "error" not in base else None
                    cells.append(f"{value:.0f}" + (f" ({value / ref:.2g}×)" if ref and target != "tcpstore" else ""))
            lines.append(f"| {target} | " + " | ".join(cells) + " |")
    verdicts = results.get("targets", [])
    if verdicts:
        lines += ["", "### Targets", "", "| target | threshold | measured | verdict | margin |",
                  "|---|---|---|---|---|"]
        for v in verdicts:
            measured = "–" if v["value"] is None else (
                (">" if v.get("value_is_lower_bound") else "") + f"{v['value']:g} {v['unit']}"
                + (" (predicted, not run)" if v["status"] == "skipped" else ""))
            verdict = {True: "met", False: "**missed**", None: "inconclusive (baseline hit the limit)"}[v["met"]]
            margin = "–" if v["margin"] is None else f"{v['margin']:+g} {v['unit']}"
            lines.append(f"| {v['target']} | {v['threshold']} {v['unit']} | {measured} | {verdict} | {margin} |")
    return "\n".join(lines) + "\n"


def _typical_rep(cell: dict[str, Any]) -> dict[str, Any] | None:
    """The repetition whose latency is the cell's median (or the last one, if none succeeded)."""
    ok = [r for r in cell["reps"] if r.get("ranks_ok")]
    if not ok:
        return cell["reps"][-1] if cell["reps"] else None
    ok.sort(key=lambda r: r["latency_s"])
    return ok[len(ok) // 2]


def _load(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


# -- plot -----------------------------------------------------------------------------------------------
def plot(results: dict[str, Any], path: str) -> None:
    """Latency vs N, log-log, one line per target; timeouts drawn as ▲ at the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {t: "-" for t in RDZV} | {t: "--" for t in BASELINES}
    for target in RDZV + BASELINES:
        cells = [c for c in results["latency"] if c["target"] == target]
        ok = [(c["n"], c["median_s"]) for c in cells if c["status"] == "ok" and c.get("median_s")]
        if not cells:
            continue
        line = None
        if ok:
            line, = ax.plot([n for n, _ in ok], [v for _, v in ok], styles[target], marker="o", label=target)
        for c in cells:
            if c["status"] == "timeout":
                value, _ = _value(c)
                if value:
                    color = line.get_color() if line else None
                    marker, = ax.plot([c["n"]], [value], marker="^", markersize=9, linestyle="none", color=color,
                                      alpha=0.8, label=None if line else f"{target} (timeout)")
                    if ok:  # a dotted line from the last completed N to the timeout
                        ax.plot([ok[-1][0], c["n"]], [ok[-1][1], value], ":", color=marker.get_color())
    labels: dict[float, list[str]] = {}
    for target, threshold in TARGETS_1024.items():
        labels.setdefault(threshold, []).append(target)
    for threshold, names in labels.items():
        ax.plot([1024], [threshold], marker="_", markersize=22, markeredgewidth=2, color="black", linestyle="none")
        ax.annotate(f"target {', '.join(names)}", (1024, threshold), xytext=(-6, 3), textcoords="offset points",
                    ha="right", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({c["n"] for c in results["latency"]})
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(n) for n in sizes])
    ax.set_xlabel("agents N (min = max = N)")
    ax.set_ylabel("median seconds until every agent holds its rank")
    ax.set_title(f"Rendezvous latency ({results['machine']['cpus']} CPUs; ▲ = timeout at the cell limit, "
                 "— = 1024 targets)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
