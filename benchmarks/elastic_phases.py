"""Phases of one recovery of :mod:`benchmarks.elastic`, from the launchers' INFO logs and the trainer's records.

Every time is wall time (``time.time()``) on the one host. Milestones of the job, from the event (``t0``):

==============  ===========================================================================================
detect          the first survivor agent knows: its log says the workers failed, nodes wait, the round is
                gone or destroyed (the round watch), or it re-rendezvouses
stopped         the last survivor began its next rendezvous (its workers stopped)
rendezvous      the last node of the new round had its round (rdzv-run ``round complete``, torchrun
                ``Rendezvous complete``): the one its measured worker was started after
spawned         the last new worker ran its first line of Python
imported        the last new worker had imported torch
pg              the last new worker's ``init_process_group`` returned
step            the first step at the new world size (the recovery)
==============  ===========================================================================================

``worker_error`` (a milestone, not a boundary) is when a survivor's worker first saw its ``all_reduce`` fail.

Phases are the gaps between consecutive milestones (``PHASES``); a milestone that never came is ``None``.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from .trainer_records import read_records

__all__ = ["PHASES", "MILESTONES", "node_events", "phases"]

MILESTONES = ("detect", "stopped", "rendezvous", "spawned", "imported", "pg", "step")
#: phase name -> (from milestone, to milestone); ``t0`` is the event.
PHASES = {
    "detection": ("t0", "detect"),
    "teardown": ("detect", "stopped"),
    "rendezvous": ("stopped", "rendezvous"),
    "worker_start": ("rendezvous", "spawned"),
    "imports": ("spawned", "imported"),
    "init_pg": ("imported", "pg"),
    "first_step": ("pg", "step"),
}

_RDZV_RUN = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ ([\w.]+): (.*)$")
_TORCH = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d)\.(\d{6}) \d+ (\S+)\] (.*)$")

#: (kind, pattern of logger + message); kinds: detect, begin (a rendezvous begins), done (a round is had).
_LINES = [
    ("detect", re.compile(r"rdzv_agent\.simple: .*(worker group (FAILED|UNHEALTHY)|num_nodes_waiting=\d+"
                          r"|; re-rendezvous)")),
    ("detect", re.compile(r"rdzv_core\.\w+: .*destroyed the round")),
    ("detect", re.compile(r"agent/server/api\.py:\d+: .*(Worker group (FAILED|UNHEALTHY)|Detected \d+ new nodes)")),
    ("begin", re.compile(r"rdzv_core\.rendezvous: run=\S+ version=\S+ rank=\S+: (joined|created|waiting|queued)")),
    ("begin", re.compile(r"agent/server/api\.py:\d+: \[\w+\] Rendezvous'ing worker group")),
    ("done", re.compile(r"rdzv_agent\.simple: \[\w+\] round complete")),
    ("done", re.compile(r"agent/server/api\.py:\d+: \[\w+\] Rendezvous complete for workers")),
]


def _parse_time(line: str, year: int) -> tuple[float, str] | None:
    """``(time.time() of the line, "logger: message")`` for a launcher log line, else ``None``."""
    m = _RDZV_RUN.match(line)
    if m:
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        return t, f"{m.group(3)}: {m.group(4)}"
    m = _TORCH.match(line)
    if m:
        t = time.mktime(time.strptime(f"{year}-{m.group(1)}-{m.group(2)} {m.group(3)}", "%Y-%m-%d %H:%M:%S"))
        return t + int(m.group(4)) / 1e6, f"{m.group(5)}: {m.group(6)}"
    return None


def node_events(log_path: str, year: int | None = None) -> list[tuple[float, str, str]]:
    """``(time, kind, line)`` of the lines of one launcher log that mark a milestone, in order."""
    if year is None:
        year = time.localtime().tm_year
    out: list[tuple[float, str, str]] = []
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        parsed = _parse_time(line, year)
        if parsed is None:
            continue
        t, text = parsed
        for kind, pattern in _LINES:
            if pattern.search(text):
                out.append((t, kind, text[:200]))
                break
    return out


def phases(workdir: str, out: str, t0: float, survivors: list[str], new_round: list[str], world: int,
           step: float | None) -> dict[str, Any]:
    """Milestones (seconds after ``t0``) and phases (seconds) of one recovery.

    ``survivors`` were training before the event (their detection counts); ``new_round`` are the nodes whose
    new workers train at ``world``; ``step`` is the recovery's first step (``time.time()``) or ``None``.
    """
    year = time.localtime(t0).tm_year
    events = {n: [e for e in node_events(os.path.join(workdir, f"{n}.log"), year) if e[0] >= t0 - 0.002]
              for n in set(survivors) | set(new_round)}
    at: dict[str, float | None] = dict.fromkeys(MILESTONES)
    detects = [e[0] for n in survivors for e in events[n] if e[1] == "detect"]
    at["detect"] = min(detects) if detects else None
    starts: dict[str, dict[str, Any]] = {}
    for n in new_round:  # the new worker on each node: its first start record at ``world`` after t0
        found: list[dict[str, Any]] = read_records(out, n, "start")
        recs = [r for r in found if r["world"] == world and float(r["spawned"]) >= t0]
        if recs:
            starts[n] = min(recs, key=lambda r: float(r["spawned"]))
    stopped, done = [], []
    for n in survivors:
        first_detect = next((e[0] for e in events[n] if e[1] == "detect"), None)
        if first_detect is not None:
            begin = next((e[0] for e in events[n] if e[1] == "begin" and e[0] >= first_detect), None)
            if begin is not None:
                stopped.append(begin)
    if stopped and len(stopped) == len(survivors):
        at["stopped"] = max(stopped)
    for n in new_round:
        if n not in starts:
            continue
        before = [e[0] for e in events[n] if e[1] == "done" and e[0] <= float(starts[n]["spawned"]) + 0.002]
        if before:
            done.append(max(before))
    if done and len(done) == len(new_round):
        at["rendezvous"] = max(done)
    if len(starts) == len(new_round) and starts:
        for key, field in (("spawned", "spawned"), ("imported", "imported"), ("pg", "pg_done")):
            values = [starts[n].get(field) for n in new_round]
            at[key] = None if any(v is None for v in values) else max(float(v or 0.0) for v in values)
    at["step"] = step
    cutoff = at["spawned"] or step or float("inf")  # later errors are the job's end, not the event
    errors = [t for n in survivors for t in (float(str(r["t"])) for r in read_records(out, n, "error"))
              if t0 <= t < cutoff]
    at["worker_error"] = min(errors) if errors else None  # not a phase boundary: inside detection
    rel = {k: (None if v is None else round(v - t0, 3)) for k, v in at.items()}
    gaps: dict[str, float | None] = {}
    for name, (a, b) in PHASES.items():
        ta = t0 if a == "t0" else at[a]
        tb = at[b]
        gaps[name] = None if ta is None or tb is None else round(tb - ta, 3)
    return {"milestones": rel, "phases": gaps}

