"""A torch-free worker that takes steps and records them, for the scheduler tests (no process group).

Writes ``OUT/<SLURM_JOB_ID>-<restart count>-<RANK>.json`` (restart count: ``SLURM_RESTART_COUNT``, 0 when unset),
rewritten atomically after every step and on a signal::

    {"rank": int, "world_size": int, "run_id": TORCHELASTIC_RUN_ID, "job_id": SLURM_JOB_ID,
     "restart_count": int, "steps": int, "signals": ["SIGUSR1", ...], "done": bool, "pid": int,
     "node_id": SLURM_NODEID}

--steps N          take N steps, then exit 0 (``done`` true)
--step-time S      seconds per step (default 0.05)
--until PATH       instead of --steps: take steps until PATH exists (at most 300 s, then exit 1)
--sigterm-exits    SIGTERM is recorded, then ends the worker at once (exit 143), as a script that does not
                   catch it: its launcher's restart of the workers waits for nothing

SIGUSR1 and SIGTERM are recorded in ``signals`` and do not stop the worker (as a training script that checkpoints
at its next step and lets its launcher stop it; SIGTERM: unless ``--sigterm-exits``); any other signal ends it as
usual.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

UNTIL_LIMIT = 300.0  # seconds


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--until", default=None)
    p.add_argument("--sigterm-exits", action="store_true")
    args = p.parse_args()
    if (args.steps is None) == (args.until is None):
        p.error("give exactly one of --steps and --until")
    os.makedirs(args.out, exist_ok=True)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    rank = os.environ["RANK"]
    path = os.path.join(args.out, f"{os.environ.get('SLURM_JOB_ID', 'nojob')}-{restart}-{rank}.json")
    state: dict[str, Any] = {
        "rank": int(rank), "world_size": int(os.environ["WORLD_SIZE"]), "run_id": os.environ["TORCHELASTIC_RUN_ID"],
        "job_id": os.environ.get("SLURM_JOB_ID"), "restart_count": restart, "steps": 0, "signals": [],
        "done": False, "pid": os.getpid(), "node_id": os.environ.get("SLURM_NODEID"),
    }

    def write() -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    def on_signal(signum: int, frame: Any) -> None:
        state["signals"].append(signal.Signals(signum).name)
        write()
        if signum == signal.SIGTERM and args.sigterm_exits:
            os._exit(128 + signum)

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    write()
    deadline = time.monotonic() + UNTIL_LIMIT
    while args.until is None and state["steps"] < args.steps or args.until is not None and not os.path.exists(
            args.until):
        if time.monotonic() > deadline:
            return 1
        time.sleep(args.step_time)
        state["steps"] += 1
        write()
    state["done"] = True
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
