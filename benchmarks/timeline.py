"""A 3-node run's timeline (rounds, restarts, failures), drawn from the events the run recorded.

``python -m benchmarks.timeline`` runs a real job of three ``rdzv-run`` nodes (``file://``
backend, ``--nnodes 2:3``, ``--max-restarts 2``, ``--hang-timeout 3``): node ``n2``'s worker
exits 1 in its first attempt; node ``n1``'s hangs in its second (no progress: its agent dumps
the stack and restarts it); node ``n0`` is killed (SIGKILL) in the third round and the other
two re-form without it, then finish. Each node records torch's elastic events and the
handler's rendezvous events (``docs/telemetry.md``) through a logging handler registered the
torch way (``events.handlers._log_handlers``), one JSON line per event with its time; the
lines are merged into ``docs/timeline.jsonl`` and drawn into ``docs/timeline.png``
(``--from FILE`` redraws from a recorded log without running anything).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

__all__ = ["record", "draw", "main"]

NODES = ("n0", "n1", "n2")

#: Runs ``rdzv-run`` with both event streams logged as JSON lines (argv: NODE LOG_FILE RDZV_RUN_ARGS...).
WRAPPER = textwrap.dedent(
    """
    import json, logging, sys
    from torch.distributed.elastic.events import handlers
    node, path = sys.argv[1], sys.argv[2]

    class Line(logging.Formatter):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind

        def format(self, record):
            return json.dumps({"t": record.created, "node": node, "kind": self.kind,
                               "event": json.loads(record.getMessage())})

    for name, kind in (("timeline", "agent"), ("dynamic_rendezvous", "rdzv")):
        handler = logging.FileHandler(path)
        handler.setFormatter(Line(kind))
        handlers._log_handlers[name] = handler
    from rdzv_agent.launch.launcher import main
    sys.exit(main(sys.argv[3:]))
    """
)

#: The workers: 16 steps of 0.5 s (reported with rdzv_agent.progress), with the failures described above.
WORKER = textwrap.dedent(
    """
    import os, sys, time
    import rdzv_agent.progress as progress
    node, attempt = os.environ["TIMELINE_NODE"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    out = sys.argv[1]
    starts = os.path.join(out, node + ".starts")
    with open(starts, "a") as f:
        f.write("x")
    start = os.path.getsize(starts)
    for step in range(1, 17):
        progress.step(step)
        time.sleep(0.5)
        if node == "n2" and attempt == 0 and step == 4:
            sys.exit(1)
        if node == "n1" and attempt == 0 and start == 2 and step == 3:
            while True:  # hung
                time.sleep(1)
        if node == "n0" and start == 3 and step == 3:
            open(os.path.join(out, "kill_n0"), "w").close()
            time.sleep(60)
    """
)


def record(out: str, workdir: str) -> list[dict[str, Any]]:
    """Run the job in ``workdir``; write the merged event log to ``out``; return its events."""
    with open(os.path.join(workdir, "w.py"), "w") as f:
        f.write(WORKER)
    url = f"file://{workdir}/kv/timeline?last_call_timeout=3&keep_alive_ttl=3"
    procs = {}
    for node in NODES:
        argv = ["--rdzv", url, "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "2",
                "--monitor-interval", "0.2", "--hang-timeout", "3", "--event-log-handler", "timeline",
                "--log-dir", os.path.join(workdir, "logs", node), os.path.join(workdir, "w.py"), workdir]
        env = {**os.environ, "TIMELINE_NODE": node, "RDZV_PROGRESS_INTERVAL": "1"}
        procs[node] = subprocess.Popen([sys.executable, "-c", WRAPPER, node, os.path.join(workdir, f"{node}.jsonl"),
                                        *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
    deadline = time.monotonic() + 240
    while not os.path.exists(os.path.join(workdir, "kill_n0")) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs["n0"].send_signal(signal.SIGKILL)
    for proc in procs.values():
        proc.wait(max(1.0, deadline - time.monotonic()))
    events = []
    for node in NODES:
        with open(os.path.join(workdir, f"{node}.jsonl")) as f:
            events += [json.loads(line) for line in f if line.strip()]
    events.sort(key=lambda e: e["t"])
    with open(out, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return events


_JOINED = re.compile(r"has joined round (\d+) .* as rank (\d+) in a world of size (\d+)")


def _lanes(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per node: rendezvous spans, worker spans, restarts (spent / membership), rounds, its end."""
    t0 = min(e["t"] for e in events)
    lanes: dict[str, dict[str, Any]] = {n: {"rdzv": [], "work": [], "spent": [], "membership": [], "rounds": [],
                                            "end": None, "outcome": None, "last": 0.0} for n in NODES}
    restarts = {n: 0 for n in NODES}
    working: dict[str, float] = {}
    for e in events:
        lane, t, ev = lanes[e["node"]], e["t"] - t0, e["event"]
        lane["last"] = t
        if e["kind"] == "rdzv":
            m = _JOINED.search(ev.get("message", ""))
            if m:
                lane["rounds"].append((t, int(m.group(1)), int(m.group(2)), int(m.group(3))))
            continue
        state, md = ev["metadata"]["state"], ev["metadata"]
        if state == "RENDEZVOUS":
            begin = t - (md.get("duration_ms") or 0) / 1000
            if e["node"] in working:
                lane["work"].append((working.pop(e["node"]), begin))
            if lane["rdzv"]:
                kind = "spent" if md["agent_restarts"] > restarts[e["node"]] else "membership"
                lane[kind].append(begin)
            restarts[e["node"]] = md["agent_restarts"]
            lane["rdzv"].append((begin, t))
        elif state == "START" and ev["source"] == "WORKER":
            working[e["node"]] = t
        elif ev["source"] == "AGENT" and state in ("SUCCEEDED", "FAILED"):
            lane["end"], lane["outcome"] = t, state
    for node, begin in working.items():
        lane = lanes[node]
        lane["work"].append((begin, lane["end"] if lane["end"] is not None else lane["last"]))
    return lanes


def draw(events: list[dict[str, Any]], path: str) -> None:
    """Draw the timeline of ``events`` (a merged event log) into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = _lanes(events)
    fig, ax = plt.subplots(figsize=(11, 3.4))
    for y, node in enumerate(reversed(NODES)):
        lane = lanes[node]
        ax.broken_barh([(a, b - a) for a, b in lane["work"]], (y - 0.3, 0.6), color="#4caf50", label="workers run")
        ax.broken_barh([(a, max(b - a, 0.05)) for a, b in lane["rdzv"]], (y - 0.3, 0.6), color="#ff9800",
                       label="rendezvous")
        ax.plot(lane["spent"], [y] * len(lane["spent"]), "X", color="#d32f2f", markersize=11,
                label="restart spent (worker failed or hung)")
        ax.plot(lane["membership"], [y] * len(lane["membership"]), "D", color="#1976d2", markersize=7,
                label="re-formed (membership change)")
        for t, version, rank, world in lane["rounds"]:
            ax.annotate(f"r{version}: {rank}/{world}", (t, y + 0.32), fontsize=7, ha="left")
        if lane["end"] is None:
            ax.plot([lane["last"]], [y], "s", color="black", markersize=8, label="node killed (last event)")
        else:
            ax.annotate(lane["outcome"].lower(), (lane["end"], y), fontsize=8, xytext=(4, -3),
                        textcoords="offset points")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8,
              frameon=False)
    ax.set_yticks(range(len(NODES)), list(reversed(NODES)))
    ax.set_xlabel("seconds since the first event")
    ax.set_title("3-node rdzv-run job: rounds (rV: group rank/nodes), restarts and failures, from the recorded events",
                 fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("docs", "timeline.png"), help="the PNG to write")
    parser.add_argument("--events", default=os.path.join("docs", "timeline.jsonl"), help="the event log to write")
    parser.add_argument("--from", dest="source", default=None, help="draw this event log instead of running a job")
    args = parser.parse_args(argv)
    if args.source is not None:
        with open(args.source) as f:
            events = [json.loads(line) for line in f if line.strip()]
    else:
        with tempfile.TemporaryDirectory(prefix="rdzv-timeline-") as workdir:
            events = record(args.events, workdir)
    draw(events, args.out)
    print(f"{len(events)} events -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
