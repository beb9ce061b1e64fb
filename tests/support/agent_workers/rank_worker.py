"""A worker that records the ranks its launcher gave it (no torch import: cheap to restart every round).

Usage: ``rank_worker.py OUT [FAILS]``. On start it appends one JSON line to ``OUT/starts.jsonl``::

    {"node", "pid", "group_rank", "group_world", "rank", "local_rank", "world", "restart", "t"}

(``node`` is the ``RANK_NODE`` variable the test gives each launcher). The worker of local rank 0 on the
node of the last group rank then fails (exit 1) while ``OUT/failures`` has fewer than ``FAILS`` lines (it
adds one first): the node whose worker failed re-joins first, as in the issue's observation. Every other
worker runs until ``OUT/stop`` exists, then exits 0.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    out, fails = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
    env = os.environ
    record = {"node": env.get("RANK_NODE", "?"), "pid": os.getpid(), "group_rank": int(env["GROUP_RANK"]),
              "group_world": int(env["GROUP_WORLD_SIZE"]), "rank": int(env["RANK"]),
              "local_rank": int(env["LOCAL_RANK"]), "world": int(env["WORLD_SIZE"]),
              "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), "t": time.time()}
    with open(os.path.join(out, "starts.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    failures = os.path.join(out, "failures")
    if record["local_rank"] == 0 and record["group_rank"] == record["group_world"] - 1:
        done = len(open(failures).read().splitlines()) if os.path.exists(failures) else 0
        if done < fails:
            with open(failures, "a") as f:
                f.write(f"{record['node']} {time.time()}\n")
            return 1
    while not os.path.exists(os.path.join(out, "stop")):
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
