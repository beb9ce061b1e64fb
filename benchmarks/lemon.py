"""Goodput under a lemon node, with and without the node ledger (docs/node-health.md).

    python -m benchmarks.lemon [--backend file|redis] [--duration S] [--cooldown S] [--reps N] [--smoke] [--write-docs]

3 nodes and a spare on this host (``rdzv-run --nnodes 2:3 --max-restarts 100 --monitor-interval 0.1``, 1
``benchmarks/trainer.py --collective`` worker each, ``last_call_timeout=10``, ``RDZV_NODE_NAME`` A, B, L, S, each
launcher in a session of its own). L is a lemon from the start (``lemon-L``: its workers exit 3 right after
``init_process_group``); A, B, L start together, the spare S once L's first start is recorded. Arms, one after the
other (interleaved, order alternating, with ``--reps`` > 1): ``ledger`` (``quarantine_cooldown=--cooldown``) and
``no-ledger`` (``quarantine_after=0``: offences recorded, nobody quarantined). Each runs ``--duration`` s from the
launchers' start; then ``stop-all``, SIGTERM to launchers still running after a grace (they print their summaries),
and SIGKILL of every process group the arm started. Measured from the step records within the duration (seconds):
*training* = the sum of the gaps shorter than 1 s between consecutive world-3 steps (all nodes merged); *lost* =
duration - training; *lost per hour* = lost / duration x 3600 (scaled, not measured over an hour); the lemon's
starts, each launcher's restarts (its summary), the first world-3 step, L's ledger entry just before the stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import psutil

from .elastic import _commit  # the commit and the library files changed since
from .servers import Servers
from .trainer_records import read_records

__all__ = ["run_arm", "measure", "main"]

log = logging.getLogger(__name__)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAINER = os.path.join(HERE, "trainer.py")
ARMS = {"ledger": "quarantine_cooldown={cooldown:g}", "no-ledger": "quarantine_after=0"}
NODES = ("A", "B", "L", "S")
GAP = 1.0  #: seconds: a gap between world-3 steps at least this long is not training
START_LIMIT = 120.0  #: seconds to wait for the lemon's first start before starting the spare anyway
SUMMARY = re.compile(r"restarts: (\d+) of \d+ used on failures, (\d+) for membership changes")
EXIT = re.compile(r"outcome:\s+(.*) \(exit code (-?\d+)\)")


class Node:
    """One ``rdzv-run`` launcher in a session of its own; stdout and stderr go to ``WORKDIR/NAME.log``."""

    def __init__(self, name: str, url: str, out: str, workdir: str, tag: str) -> None:
        self.name = name
        argv = [sys.executable, "-m", "rdzv_agent.launch.launcher", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--max-restarts", "100", "--monitor-interval", "0.1", "--rdzv", url,
                TRAINER, "--out", out, "--collective", "--pg-timeout", "60"]
        env = {**os.environ, "RDZV_NODE_NAME": name, "TRAINER_NODE": name, "LEMON_BENCH_TAG": tag,
               "PYTHONUNBUFFERED": "1", "TMPDIR": workdir, "LOGLEVEL": "INFO"}
        env.pop("RDZV_URL", None)
        self.path = os.path.join(workdir, f"{name}.log")
        with open(self.path, "wb") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=workdir, start_new_session=True)

    def summary(self) -> dict[str, Any]:
        """The launcher's exit summary: outcome, exit code, failure and membership restarts (None: no summary)."""
        with open(self.path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        restarts, outcome = SUMMARY.findall(text), EXIT.findall(text)
        return {"returncode": self.proc.poll(),
                "failure_restarts": int(restarts[-1][0]) if restarts else None,
                "membership_restarts": int(restarts[-1][1]) if restarts else None,
                "outcome": outcome[-1][0][:200] if outcome else None}


def _tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``LEMON_BENCH_TAG=tag`` (whatever their parent)."""
    def has(proc: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return proc.pid != os.getpid() and bool(proc.environ().get("LEMON_BENCH_TAG") == tag)
        return False
    return [p for p in psutil.process_iter() if has(p)]


def _leads(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _stop(nodes: dict[str, Node], out: str, tag: str, grace: float) -> None:
    """``stop-all``; SIGTERM to launchers still running after ``grace`` s; then SIGKILL of every process group
    the arm started (bounded: about ``grace`` + 15 s)."""
    open(os.path.join(out, "stop-all"), "w").close()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(n.proc.poll() is None for n in nodes.values()):
        time.sleep(0.2)
    for n in nodes.values():
        if n.proc.poll() is None:
            log.info("node %s still running %.0f s after stop-all: SIGTERM", n.name, grace)
            n.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(n.proc.poll() is None for n in nodes.values()):
        time.sleep(0.2)
    # SIGKILL: the group of each launcher still running (not yet waited for: its pid cannot have been reused), and
    # each process carrying the tag now (workers, warm workers, the reaper), with the group it leads, if any
    groups = [n.proc.pid for n in nodes.values() if n.proc.poll() is None]
    groups += [p.pid for p in _tagged(tag) if _leads(p.pid)]
    for pid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for proc in _tagged(tag):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    for n in nodes.values():
        try:
            n.proc.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("node %s (pid %d) did not exit after SIGKILL", n.name, n.proc.pid)
    psutil.wait_procs(_tagged(tag), timeout=10)


def _ledger_entry(base: str, run_id: str, name: str) -> dict[str, Any]:
    """Node ``name``'s ledger entry in run ``run_id`` (``{"error": ...}`` if it cannot be read)."""
    from rdzv_core import Rendezvous, RendezvousParams, open_backend
    from rdzv_core.rendezvous.ledger import NodeLedger, QuarantinePolicy

    try:
        with open_backend(base) as kv:
            rdzv = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1))
            return NodeLedger(rdzv.kv, rdzv.keys, QuarantinePolicy()).read(name).as_dict()
    except Exception as exc:  # noqa: BLE001 -- a measurement, not the job: record why
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_arm(arm: str, servers: Servers, backend: str, duration: float, cooldown: float, grace: float,
            keep: str | None = None) -> dict[str, Any]:
    """One arm: start the job, let it run ``duration`` s, stop it, measure (:func:`measure`). Every process it
    started is killed before it returns; ``keep``: copy the logs and records there."""
    tag = uuid.uuid4().hex[:10]
    run_id = f"lemon{tag}"
    workdir = tempfile.mkdtemp(prefix=f"rdzv-lemon-{arm}-")
    out = os.path.join(workdir, "out")
    os.makedirs(out)
    open(os.path.join(out, "lemon-L"), "w").close()
    base = servers.rdzv_url(backend, tag)
    query = f"last_call_timeout=10&{ARMS[arm].format(cooldown=cooldown)}"
    url = base.replace("?", run_id + "?", 1) + "&" + query if "?" in base else f"{base}{run_id}?{query}"
    nodes: dict[str, Node] = {}
    load = list(os.getloadavg())
    t0 = time.time()
    spare_at = None
    try:
        for name in ("A", "B", "L"):
            nodes[name] = Node(name, url, out, workdir, tag)
        end = t0 + duration
        while time.time() < end:
            if spare_at is None and (read_records(out, "L", "lemon") or time.time() > t0 + START_LIMIT):
                spare_at = time.time()
                nodes["S"] = Node("S", url, out, workdir, tag)
            time.sleep(min(0.5, max(0.0, end - time.time())))
        entry = _ledger_entry(base, run_id, "L")
    finally:
        _stop(nodes, out, tag, grace)
    result = {"arm": arm, "backend": backend, "url": url, "tag": tag, "duration_s": duration, "cooldown_s": cooldown,
              "loadavg_start": load, "loadavg_end": list(os.getloadavg()), "t0": t0,
              "spare_started_s": None if spare_at is None else round(spare_at - t0, 2),
              "nodes": {name: n.summary() for name, n in nodes.items()}, "ledger_L": entry,
              **measure(out, t0, duration, entry, cooldown)}
    if keep:
        os.makedirs(keep, exist_ok=True)
        for d in (workdir, out):
            for f in (f for f in os.listdir(d) if f.endswith((".log", ".jsonl"))):
                shutil.copy(os.path.join(d, f), keep)
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def measure(out: str, t0: float, duration: float, entry: dict[str, Any], cooldown: float) -> dict[str, Any]:
    """Outcomes from the records in ``out`` within ``[t0, t0 + duration]`` (seconds; see the module docstring)."""
    end = t0 + duration
    def at(node: str, kind: str = "step", world: int | None = None) -> list[float]:
        return [float(str(r["t"])) - t0 for r in read_records(out, node, kind)
                if float(str(r["t"])) <= end and (world is None or r["world"] == world)]
    times = sorted(t for n in NODES for t in at(n, world=3) if t >= 0)
    training = sum(b - a for a, b in zip(times, times[1:], strict=False) if b - a < GAP)
    lemon = at("L", "lemon")
    offences = entry.get("offences") or []
    # the first quarantine began with the second offence and lasted the cooldown
    q_end = offences[1]["at"] - t0 + cooldown if len(offences) >= 2 and entry.get("quarantines") else None
    return {
        "training_s": round(training, 2), "lost_s": round(duration - training, 2),
        "lost_s_per_hour": round((duration - training) / duration * 3600, 0),
        "first_world3_s": round(times[0], 2) if times else None, "spare_trained": bool(at("S", world=3)),
        "lemon_starts": len(lemon), "lemon_start_times_s": [round(t, 2) for t in lemon],
        "first_quarantine_end_s": None if q_end is None else round(q_end, 2),
        "lemon_starts_before_cooldown_end": len([t for t in lemon if q_end is None or t < q_end]),
        "lemon_starts_after_cooldown_end": len([t for t in lemon if q_end is not None and t >= q_end]),
        "quarantines": entry.get("quarantines"),
    }


