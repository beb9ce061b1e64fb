"""A tiny worker for the agent tests (no torch unless ``--steal-master-port``).

Every run writes ``OUT/<RANK>-<pid>.json`` with the torchrun variables it saw
(and its pid), then behaves as told:

--fail-rank R --fail-times K   rank R raises ``RuntimeError(--message)`` while
                               TORCHELASTIC_RESTART_COUNT < K (K=-1: always)
--exit-code N                  on failure exit with N instead of raising
--wait-for PATH                block until PATH exists (at most 120 s; after the
                               failure check), then exit 0
--child                        start a grandchild (sleeps 120 s) first; its pid is
                               in the JSON as ``child_pid``
--ignore-sigterm               ignore SIGTERM (the agent must SIGKILL it)
--steal-master-port            rank 0, first attempt only: something else binds
                               MASTER_PORT first, then a torch TCPStore server on
                               it fails with torch's own EADDRINUSE error
--print TEXT                   print TEXT on stdout (and ``err:TEXT`` on stderr)
--allreduce                    init_process_group("gloo") from the torchrun variables and
                               all_reduce RANK+1 (the sum is ``allreduce`` in the JSON,
                               rewritten after the first record); a failure (--fail-rank)
                               comes after it, so torch prefixes its traceback ``[rankN]:``
--sigterm-race-rank R          rank R blocks SIGTERM, waits (at most 120 s) until the agent's
                               SIGTERM is pending, then exits with code 5 on its own: a
                               worker that fails by itself while the agent is stopping it
                               (--fail-rank fails only once rank R has blocked SIGTERM)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

VARS = (
    "RANK LOCAL_RANK GROUP_RANK ROLE_RANK ROLE_NAME WORLD_SIZE LOCAL_WORLD_SIZE GROUP_WORLD_SIZE "
    "ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS "
    "TORCHELASTIC_RUN_ID TORCHELASTIC_ERROR_FILE TORCHELASTIC_USE_AGENT_STORE OMP_NUM_THREADS PYTHONUNBUFFERED"
).split()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-times", type=int, default=-1)
    p.add_argument("--exit-code", type=int, default=None)
    p.add_argument("--message", default="injected failure")
    p.add_argument("--wait-for", default=None)
    p.add_argument("--child", action="store_true")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--steal-master-port", action="store_true")
    p.add_argument("--print", default=None)
    p.add_argument("--allreduce", action="store_true")
    p.add_argument("--sigterm-race-rank", type=int, default=None)
    args = p.parse_args()

    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    record = {k: os.environ.get(k) for k in VARS}
    record["pid"] = os.getpid()
    record["env"] = dict(os.environ)
    if args.sigterm_race_rank == rank:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if args.child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        record["child_pid"] = child.pid
    write_record(args.out, rank, record)
    if args.allreduce:
        record["allreduce"] = allreduce(rank, keep_group=args.fail_rank == rank)
        write_record(args.out, rank, record)

    if args.print:
        print(args.print, flush=True)
        print(f"err:{args.print}", file=sys.stderr, flush=True)
    if args.steal_master_port and rank == 0 and not os.path.exists(os.path.join(args.out, "stolen")):
        open(os.path.join(args.out, "stolen"), "w").close()
        steal_master_port()
    if args.sigterm_race_rank == rank:
        deadline = time.monotonic() + 120
        while signal.SIGTERM not in signal.sigpending():
            if time.monotonic() > deadline:
                return 9
            time.sleep(0.01)
        return 5
    if args.fail_rank == rank and (args.fail_times < 0 or restart < args.fail_times):
        if args.sigterm_race_rank is not None:  # fail only once that rank blocks SIGTERM (its record is written)
            deadline = time.monotonic() + 120
            while not glob.glob(os.path.join(args.out, f"{args.sigterm_race_rank}-*.json")):
                if time.monotonic() > deadline:
                    return 9
                time.sleep(0.01)
        if args.exit_code is not None:
            print(f"worker rank {rank}: {args.message}", file=sys.stderr, flush=True)
            return args.exit_code
        raise RuntimeError(args.message)
    if args.wait_for:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.wait_for):
            if time.monotonic() > deadline:
                return 9
            time.sleep(0.05)
    return 0


def write_record(out: str, rank: int, record: dict) -> None:
    """Write ``OUT/<RANK>-<pid>.json`` atomically."""
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, f".{rank}-{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out, f"{rank}-{os.getpid()}.json"))


def allreduce(rank: int, keep_group: bool = False) -> int:
    """Join the process group (env://, gloo) and return the sum of RANK+1 over all ranks.

    The group is destroyed afterwards unless ``keep_group`` (a rank about to fail keeps it, so
    torch prefixes its traceback with ``[rankN]:``); a rank that exits with the group still up
    while a peer is gone may abort in gloo's destructor, racing the failure under test.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    value = torch.tensor([rank + 1])
    dist.all_reduce(value)
    if not keep_group:
        dist.destroy_process_group()
    return int(value.item())


def steal_master_port() -> None:
    """Occupy MASTER_PORT, then start a c10d TCPStore server on it (fails: EADDRINUSE)."""
    from datetime import timedelta

    import torch.distributed as dist

    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    thief.bind(("", int(os.environ["MASTER_PORT"])))
    thief.listen(1)
    dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, True, timeout=timedelta(seconds=5))


if __name__ == "__main__":
    sys.exit(main())
