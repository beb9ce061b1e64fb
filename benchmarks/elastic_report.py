"""Summary, targets, table and plot of a :mod:`benchmarks.elastic` run.

    python -m benchmarks.elastic_report RUN.json [--merge MORE.json ...] [--rephase] [--write-docs]

Targets of the fast re-form rule, at the ``defaults`` setting (torch's 30 s last call, ``keep_alive_ttl`` 5 s):
``rdzv-run`` over redis, etcd-v3 and file: kill <= 1.5 s, leave <= 1.5 s, grow <= 2 s, freeze <= ttl + 1.5 s;
``torchrun`` with the ``rdzv-redis`` handler: kill <= 2.5 s, freeze <= ttl + 2.5 s; each of these at least 10x
faster than ``torchrun:c10d`` at its defaults in the same run. At ``lc1`` (``last_call_timeout=1``): no rdzv
target slower than the previously recorded run. Spare: no member restarts while the spare waits. Values are
medians over the repetitions; one that did not recover counts as ``+inf``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from typing import Any

from .elastic_phases import PHASES, phases

__all__ = ["summarize", "markdown", "plot", "write_docs", "rephase", "merge", "TARGETS_DEFAULTS"]

TTL = 5.0
#: target -> event -> bound (seconds) on the median recovery at the defaults.
TARGETS_DEFAULTS: dict[str, dict[str, float]] = {
    **{t: {"kill": 1.5, "leave": 1.5, "grow": 2.0, "freeze": TTL + 1.5}
       for t in ("rdzv-run:redis", "rdzv-run:etcd-v3", "rdzv-run:file",
                 "rdzv-run+warm:redis", "rdzv-run+warm:etcd-v3", "rdzv-run+warm:file",
                 "rdzv-run+cold:redis", "rdzv-run+cold:etcd-v3", "rdzv-run+cold:file")},
    "torchrun:rdzv-redis": {"kill": 2.5, "freeze": TTL + 2.5},
}
FASTER_THAN_C10D = 10.0
BASELINES = ("torchrun:c10d", "torchrun:etcd-v2")
_START, _END = "<!-- elastic-phases:start -->", "<!-- elastic-phases:end -->"
#: The record and plot ``write_docs`` writes (in ``docs/``).
RECORD, PLOT = "elastic-phases.json", "elastic-phases.png"


def _is_rdzv(target: str) -> bool:
    return target not in BASELINES


def _within(cell: dict[str, Any], bound: float | None) -> bool:
    """Whether the cell's median recovery is at most ``bound`` s (``None``: no bound, met once it recovered)."""
    return cell["median_s"] is not None and (bound is None or cell["median_s"] <= bound)


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Medians (recovery and phases) per (setting, event, target) and the verdicts."""
    limit = record["config"]["limit_s"]
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in record["results"]:
        setting = r.get("setting", "lc1")
        cell = cells.setdefault((setting, r["event"], r["target"]), {
            "setting": setting, "event": r["event"], "target": r["target"], "values": [], "member_restarts": [],
            "runs": []})
        cell["values"].append(r["recovery_s"] if r["recovery_s"] is not None else math.inf)
        cell["runs"].append(r)
        if "member_restarts" in r:
            cell["member_restarts"].append(r["member_restarts"])
    for cell in cells.values():
        runs = cell.pop("runs")
        median = statistics.median(cell["values"])
        cell["median_s"] = None if math.isinf(median) else round(median, 3)
        cell["recovered"] = sum(1 for v in cell["values"] if not math.isinf(v))
        cell["values"] = [None if math.isinf(v) else v for v in cell["values"]]
        cell["phases"] = {p: _median([(r.get("phases") or {}).get(p) for r in runs]) for p in PHASES}
        cell["worker_error_s"] = _median([(r.get("milestones") or {}).get("worker_error") for r in runs])
        cell["no_start"] = sum(1 for r in runs if r.get("status") == "no start")
    for cell in cells.values():
        base = cells.get((cell["setting"], cell["event"], "torchrun:c10d"))
        if base is None or cell["target"] == "torchrun:c10d":
            continue
        ours, theirs = cell["median_s"], base["median_s"]
        if ours is None or ours <= 0:
            cell["x_c10d"] = None
        elif theirs is None:
            cell["x_c10d"] = f">{limit / ours:.1f}"  # c10d did not recover within the limit
        else:
            cell["x_c10d"] = round(theirs / ours, 1)
    previous = (record.get("previous") or {}).get("medians_s", {})
    verdicts: list[dict[str, Any]] = []
    for key in sorted(cells):
        cell = cells[key]
        setting, event, target = key
        if not _is_rdzv(target):
            continue
        bound = TARGETS_DEFAULTS.get(target, {}).get(event) if setting == "defaults" else None
        if bound is not None:
            verdicts.append({"what": f"defaults: {event} {target} <= {bound:g} s", "value": cell["median_s"],
                             "met": _within(cell, bound)})
            if "x_c10d" in cell:
                ratio = cell["x_c10d"]
                value = float(ratio.lstrip(">")) if isinstance(ratio, str) else ratio
                met: bool | None = value is not None and value >= FASTER_THAN_C10D
                if not met and isinstance(ratio, str):
                    met = None  # c10d did not recover: the ratio is a lower bound below the factor
                verdicts.append({"what": f"defaults: {event} {target} >= {FASTER_THAN_C10D:g}x faster than "
                                         "torchrun:c10d", "value": ratio, "met": met})
        if setting == "lc1" and f"{target}|{event}" in previous:
            before = previous[f"{target}|{event}"]
            verdicts.append({"what": f"lc1: {event} {target} <= previous run ({before} s)", "value": cell["median_s"],
                             "met": _within(cell, before)})
        if event == "spare":
            restarts = cell["member_restarts"]
            verdicts.append({"what": f"{setting}: spare {target}: 0 member restarts while waiting",
                             "value": max(restarts) if restarts else None,
                             "met": bool(restarts) and not any(restarts)})
    order = {s: i for i, s in enumerate(record["config"].get("settings") or ["lc1"])}
    ordered = sorted(cells.values(), key=lambda c: (order.get(c["setting"], 9), c["event"], c["target"]))
    return {"cells": ordered, "verdicts": verdicts}


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _recovery(cell: dict[str, Any], limit: float) -> str:
    if cell["median_s"] is None:
        text = f"not recovered within {limit:g} s"
        if cell["no_start"]:
            text += f" ({cell['no_start']} did not start)"
        return text
    text = f"**{cell['median_s']:.2f}**"
    if cell["recovered"] < len(cell["values"]):
        text += f" ({cell['recovered']}/{len(cell['values'])} recovered)"
    return text


def _bound(cell: dict[str, Any], previous: dict[str, Any]) -> str:
    if cell["setting"] == "defaults":
        bound = TARGETS_DEFAULTS.get(cell["target"], {}).get(cell["event"])
        if bound is None:
            return ""
        ok = _within(cell, bound)
        return f"<= {bound:g}: {'hit' if ok else '**miss**'}"
    before = previous.get(f"{cell['target']}|{cell['event']}")
    if before is None and f"{cell['target']}|{cell['event']}" not in previous:
        return ""
    if before is None:
        return "prev. not recovered"
    ok = _within(cell, before)
    if not _is_rdzv(cell["target"]):
        return f"prev. {before:.2f}"
    return f"prev. {before:.2f}: {'hit' if ok else '**miss**'}"


def markdown(record: dict[str, Any]) -> str:
    """The results: one row per setting, event and target with the median recovery and its phases."""
    summary = record.get("summary") or summarize(record)
    limit = record["config"]["limit_s"]
    previous = (record.get("previous") or {}).get("medians_s", {})
    prev = record.get("previous") or {}
    lines = [
        f"Command: `{record['command'].strip()}`  ",
        f"Run: {record['started']} ({record['seconds']:.0f} s) at commit {record['code'].get('commit')}; "
        f"{record['machine']['cpus']} CPUs; servers {json.dumps(record.get('servers', {}))}; "
        f"{record['config']['reps']} repetition(s) (`n` per row), medians; "
        f"spare hold {record['config']['spare_hold_s']:g} s; "
        f"recovery limit {limit:g} s.  ",
        f"Previous run (the `lc1` comparison): `{prev.get('command')}` of {prev.get('started')} "
        f"({prev.get('reps')} repetitions).",
        "",
        "Seconds from the event; phases are medians of each phase over the repetitions (so they need not add up "
        "to the median recovery); `-`: the milestone was not reached or not logged; (worker saw it): when a "
        "survivor's worker saw its `all_reduce` fail (inside detection); x c10d: c10d's median / this one at the "
        "same setting (`>`: c10d did not recover within the limit, a lower bound).",
        "",
        "| setting | event | target | n | recovery | (worker saw it) | detection | teardown | rendezvous "
        "| worker start | imports | init_pg | first step | x c10d | target / previous |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["cells"]:
        ph = c["phases"]
        lines.append(f"| {c['setting']} | {c['event']} | {c['target']} | {len(c['values'])} | {_recovery(c, limit)} | "
                     f"{_fmt_s(c.get('worker_error_s'))} | "
                     + " | ".join(_fmt_s(ph.get(p)) for p in PHASES)
                     + f" | {c.get('x_c10d', '')} | {_bound(c, previous)} |")
    lines += ["", "| target | value | verdict |", "|---|---|---|"]
    for v in summary["verdicts"]:
        verdict = "hit" if v["met"] else "**miss**" if v["met"] is not None else "not shown (c10d: no recovery)"
        lines.append(f"| {v['what']} | {v['value']} | {verdict} |")
    restarts = [c for c in summary["cells"] if c["event"] == "spare"]
    if restarts:
        lines += ["", "Spare: member restarts while the spare waited, per repetition: "
                  + "; ".join(f"{c['setting']} {c['target']} {c['member_restarts']}" for c in restarts) + "."]
    return "\n".join(lines)


_COLORS = {"detection": "#d32f2f", "teardown": "#ff9800", "rendezvous": "#1976d2", "worker_start": "#9c27b0",
           "imports": "#795548", "init_pg": "#607d8b", "first_step": "#4caf50"}


def plot(record: dict[str, Any], path: str) -> None:
    """Stacked median phases per event and target, one panel per setting (clipped at 20 s, totals written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = record.get("summary") or summarize(record)
    limit = record["config"]["limit_s"]
    settings = list(record["config"].get("settings") or ["lc1"])
    clip = 20.0
    rows = {s: [c for c in summary["cells"] if c["setting"] == s] for s in settings}
    height = max(len(r) for r in rows.values()) * 0.22 + 1.5
    fig, axes = plt.subplots(1, len(settings), figsize=(7 * len(settings), height), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        cells = rows[setting]
        labels = []
        for y, c in enumerate(cells):
            labels.append(f"{c['event']}  {c['target']}")
            left = 0.0
            for name in PHASES:
                width = c["phases"].get(name)
                if width is None or width <= 0:
                    continue
                ax.barh(y, width, left=left, color=_COLORS[name], label=name)
                left += width
            total = c["median_s"]
            text = f"not recovered ({limit:g} s)" if total is None else f"{total:.2f} s"
            ax.text(min(max(left, total or 0.0), clip) + 0.2, y, text, va="center", fontsize=7)
        ax.set_yticks(range(len(cells)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, clip + 4)
        ax.set_xlabel(f"seconds from the event (median phases; bars past {clip + 4:g} s cut)")
        ax.set_title(f"setting: {setting}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=len(unique), fontsize=8, frameon=False)
    fig.suptitle("3-node gloo job on one host: recovery per event, split into phases", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rephase(record: dict[str, Any]) -> None:
    """Recompute every repetition's phases from its kept logs (``result["logs"]``), then the summary."""
    from .elastic import ROUNDS

    for r in record["results"]:
        if r.get("logs") and r.get("t0") is not None and os.path.isdir(r["logs"]):
            survivors, new_round, world = ROUNDS[r["event"]]
            step = None if r["recovery_s"] is None else r["t0"] + r["recovery_s"]
            r.update(phases(r["logs"], r["logs"], r["t0"], survivors, new_round, world, step))
    record["summary"] = summarize(record)


def merge(record: dict[str, Any], others: list[dict[str, Any]]) -> None:
    """Add the repetitions of ``others`` (runs of the same benchmark, e.g. more repetitions of some cells)."""
    config = record["config"]
    for other in others:
        record["results"].extend(other["results"])
        record["command"] += " && " + other["command"]
        record["seconds"] += other["seconds"]
        for name in ("targets", "events"):
            config[name] += [x for x in other["config"][name] if x not in config[name]]
        config["settings"] = {**config["settings"], **other["config"].get("settings", {})}
        config.setdefault("merged_limits_s", []).append(other["config"]["limit_s"])  # limit_s: the first run's
    counts: dict[tuple[str, str, str], int] = {}
    for r in record["results"]:
        cell = (r.get("setting", "lc1"), r["event"], r["target"])
        counts[cell] = counts.get(cell, 0) + 1
    low, high = min(counts.values()), max(counts.values())
    config["reps"] = low if low == high else f"{low}-{high}"


def write_docs(record: dict[str, Any], docs: str) -> None:
    """Write ``docs/elastic-phases.json``, ``docs/elastic-phases.png`` (if matplotlib is installed) and the table
    between the markers of ``docs/benchmarks.md``."""
    with open(os.path.join(docs, RECORD), "w") as f:
        json.dump(record, f, indent=1)
    try:
        plot(record, os.path.join(docs, PLOT))
    except ImportError:
        print(f"matplotlib is not installed: docs/{PLOT} not written", file=sys.stderr)
    path = os.path.join(docs, "benchmarks.md")
    with open(path) as f:
        text = f.read()
    block = f"{_START}\n{markdown(record)}\n{_END}"
    if _START in text:
        text = re.sub(re.escape(_START) + ".*?" + re.escape(_END), lambda _: block, text, flags=re.S)
    else:
        text += f"\n## Recovery phases (`python -m benchmarks.elastic`)\n\n{block}\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic_report", description=__doc__.split("\n\n")[0])
    p.add_argument("record", help="a JSON file written by python -m benchmarks.elastic")
    p.add_argument("--merge", nargs="*", default=[], help="more runs to add to RUN.json's repetitions")
    p.add_argument("--out", default=None, help="write the (merged, rephased) record here (default: RUN.json)")
    p.add_argument("--rephase", action="store_true", help="recompute the phases from the kept logs")
    p.add_argument("--write-docs", action="store_true", help=f"write docs/{RECORD}, docs/{PLOT}, the table")
    args = p.parse_args(argv)
    with open(args.record) as f:
        record = json.load(f)
    others = []
    for path in args.merge:
        with open(path) as f:
            others.append(json.load(f))
    merge(record, others)
    if args.rephase:
        rephase(record)
    record["summary"] = summarize(record)
    if args.merge or args.rephase:
        with open(args.out or args.record, "w") as f:
            json.dump(record, f, indent=1)
    print(markdown(record))
    if args.write_docs:
        write_docs(record, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
