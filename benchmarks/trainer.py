"""A training-loop worker for the elasticity benchmark and the membership tests: gloo steps, each
recorded with its world size.

Every worker joins the process group from torchrun's variables (``env://``,
gloo, ``--pg-timeout`` seconds), then loops: with ``--collective`` every step is
an ``all_reduce`` of 1 (checked to equal ``WORLD_SIZE``); without it the first
step is, the rest are local. After each step it appends one JSON line to
``OUT/steps-<NODE>.jsonl`` (``NODE`` is the ``TRAINER_NODE`` variable the caller gives
each launcher: the launchers pass their environment to their workers)::

    {"node", "pid", "rank", "local_rank", "world", "group_rank", "restart", "master", "step", "t"}

``master`` is ``MASTER_ADDR:MASTER_PORT`` (one per round's process group); ``t`` is ``time.time()``;
``spawned`` is ``time.time()`` at the trainer's first line, before it imports torch; ``imported`` once
``import torch`` returned; ``pg_done`` once ``init_process_group`` returned (reading the records:
:mod:`benchmarks.trainer_records`).
Before the first step it writes one ``start`` line with the same fields and ``"sum"`` (the first
``all_reduce`` of ``RANK + 1``: the sum of 1..WORLD_SIZE when every rank is distinct); an ``error`` line
when a step's ``all_reduce`` raises (then it exits with the error).
It stops when asked, by files in ``OUT``:

``stop-all`` or ``stop-<NODE>``   finish the current step, destroy the group, exit 0 (with
                                  ``--collective``: every rank stops at the step one of them saw it)
``fail-<NODE>``                   exit 3 while ``TORCHELASTIC_RESTART_COUNT`` is 0 (a failure)
``lemon-<NODE>``                  exit 3 right after ``init_process_group``, at every start (a host-specific
                                  fault: the node's peers fail in their first ``all_reduce``)
"""

from __future__ import annotations

import time

SPAWNED = time.time()  # the entry point's first line: before torch's import (a warm worker's is done already)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402  # at module level: warm workers start this trainer warm by default
import torch.distributed as dist  # noqa: E402

IMPORTED = time.time()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--collective", action="store_true")
    p.add_argument("--max-steps", type=int, default=100_000)
    args = p.parse_args()

    node = os.environ.get("TRAINER_NODE", "node")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.path.join(args.out, f"steps-{node}.jsonl")
    base: dict[str, Any] = {
        "node": node, "pid": os.getpid(), "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]), "world": int(os.environ["WORLD_SIZE"]),
        "group_rank": int(os.environ.get("GROUP_RANK", "-1")), "restart": restart,
        "role_rank": int(os.environ.get("ROLE_RANK", "-1")), "role_world": int(os.environ.get("ROLE_WORLD_SIZE", "-1")),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}", "spawned": SPAWNED,
        "imported": IMPORTED,
    }

    def record(**fields: object) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({**base, **fields, "t": time.time()}) + "\n")

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    base["pg_done"] = time.time()
    if os.path.exists(os.path.join(args.out, f"lemon-{node}")):
        record(kind="lemon")
        print(f"trainer {node} rank {base['rank']}: injected host fault", file=sys.stderr, flush=True)
        return 3
    total = torch.tensor([base["rank"] + 1])
    dist.all_reduce(total)
    record(kind="start", sum=int(total.item()))
    for step in range(args.max_steps):
        if os.path.exists(os.path.join(args.out, f"fail-{node}")) and restart == 0:
            print(f"trainer {node} rank {base['rank']}: injected failure", file=sys.stderr, flush=True)
            return 3
        stop = any(os.path.exists(os.path.join(args.out, name)) for name in ("stop-all", f"stop-{node}"))
        if args.collective:  # [1, stop]: every rank counted, and all stop at the same step
            both = torch.tensor([1, int(stop)])
            try:
                dist.all_reduce(both)
            except RuntimeError as exc:  # a peer is gone: when this worker learnt it
                record(kind="error", step=step, error=str(exc)[:200])
                raise
            if int(both[0].item()) != base["world"]:
                print(f"all_reduce gave {int(both[0].item())}, WORLD_SIZE={base['world']}", file=sys.stderr,
                      flush=True)
                return 4
            stop = int(both[1].item()) > 0
        record(kind="step", step=step)
        if stop:
            break
        time.sleep(args.step_sleep)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
