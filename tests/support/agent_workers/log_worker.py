"""A worker that prints marked lines, for the log spec tests (no torch).

stdout: ``out apple R=<RANK> L=<LOCAL_RANK>`` and ``out plain L=<LOCAL_RANK>``;
stderr: ``err orange L=<LOCAL_RANK>`` and ``err plain L=<LOCAL_RANK>``. Then it writes
``OUT/<LOCAL_RANK>-<TORCHELASTIC_RESTART_COUNT>.json`` with its ``TORCHELASTIC_ERROR_FILE``
and restart count, and exits 3 if ``--fail-first`` and this is the first attempt
(restart count 0) -- once every local rank of that attempt has written its file, so no rank is
stopped before it printed -- else 0. ``--wait-for PATH`` blocks (at most 120 s) until PATH exists first.
"""

from __future__ import annotations

import json
import os
import sys
import time

args = sys.argv[1:]
out_dir = args[args.index("--out") + 1]
local, rank, count = os.environ["LOCAL_RANK"], os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if "--wait-for" in args:
    path, until = args[args.index("--wait-for") + 1], time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < until:
        time.sleep(0.05)
print(f"out apple R={rank} L={local} C={count}", flush=True)
print(f"out plain L={local}", flush=True)
print(f"err orange L={local}", file=sys.stderr, flush=True)
print(f"err plain L={local}", file=sys.stderr, flush=True)
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, f"{local}-{count}-{os.getpid()}.json"), "w") as f:
    json.dump({"error_file": os.environ.get("TORCHELASTIC_ERROR_FILE"), "count": count, "rank": rank}, f)
if "--fail-first" in args and count == "0":
    until = time.monotonic() + 120
    while (len([n for n in os.listdir(out_dir) if n.split("-")[1] == "0"]) < int(os.environ["LOCAL_WORLD_SIZE"])
           and time.monotonic() < until):
        time.sleep(0.05)
    sys.exit(3)
