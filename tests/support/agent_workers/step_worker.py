"""A torch-free worker that takes steps and records them, for the scheduler tests (no process group).

Writes ``OUT/<SLURM_JOB_ID>-<restart count>-<RANK>.json`` (restart count: ``SLURM_RESTART_COUNT``, 0 when unset),
rewritten atomically after every step and on a signal::

    {"rank": int, "world_size": int, "run_id": TORCHELASTIC_RUN_ID, "job_id": SLURM_JOB_ID,
     "restart_count": int, "steps": int, "resumed_from": int, "signals": ["SIGUSR1", ...], "done": bool,
     "pid": int, "node_id": SLURM_NODEID, "parent_argv": [str, str], "max_restarts": int | None}

``parent_argv``: the first two words of the parent's command line (``/proc/PPID/cmdline``: a launcher run by
Python is ``[PYTHON, LAUNCHER]``), ``[]`` where it cannot be read.

``max_restarts``: ``TORCHELASTIC_MAX_RESTARTS``, the restarts the launcher was given (its agent sets it in each
worker), ``None`` when unset.

``steps`` counts from ``resumed_from`` (the checkpoint's step count, 0 without one): the steps this worker took
are ``steps - resumed_from``.

--steps N          take steps until N in all (counting a checkpoint's), then exit 0 (``done`` true)
--step-time S      seconds per step (default 0.05)
--until PATH       instead of --steps: take steps until PATH exists (at most 300 s, then exit 1)
--sigterm-exits    SIGTERM is recorded, then ends the worker at once (exit 143), as a script that does not
                   catch it: its launcher's restart of the workers waits for nothing
--checkpoint DIR   a checkpoint per job and rank: ``DIR/<SLURM_JOB_ID>-<RANK>.json`` (``{"steps": int}``),
                   rewritten atomically after every step -- before the record, so a record never counts a step the
                   checkpoint lacks -- and on a signal that ends the worker. A worker that finds it resumes from
                   its step count (``resumed_from``): a requeued Slurm job (``SLURM_RESTART_COUNT`` > 0) continues
                   where the same rank of its earlier start stopped, as would a worker restarted within one start.

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


def _write_json(path: str, value: dict[str, Any], tag: str) -> None:
    """Replace ``path`` with ``value`` as JSON, atomically; ``tag`` keeps a signal handler's temporary file apart
    from the one the interrupted main loop may be writing."""
    tmp = f"{path}.{os.getpid()}.{tag}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _parent_argv() -> list[str]:
    """The first two words of the parent process's command line; ``[]`` where ``/proc`` does not give it."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [w.decode(errors="replace") for w in f.read().split(b"\0")[:2]]
    except OSError:
        return []


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--until", default=None)
    p.add_argument("--sigterm-exits", action="store_true")
    p.add_argument("--checkpoint", default=None)
    args = p.parse_args()
    if (args.steps is None) == (args.until is None):
        p.error("give exactly one of --steps and --until")
    os.makedirs(args.out, exist_ok=True)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    rank = os.environ["RANK"]
    job = os.environ.get("SLURM_JOB_ID", "nojob")
    path = os.path.join(args.out, f"{job}-{restart}-{rank}.json")
    checkpoint = None
    resumed_from = 0
    if args.checkpoint is not None:
        os.makedirs(args.checkpoint, exist_ok=True)
        checkpoint = os.path.join(args.checkpoint, f"{job}-{rank}.json")
        if os.path.exists(checkpoint):
            with open(checkpoint) as f:
                resumed_from = int(json.load(f)["steps"])
    state: dict[str, Any] = {
        "rank": int(rank), "world_size": int(os.environ["WORLD_SIZE"]), "run_id": os.environ["TORCHELASTIC_RUN_ID"],
        "job_id": os.environ.get("SLURM_JOB_ID"), "restart_count": restart, "steps": resumed_from,
        "resumed_from": resumed_from, "signals": [], "done": False, "pid": os.getpid(),
        "node_id": os.environ.get("SLURM_NODEID"), "parent_argv": _parent_argv(),
        "max_restarts": int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) if "TORCHELASTIC_MAX_RESTARTS" in os.environ
        else None,
    }

    def save(tag: str = "main") -> None:
        if checkpoint is not None:
            _write_json(checkpoint, {"steps": state["steps"]}, tag)

    def write(tag: str = "main") -> None:
        _write_json(path, state, tag)

    def on_signal(signum: int, frame: Any) -> None:
        state["signals"].append(signal.Signals(signum).name)
        # a temporary file of this call's own: under Slurm a signal may come twice (from Slurm, and from the
        # launcher passing it on), the second interrupting this handler between its write and its replace
        tag = f"signal{len(state['signals'])}"
        if signum == signal.SIGTERM and args.sigterm_exits:
            save(tag)  # the step the main loop may have counted but not yet saved
            write(tag)
            os._exit(128 + signum)
        write(tag)

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
        save()
        write()
    state["done"] = True
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
