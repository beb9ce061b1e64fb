"""``rdzv runs URL``: every run stored under a server's key prefix, one row each.

A row is the run id and incarnation (``docs/design.md``, "Incarnations": each incarnation is a run of its own
in the backend), its state (the round record's status and version, ``closed``, or ``absent`` when
only leftovers are stored), its members (live keep-alive keys of the current round) and its age:
seconds since the close (the closed mark's time), else since the newest member joined (its ``since``),
else ``None``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from rdzv_core.errors import CorruptEntryError, RendezvousStateError
from rdzv_core.kv import KVBackend
from rdzv_core.rendezvous import Rendezvous, RendezvousParams
from rdzv_core.rendezvous.record import parse_run_segment

__all__ = ["list_runs", "render"]


def list_runs(kv: KVBackend, params: RendezvousParams, now: float | None = None) -> list[dict[str, Any]]:
    """The runs under ``params.prefix``, sorted by run id and incarnation: ``{"run_id", "incarnation", "state",
    "version", "members", "age"}``
    (``age`` in seconds or ``None``; ``state`` the round record's status, ``stopped`` for a final round without a
    live member (a job stopped by a signal or lost), ``corrupt`` with ``"error"`` when the run's state cannot be
    read).

    Raises:
        BackendUnavailableError: from ``kv``.
    """
    now = time.time() if now is None else now
    root = params.prefix + "/" if params.prefix else ""
    runs = sorted({run for run in (parse_run_segment(e.key[len(root):].split("/", 1)[0])
                                   for e in kv.list(root)[0]) if run is not None})
    return [_row(kv, Rendezvous(kv, run_id, dataclasses.replace(params, incarnation=incarnation)), now)
            for run_id, incarnation in runs]


def _row(kv: KVBackend, rdzv: Rendezvous, now: float) -> dict[str, Any]:
    row: dict[str, Any] = {"run_id": rdzv.run_id, "incarnation": rdzv.incarnation, "state": None, "version": None,
                           "members": 0, "age": None}
    try:
        state = rdzv.describe()
    except (RendezvousStateError, CorruptEntryError) as exc:
        return {**row, "state": "corrupt", "error": str(exc)}
    row["state"], row["version"] = state.get("status"), state.get("version") or None
    if row["state"] == "closed":
        row["version"] = None
        closed = kv.get(rdzv.keys.closed)
        row["age"] = _age(now, _closed_time(closed.value if closed is not None else b""))
        return row
    members = [m for m in state.get("alive", []) if "corrupt" not in m]
    row["members"] = len(members)
    if row["state"] == "final" and not members:  # every node left or died, the run not closed: a stopped job
        row["state"] = "stopped"
    since = [m["since"] for m in members if isinstance(m.get("since"), (int, float))]
    row["age"] = _age(now, max(since) if since else None)
    return row


def _closed_time(raw: bytes) -> float | None:
    """The close time of a closed mark ``{"closed": UNIX_TIME}``; ``None`` for another value."""
    try:
        value = json.loads(raw).get("closed")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(max(0.0, now - then), 1)


def render(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as text lines, a header first."""
    lines = [f"{'run id':<30} {'inc.':>4} {'state':<10} {'version':>7} {'members':>7} {'age (s)':>9}"]
    for r in rows:
        version = "-" if r["version"] is None else str(r["version"])
        age = "-" if r["age"] is None else f"{r['age']:.0f}"
        lines.append(f"{r['run_id']:<30} {r['incarnation']:>4} {r['state']:<10} {version:>7} {r['members']:>7} "
                     f"{age:>9}")
    return lines
