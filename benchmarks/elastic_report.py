"""Summary, targets, table and plot of a :mod:`benchmarks.elastic` run.

Targets (issue 13, this machine): *freeze* recovers within ``keep_alive_ttl`` + 3 s
(8 s) on every rdzv target (``rdzv-run:*`` and ``torchrun:rdzv-redis``); *kill* <= 3 s;
*grow* <= 4 s; *leave* <= 3 s; *spare*: 0 restarts of the members while the spare
waits and the spare trains within 4 s of a member's kill; *kill*, *freeze* and *grow*
each at least 5x faster than ``torchrun:c10d``. Values are medians over the
repetitions; a repetition that did not recover counts as ``+inf`` (shown as
"did not recover within X s").
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from typing import Any

__all__ = ["summarize", "markdown", "plot", "write_docs", "LIMITS"]

#: event -> the bound (seconds) on every rdzv target's median recovery.
LIMITS = {"freeze": 8.0, "kill": 3.0, "grow": 4.0, "leave": 3.0, "spare": 4.0}
#: events where every rdzv target must be this many times faster than ``torchrun:c10d``.
FASTER_THAN_C10D = {"kill": 5.0, "freeze": 5.0, "grow": 5.0}
BASELINES = ("torchrun:c10d", "torchrun:etcd-v2")
_START, _END = "<!-- elastic:start -->", "<!-- elastic:end -->"


def _is_rdzv(target: str) -> bool:
    return target not in BASELINES


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Medians per (target, event), ratios to the baselines and the verdict of every target."""
    limit = record["config"]["limit_s"]
    cells: dict[str, dict[str, Any]] = {}
    for r in record["results"]:
        cell = cells.setdefault(f"{r['target']}|{r['event']}", {"target": r["target"], "event": r["event"],
                                                                  "values": [], "member_restarts": []})
        cell["values"].append(r["recovery_s"] if r["recovery_s"] is not None else math.inf)
        if "member_restarts" in r:
            cell["member_restarts"].append(r["member_restarts"])
    for cell in cells.values():
        median = statistics.median(cell["values"])
        cell["median_s"] = None if math.isinf(median) else round(median, 3)
        cell["recovered"] = sum(1 for v in cell["values"] if not math.isinf(v))
        cell["values"] = [None if math.isinf(v) else v for v in cell["values"]]
    for cell in cells.values():
        for base in BASELINES:
            other = cells.get(f"{base}|{cell['event']}")
            if other is None or cell["target"] == base:
                continue
            ours, theirs = cell["median_s"], other["median_s"]
            if ours is None:
                ratio = None
            elif theirs is None:
                ratio = f">{limit / ours:.1f}" if ours > 0 else None  # the baseline never recovered
            else:
                ratio = round(theirs / ours, 1) if ours > 0 else None
            cell[f"x_{base}"] = ratio
    verdicts = []
    for cell in sorted(cells.values(), key=lambda c: (c["event"], c["target"])):
        if not _is_rdzv(cell["target"]):
            continue
        bound = LIMITS.get(cell["event"])
        if bound is not None:
            met = cell["median_s"] is not None and cell["median_s"] <= bound
            verdicts.append({"what": f"{cell['event']} {cell['target']} <= {bound:g} s", "value": cell["median_s"],
                             "met": met})
        if cell["event"] == "spare":
            restarts = cell["member_restarts"]
            verdicts.append({"what": f"spare {cell['target']}: 0 member restarts while waiting",
                             "value": max(restarts) if restarts else None, "met": bool(restarts) and not any(restarts)})
        factor = FASTER_THAN_C10D.get(cell["event"])
        ratio = cell.get("x_torchrun:c10d")
        if factor is not None and f"torchrun:c10d|{cell['event']}" in cells:
            met = ratio is not None and (float(ratio.lstrip(">")) if isinstance(ratio, str) else ratio) >= factor
            verdicts.append({"what": f"{cell['event']} {cell['target']} >= {factor:g}x faster than torchrun:c10d",
                             "value": ratio, "met": met})
    return {"cells": sorted(cells.values(), key=lambda c: (c["event"], c["target"])), "verdicts": verdicts}


