"""``rdzv nodes URL``: the run's node ledger, one row per node; ``--forgive NODE`` clears a node's record.

The ledger (:mod:`rdzv_core.rendezvous.ledger`, ``docs/node-health.md``) holds per node the failures charged to it
(offences), its quarantine and its failing pre-flight check. A row: the node; its state (``healthy``,
``quarantined until HH:MM:SS``, ``unhealthy``: its check fails); its offences within the window (the URL's
``quarantine_window``, default 3600 s: count and kinds); how often it was quarantined; when it was admitted while
quarantined because the run could not go on without it (fail-open); and why (the quarantine's reason, the failing
check's). Nodes kept out come first, then by name. ``rdzv status`` shows the nodes kept out (:func:`kept_out`).

Times are this host's local wall-clock times; the nodes' clocks wrote them (skew between hosts shows).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Iterable, Mapping

from rdzv_core.errors import CorruptEntryError, RdzvError
from rdzv_core.rendezvous.ledger import NodeEntry, NodeLedger, Offence

__all__ = ["command", "as_rows", "render", "kept_out", "render_kept_out"]


def _clock(at: float, now: float) -> str:
    """Unix time ``at`` as local ``HH:MM:SS``, with the date when it is not ``now``'s day."""
    same_day = time.localtime(at)[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", time.localtime(at))


def _state(entry: NodeEntry, now: float) -> str:
    """``healthy``, ``quarantined until HH:MM:SS`` or ``unhealthy``."""
    state = entry.state(now)
    return f"quarantined until {_clock(entry.until, now)}" if state == "quarantined" and entry.until else state


def _why(entry: NodeEntry, now: float) -> str:
    """Why the node is kept out: its quarantine's reason and its failing check's (``""``: neither)."""
    parts = [entry.why] if entry.quarantined(now) and entry.why else []
    if entry.check:
        parts.append(f"check fails: {entry.check}")
    return "; ".join(parts)


def _recent(entry: NodeEntry, window: float, now: float) -> list[Offence]:
    """The entry's offences within the last ``window`` seconds."""
    return [o for o in entry.offences if o.at > now - window]


def _offences(entry: NodeEntry, window: float, now: float) -> str:
    """``N (kind, kind)`` of the offences within the window; ``0``."""
    recent = _recent(entry, window, now)
    return f"{len(recent)} ({', '.join(sorted({o.kind for o in recent}))})" if recent else "0"


def _order(entries: Iterable[NodeEntry], now: float) -> list[NodeEntry]:
    """Nodes kept out first, then by name."""
    return sorted(entries, key=lambda e: (e.state(now) == "healthy", e.name))


def as_rows(entries: Iterable[NodeEntry], now: float | None = None) -> list[dict[str, Any]]:
    """``rdzv nodes --json``: each entry as stored (:meth:`NodeEntry.as_dict`) plus its ``"state"`` at Unix time
    ``now`` (default: now), kept-out nodes first."""
    now = time.time() if now is None else now
    return [{**e.as_dict(), "state": e.state(now)} for e in _order(entries, now)]


def render(entries: Iterable[NodeEntry], run_name: str, window: float, now: float | None = None) -> list[str]:
    """The text lines of ``rdzv nodes``: a summary, then a header and one row per node (offences counted within
    the last ``window`` seconds of Unix time ``now``, default now)."""
    now = time.time() if now is None else now
    ordered = _order(entries, now)
    if not ordered:
        return [f"no node in the ledger of {run_name}: no failure, check or quarantine recorded"]
    states = [e.state(now) for e in ordered]
    counts = ", ".join(f"{states.count(s)} {s}" for s in ("healthy", "quarantined", "unhealthy") if s in states)
    table = [["node", "state", f"offences ({window:g} s)", "quarantines", "fail-open", "why"]]
    for e in ordered:
        table.append([e.name, _state(e, now), _offences(e, window, now), str(e.quarantines),
                      _clock(e.fail_open, now) if e.fail_open else "-", _why(e, now) or "-"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]  # "why" is last, not padded
    lines = [f"{len(ordered)} node(s) in the ledger of {run_name}: {counts}"]
    for row in table:
        lines.append(" ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]).rstrip())
    return lines


def shared_count(ledger: NodeLedger) -> int:
    """How many nodes the prefix-scoped ledger beside ``ledger`` (a run's) holds; 0 when it cannot be read."""
    shared = NodeLedger(ledger.kv, ledger.keys, ledger.policy, scope="prefix")
    try:
        return len(shared.kv.list(shared.directory)[0])
    except RdzvError:
        return 0


def kept_out(ledger: NodeLedger, now: float | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """``rdzv status``'s ``kept_out``: the nodes not healthy at Unix time ``now`` (default: now), each
    ``{"node", "state", "why"}`` plus ``"until"`` (quarantined) and ``"fail_open"`` (admitted anyway) when set;
    and warnings (a ledger that cannot be listed: one line, and no nodes). Kept out or not, a node does not
    change the verdict.

    Raises:
        BackendUnavailableError, BackendClosedError: from the backend.
    """
    now = time.time() if now is None else now
    try:
        entries = ledger.entries()
    except CorruptEntryError as exc:
        return [], [f"the node ledger under {ledger.directory!r} cannot be listed: {exc}"]
    rows = []
    for e in _order(entries, now):
        state = e.state(now)
        if state == "healthy":
            continue
        row: dict[str, Any] = {"node": e.name, "state": state, "why": _why(e, now)}
        if state == "quarantined":
            row["until"] = e.until
        if e.fail_open:
            row["fail_open"] = e.fail_open
        rows.append(row)
    return rows, []


def render_kept_out(rows: list[Mapping[str, Any]], limit: int = 20, now: float | None = None) -> list[str]:
    """The text lines of :func:`kept_out`'s rows (none when empty), at most ``limit`` nodes."""
    if not rows:
        return []
    now = time.time() if now is None else now
    lines = [f"{'kept out':<13} {len(rows)} node(s) quarantined or failing their check (a quarantined node is "
             f"admitted when the run cannot go on without it; rdzv nodes URL: the ledger)"]
    width = min(max(len(str(r["node"])) for r in rows), 40)
    for r in rows[:max(0, limit)]:
        state = f"quarantined until {_clock(r['until'], now)}" if r.get("until") else str(r["state"])
        note = f"; admitted fail-open at {_clock(r['fail_open'], now)}" if r.get("fail_open") else ""
        lines.append(f"  {str(r['node']):<{width}}  {state}: {r['why'] or '-'}{note}")
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more node(s) kept out")
    return lines


def command(ledger: NodeLedger, run_name: str, forgive: str | None, as_json: bool,
            confirm: Callable[[str], bool]) -> int:
    """``rdzv nodes``: print the ledger (text, or JSON with ``as_json``); with ``forgive``, clear that node's
    offences and end its quarantine (:meth:`NodeLedger.forgive`) once ``confirm(question)`` agrees, and print
    its entry after. Returns the exit code: 0 done, 1 refused, 2 ``forgive`` names a node not in the ledger
    (one line on stderr; nothing written).

    Raises:
        BackendUnavailableError, BackendClosedError, RendezvousStateError, CorruptEntryError: from the backend.
    """
    now = time.time()
    entries = ledger.entries()
    if forgive is None:
        print(json.dumps(as_rows(entries, now), indent=2) if as_json
              else "\n".join(render(entries, run_name, ledger.policy.window, now)))
        return 0
    entry = next((e for e in entries if e.name == forgive), None)
    if entry is None:
        print(f"rdzv: node {forgive!r} is not in the node ledger of {run_name} ({len(entries)} node(s) there; "
              f"rdzv nodes URL lists them)", file=sys.stderr)
        return 2
    what = f"forgive node {forgive} of {run_name} (clear its {len(entry.offences)} offence(s)"
    if entry.quarantined(now) and entry.until:
        what += f", end its quarantine until {_clock(entry.until, now)}"
    if not confirm(what + ")"):
        return 1
    after = ledger.forgive(forgive)
    if as_json:
        print(json.dumps({**after.as_dict(), "state": after.state()}, indent=2))
    else:
        print(f"forgave {forgive}: no offences, not quarantined")
        if after.check:
            print(f"{forgive} is still unhealthy: its check fails ({after.check}); it joins once the check passes")
    return 0