def cooldown_note(r: dict[str, Any]) -> str:
    """One sentence on what the lemon did after its first quarantine in arm result ``r``."""
    q_end, d = r["first_quarantine_end_s"], r["duration_s"]
    if r["arm"] != "ledger":
        return f"no-ledger: the lemon started {r['lemon_starts']} times in {d:g} s; nobody was quarantined."
    if q_end is None:
        return f"ledger: the lemon was not quarantined within {d:g} s ({r['lemon_starts']} starts)."
    if q_end >= d:
        return f"ledger: the lemon's quarantine (until +{q_end:.0f} s) outlasted the {d:g} s run."
    if (r["quarantines"] or 0) >= 2:
        return (f"ledger: the lemon's first quarantine ended at +{q_end:.0f} s; it came back, started "
                f"{r['lemon_starts_after_cooldown_end']} more time(s), failed and was quarantined again, for twice "
                f"the cooldown ({r['quarantines']} quarantines in the run).")
    return (f"ledger: the lemon's first quarantine ended at +{q_end:.0f} s, within the run, but it started "
            f"{r['lemon_starts_after_cooldown_end']} more time(s): with A, B and the spare S in a full round "
            f"(max 3 nodes) it waited for a place and was not quarantined again.")


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table of the arms' outcomes (restarts: failure / membership, per node A/B/L/S)."""
    rows = ["| arm | rep | training s | lost s | lost s/h (scaled) | first world-3 s | lemon starts (before / "
            "after cooldown end) | failure restarts A/B/L/S | membership restarts A/B/L/S | load start / end |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        per = ["/".join(str(r["nodes"].get(n, {}).get(key, "-")) for n in NODES)
               for key in ("failure_restarts", "membership_restarts")]
        first = "never" if r["first_world3_s"] is None else f"{r['first_world3_s']:.1f}"
        rows.append(f"| {r['arm']} | {r['rep']} | {r['training_s']:.1f} | {r['lost_s']:.1f} | "
                    f"{r['lost_s_per_hour']:.0f} | {first} | {r['lemon_starts']} "
                    f"({r['lemon_starts_before_cooldown_end']} / {r['lemon_starts_after_cooldown_end']}) | "
                    f"{per[0]} | {per[1]} | {r['loadavg_start'][0]:.1f} / {r['loadavg_end'][0]:.1f} |")
    return "\n".join(rows)


