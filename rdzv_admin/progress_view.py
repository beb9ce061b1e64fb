"""``rdzv status``'s progress view: per node, its last step and how long ago; stragglers and hung nodes.

:func:`analyse` turns the round's :class:`~rdzv_core.rendezvous.progress_keys.NodeProgress` records and
keep-alive members into plain data (the ``"progress"`` object of ``rdzv status --json``);
:func:`render` makes the text of it, summary first and the worst nodes first, cut to a
number of lines (readable at 1,000 nodes). A node is

* **hung** when its slowest worker's last report was more than ``hang_timeout`` seconds old when its agent
  last published (the ``--hang-timeout`` of ``rdzv status``, else the one its agent published; off if
  neither). Measured at the publication, not now: a record is up to one publish interval old, so "now"
  would flag every node whose hang timeout is shorter than that interval;
* a **straggler** when its step is more than ``steps`` behind the median step of the nodes that
  reported, or its last report more than ``seconds`` older than the median node's.

Times are the nodes' wall clocks, compared with this host's: clock skew between hosts adds to the ages.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Iterable, Mapping

from rdzv_core.rendezvous.progress_keys import NodeProgress

__all__ = ["analyse", "render", "DEFAULT_STRAGGLER_STEPS", "DEFAULT_STRAGGLER_SECONDS"]

#: ``rdzv status --straggler-steps`` default: steps behind the median step.
DEFAULT_STRAGGLER_STEPS = 10
#: ``rdzv status --straggler-seconds`` default: seconds behind the median node's last report.
DEFAULT_STRAGGLER_SECONDS = 30.0


def analyse(progress: Iterable[NodeProgress], members: Iterable[Mapping[str, Any]], world: int | None,
            hang_timeout: float | None = None, steps: int = DEFAULT_STRAGGLER_STEPS,
            seconds: float = DEFAULT_STRAGGLER_SECONDS, now: float | None = None) -> dict[str, Any]:
    """The progress view of one round.

    Args:
        progress: the round's records (:func:`rdzv_core.rendezvous.progress_keys.read`).
        members: its keep-alive members (``rdzv status``'s ``alive`` entries: ``rank``, ``host``,
            ``keep_alive_age``).
        world: the round's members count, or ``None``.
        hang_timeout: seconds; ``None``: each node's published ``hang_timeout``.
        steps, seconds: the straggler thresholds.
        now: Unix seconds (default: now).

    Returns:
        ``{"summary": {...}, "ranks": [row, ...]}``, the rows worst first: hung, then stragglers,
        then by step; each row has ``rank``, ``host``, ``step``, ``since`` (seconds), ``slowest_worker``,
        ``workers``, ``keep_alive_age``, ``hung``, ``straggler`` (the reasons, a list).
    """
    now = time.time() if now is None else now
    ages = {m.get("rank"): m.get("keep_alive_age") for m in members if "corrupt" not in m}
    rows: list[dict[str, Any]] = []
    for p in progress:
        step, last = p.step, p.last
        if step is None or last is None:
            continue
        limit = hang_timeout if hang_timeout is not None else p.hang_timeout
        since = max(0.0, now - last)
        rows.append({"rank": p.rank, "host": p.host, "step": step, "since": round(since, 3),
                     "slowest_worker": p.slowest, "workers": len(p.workers), "keep_alive_age": ages.get(p.rank),
                     "hang_timeout": limit, "hung": limit is not None and p.published - last > limit,
                     "straggler": []})
    median_step = statistics.median(r["step"] for r in rows) if rows else None
    median_since = statistics.median(r["since"] for r in rows) if rows else None
    for row in rows:
        if median_step is not None and median_step - row["step"] > steps:
            row["straggler"].append(f"{median_step - row['step']:g} steps behind the median")
        if median_since is not None and row["since"] - median_since > seconds:
            row["straggler"].append(f"{row['since'] - median_since:.0f} s behind the median")
    rows.sort(key=lambda r: (not r["hung"], not r["straggler"], r["step"], -r["since"], r["rank"]))
    reported = {r["rank"] for r in rows}
    silent = sorted(r for r in ages if isinstance(r, int) and r not in reported)
    summary = {"members": world, "reporting": len(rows), "not_reporting": silent,
               "hung": [r["rank"] for r in rows if r["hung"]],
               "stragglers": [r["rank"] for r in rows if r["straggler"] and not r["hung"]],
               "median_step": median_step, "min_step": min((r["step"] for r in rows), default=None),
               "max_step": max((r["step"] for r in rows), default=None),
               "straggler_steps": steps, "straggler_seconds": seconds}
    return {"summary": summary, "ranks": rows}


def _ranks(ranks: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > most else "")


def render(view: Mapping[str, Any], limit: int = 20) -> list[str]:
    """The text lines of :func:`analyse`'s ``view``: a summary, then at most ``limit`` nodes, worst first."""
    s, rows = view["summary"], view["ranks"]
    if not rows:
        return ["progress      no worker has reported progress (rdzv_agent.progress.step(n), or write the step "
                "to $RDZV_PROGRESS_FILE)"]
    lines = [f"progress      {s['reporting']} of {s['members'] if s['members'] is not None else '?'} nodes report; "
             f"step min {s['min_step']} / median {s['median_step']:g} / max {s['max_step']}; "
             f"{len(s['hung'])} hung, {len(s['stragglers'])} straggling"]
    if s["hung"]:
        lines.append(f"HUNG          rank(s) {_ranks(s['hung'])}: no progress within their hang timeout")
    if s["stragglers"]:
        lines.append(f"STRAGGLERS    rank(s) {_ranks(s['stragglers'])} (more than {s['straggler_steps']} steps or "
                     f"{s['straggler_seconds']:g} s behind the median)")
    if s["not_reporting"]:
        lines.append(f"silent        rank(s) {_ranks(s['not_reporting'])} are members but report no progress")
    lines.append(f"  {'rank':>5}  {'host':<20} {'step':>10} {'since':>8} {'keep-alive':>10}  flags")
    for row in rows[:max(0, limit)]:
        age = row["keep_alive_age"]
        flags = (["HUNG"] if row["hung"] else []) + row["straggler"]
        lines.append(f"  {row['rank']:>5}  {row['host'][:20]:<20} {row['step']:>10} {row['since']:>7.1f}s "
                     f"{'-' if age is None else f'{age:.1f}s':>10}  {'; '.join(flags)}".rstrip())
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more node(s), none worse than those above")
    return lines