def _fmt(cell: dict[str, Any] | None, limit: float) -> str:
    if cell is None:
        return "-"
    if cell["median_s"] is None:
        return f"did not recover within {limit:g} s"
    text = f"{cell['median_s']:.2f} s"
    if cell["recovered"] < len(cell["values"]):
        text += f" ({cell['recovered']}/{len(cell['values'])} recovered)"
    if cell["member_restarts"]:
        text += f", restarts {cell['member_restarts']}"
    return text


def markdown(record: dict[str, Any]) -> str:
    """The results table (median recovery per event and target), ratios and the verdicts."""
    summary = record.get("summary") or summarize(record)
    limit = record["config"]["limit_s"]
    cells = {(c["target"], c["event"]): c for c in summary["cells"]}
    targets, events = record["config"]["targets"], record["config"]["events"]
    lines = [
        f"Command: `{record['command'].strip()}`  ",
        f"Run: {record['started']} ({record['seconds']:.0f} s) at commit {record['code'].get('commit')}; "
        f"{record['machine']['cpus']} CPUs; servers {json.dumps(record.get('servers', {}))}; "
        f"{record['config']['reps']} repetitions, medians.",
        "",
        "| event | " + " | ".join(targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    for event in events:
        lines.append(f"| {event} | " + " | ".join(_fmt(cells.get((t, event)), limit) for t in targets) + " |")
    lines += ["", "Ratios (baseline median / ours; `>` where the baseline did not recover):", "",
              "| event | target | x torchrun:c10d | x torchrun:etcd-v2 |", "|---|---|---|---|"]
    for c in summary["cells"]:
        if _is_rdzv(c["target"]):
            lines.append(f"| {c['event']} | {c['target']} | {c.get('x_torchrun:c10d', '-')} | "
                         f"{c.get('x_torchrun:etcd-v2', '-')} |")
    lines += ["", "| target | value | verdict |", "|---|---|---|"]
    for v in summary["verdicts"]:
        lines.append(f"| {v['what']} | {v['value']} | {'met' if v['met'] else '**missed**'} |")
    return "\n".join(lines)


def plot(record: dict[str, Any], path: str) -> None:
    """A grouped bar chart of the medians (log scale); bars at the limit, hatched, for no recovery."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = record.get("summary") or summarize(record)
    limit = record["config"]["limit_s"]
    cells = {(c["target"], c["event"]): c for c in summary["cells"]}
    targets, events = record["config"]["targets"], record["config"]["events"]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(targets))
    for i, target in enumerate(targets):
        xs, ys, lost = [], [], []
        for j, event in enumerate(events):
            cell = cells.get((target, event))
            if cell is None:
                continue
            xs.append(j + i * width)
            ys.append(cell["median_s"] if cell["median_s"] is not None else limit)
            lost.append(cell["median_s"] is None)
        bars = ax.bar(xs, ys, width, label=target)
        for bar, gone in zip(bars, lost, strict=True):
            if gone:
                bar.set_hatch("//")
    for j, event in enumerate(events):
        if event in LIMITS:
            ax.hlines(LIMITS[event], j - 0.1, j + 0.9, colors="black", linestyles="dashed", linewidth=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(events))], events)
    ax.set_yscale("log")
    ax.set_ylabel("seconds from the event to a step at the new world size (median)")
    ax.set_title("3-node gloo job on one host: recovery per event (dashed: target; hatched: no recovery)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(record: dict[str, Any], docs: str) -> None:
    """Write ``docs/elastic.json``, ``docs/elastic.png`` and the table between the markers of ``docs/benchmarks.md``."""
    with open(os.path.join(docs, "elastic.json"), "w") as f:
        json.dump(record, f, indent=1)
    plot(record, os.path.join(docs, "elastic.png"))
    path = os.path.join(docs, "benchmarks.md")
    with open(path) as f:
        text = f.read()
    block = f"{_START}\n{markdown(record)}\n{_END}"
    if _START in text:
        text = re.sub(re.escape(_START) + ".*?" + re.escape(_END), lambda _: block, text, flags=re.S)
    else:
        text += f"\n## Elasticity end to end (`python -m benchmarks.elastic`)\n\n{block}\n"
    with open(path, "w") as f:
        f.write(text)