def write_docs(record: dict[str, Any], docs: str) -> None:
    """Write ``docs/lemon.json`` and replace (or add, before "## Files") the section in docs/benchmarks.md."""
    with open(os.path.join(docs, "lemon.json"), "w") as f:
        json.dump(record, f, indent=1)
    m, c = record["machine"], record["config"]
    changes = ", ".join(x.split()[-1] for x in record["code"]["library_changes"])
    commit = (record["code"]["commit"] or "?")[:7] + (f" (uncommitted library changes: {changes})" if changes else "")
    section = f"""## Goodput under a lemon node

How much training does a job lose to a node whose workers fail at every start (a *lemon*), with the node ledger
(docs/node-health.md) and without it? `benchmarks/lemon.py`: 3 nodes and a spare on this host (`rdzv-run --nnodes 2:3
--max-restarts 100 --monitor-interval 0.1`, 1 gloo worker each, `benchmarks/trainer.py --collective`,
`last_call_timeout=10`, one `RDZV_NODE_NAME` per launcher); L's workers exit 3 right after `init_process_group` at
every start; A, B and L start together, the spare S once L's first start is recorded. Arms, same job, one after the
other: **ledger** (`quarantine_cooldown={c['cooldown_s']:g}`, `quarantine_after` 2) and **no ledger**
(`quarantine_after=0`: offences recorded, nobody quarantined; what torchrun does). Each arm runs {c['duration_s']:g} s
from the launchers' start, then is stopped (`stop-all`, SIGTERM after a grace, SIGKILL by process group).

*Training seconds*: the sum of the gaps shorter than 1 s between consecutive steps at world size 3 (all nodes' step
records merged) within the run; *lost* = duration - training. **Lost seconds per hour is scaled from the
{c['duration_s']:g} s run (lost / duration x 3600), not measured over an hour.** Restarts are each launcher's summary
(A/B/L/S; `-`: none). A node whose workers failed because a peer's did, with an error naming the lost peer (gloo:
`Connection closed by peer`), is not charged a failure restart: its launcher restarts for the membership change;
failure restarts of A, B or S are worker errors not recognised as a lost peer (not examined). Lemon starts: in all
(before / after the end of its first quarantine, taken as its second offence + the cooldown).

```bash
{record['command']}
```

Run {record['started']} at commit {commit},
{c['backend']} backend, {round(record['seconds'] / 60)} min, on this {m['cpus']}-CPU machine; load average (1 min)
{m['loadavg_start'][0]:.1f} before, {m['loadavg_end'][0]:.1f} after (other sessions' runs may share the machine).
Every number, the ledger entry of L and each launcher's outcome: `docs/lemon.json`.

{table(record['results'])}

""" + "\n".join(f"* {cooldown_note(r)}" for r in record["results"]) + "\n"
    path = os.path.join(docs, "benchmarks.md")
    with open(path) as f:
        text = f.read()
    start = text.find("## Goodput under a lemon node")
    if start < 0:
        start = end = text.find("\n## Files") + 1 or len(text)
    else:
        nxt = text.find("\n## ", start + 3)
        end = len(text) if nxt < 0 else nxt + 1
    with open(path, "w") as f:
        f.write(text[:start] + section + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    """Run both arms; print the table; exit 1 if no arm trained at world size 3 at all (nothing to compare)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.lemon", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("file", "redis"), default="file")
    p.add_argument("--duration", type=float, default=180.0, help="seconds per arm from the launchers' start")
    p.add_argument("--cooldown", type=float, default=60.0, help="quarantine_cooldown of the ledger arm (s)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of both arms, interleaved (default 1)")
    p.add_argument("--smoke", action="store_true", help="once, 60 s per arm, cooldown 30 s (CI)")
    p.add_argument("--out", default=None, help="JSON file to write (default: a new temporary file)")
    p.add_argument("--logs", default=None, help="keep each arm's logs and records under this directory")
    p.add_argument("--write-docs", action="store_true", help="write docs/lemon.json and the section in "
                   "docs/benchmarks.md")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.smoke:
        args.duration, args.cooldown, args.reps = 60.0, 30.0, 1
    grace = 10.0 if args.smoke else 20.0
    servers = Servers([args.backend])
    started, load = time.time(), list(os.getloadavg())
    results = []
    try:
        for rep in range(args.reps):
            for arm in (ARMS if rep % 2 == 0 else reversed(ARMS)):
                log.info("rep %d, arm %s: %g s (load %.2f)", rep, arm, args.duration, os.getloadavg()[0])
                keep = os.path.join(args.logs, f"{arm}-{rep}") if args.logs else None
                r = {**run_arm(arm, servers, args.backend, args.duration, args.cooldown, grace, keep), "rep": rep}
                results.append(r)
                log.info("%s", json.dumps({k: v for k, v in r.items() if k not in ("nodes", "url")}))
    finally:
        versions = servers.versions()
        servers.stop()
    record = {"command": "python -m benchmarks.lemon " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "seconds": round(time.time() - started, 1),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "loadavg_start": load,
                          "loadavg_end": list(os.getloadavg())},
              "servers": versions, "code": _commit(),
              "config": {"backend": args.backend, "duration_s": args.duration, "cooldown_s": args.cooldown,
                         "reps": args.reps, "gap_s": GAP, "nnodes": "2:3", "max_restarts": 100,
                         "last_call_timeout_s": 10},
              "results": results}
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="rdzv-lemon-"), "lemon.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(table(results))
    for r in results:
        print(cooldown_note(r))
    print(f"lost s/h is scaled from {args.duration:g} s runs (lost / duration x 3600), not measured over an hour; "
          f"load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"results: {out}")
    if args.write_docs:
        write_docs(record, os.path.join(ROOT, "docs"))
    return 0 if any(r["first_world3_s"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
