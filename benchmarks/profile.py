"""``python -m benchmarks.profile TARGET N [--idle] [--gil]`` — where one latency round spends its time.

Runs one latency round of ``TARGET`` (an rdzv backend or a PyTorch baseline)
with N agents, exactly as :mod:`benchmarks.run` does, while ``py-spy record``
samples every worker process (``pip install py-spy``). Prints the frames with
the most samples — *own* (the frame itself was running) and *inclusive* (the
frame was on the stack) — restricted to the project's and the clients' code.

* default: samples of threads that are running (CPU);
* ``--gil``: only samples of the thread holding the GIL — for many agent
  threads in one process, the GIL is the resource they queue for;
* ``--idle``: every thread, running or waiting — where agents *wait* (a
  backoff sleep, a watch, a network read), as a share of all agent-thread time.

Raw collapsed stacks are kept in ``--out`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .harness import LazyPool
from .run import RDZV_TARGETS, _target_spec
from .servers import Servers

__all__ = ["main", "summarise"]

#: Frames from these path fragments are reported (the rest is the interpreter's and libraries').
INTERESTING = ("rdzv_core/", "rdzv_backends/", "benchmarks/", "torch/distributed/", "etcd", "redis/", "grpc/",
               "urllib3/", "threading.py", "sqlite3", "time.sleep")


def summarise(paths: list[str], top: int = 25) -> str:
    """The ``top`` own and inclusive frames of py-spy raw (collapsed-stack) files, as text."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for path in paths:
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                if not stack or not count.isdigit():
                    continue
                n = int(count)
                total += n
                frames = [fr for fr in stack.split(";") if fr]
                if not frames:
                    continue
                own[frames[-1]] += n
                for fr in set(frames):
                    incl[fr] += n
    if total == 0:
        return "no samples\n"
    out = [f"{total} samples", "", "own (frame running):"]
    out += [f"  {100 * n / total:5.1f}%  {fr}" for fr, n in own.most_common(top)]
    out += ["", "inclusive (frame on the stack), project and client code:"]
    shown = 0
    for fr, n in incl.most_common():
        if any(key in fr for key in INTERESTING) and "benchmarks/agents.py" not in fr:
            out.append(f"  {100 * n / total:5.1f}%  {fr}")
            shown += 1
            if shown >= top:
                break
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("target", help=", ".join(RDZV_TARGETS) + ", torch:c10d, torch:etcd-v2 or torch:etcd")
    p.add_argument("n", type=int, help="agents")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--limit", type=float, default=120.0, help="seconds the round may take")
    p.add_argument("--client-mode", default=None, choices=("shared", "per-agent"))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gil", action="store_true", help="only the GIL holder's samples")
    mode.add_argument("--idle", action="store_true", help="include waiting threads")
    p.add_argument("--rate", type=int, default=100, help="samples per second")
    p.add_argument("--out", help="directory for the raw stacks (default: a temporary one)")
    args = p.parse_args(argv)
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="rdzv-profile-")
    os.makedirs(out, exist_ok=True)
    servers = Servers([args.target])
    client_mode = args.client_mode or ("per-agent" if args.target == "redis" else "shared")
    pools = LazyPool(_target_spec(args.target, servers, client_mode), 1 if args.target == "memory" else args.procs)
    try:
        pool = pools.get()
        pool.setup(args.n, min_nodes=args.n, max_nodes=args.n, timeout=args.limit, last_call_timeout=1.0,
                   keep_alive_ttl=5.0)
        flags = ["--gil"] if args.gil else ["--idle"] if args.idle else []
        spies, paths = [], []
        for i, proc in enumerate(pool.processes):
            path = os.path.join(out, f"worker{i}.raw")
            paths.append(path)
            spies.append(subprocess.Popen([spy, "record", "-p", str(proc.pid), "-f", "raw", "-r", str(args.rate),
                                           "-o", path, "--nonblocking", *flags],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches asynchronously; a round that starts earlier loses its first samples
        started = time.monotonic()
        t0, agents, _ = pool.round(args.limit)
        elapsed = time.monotonic() - started
        for s in spies:
            s.send_signal(signal.SIGINT)
        for s in spies:
            s.wait(60)
        done = [a for a in agents if "t_done" in a and "error" not in a]
        print(f"{args.target} N={args.n}: {len(done)}/{len(agents)} agents done; round {elapsed:.2f} s")
        print(summarise([pth for pth in paths if os.path.exists(pth)]))
        print(f"raw stacks: {out}")
    finally:
        pools.kill()
        servers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
