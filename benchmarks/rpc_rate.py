"""``python -m benchmarks.rpc_rate TARGET MODE THREADS CALLS`` — the backend request rate one process reaches.

THREADS threads of this process each make CALLS ``get`` calls of a key of their own (so nothing is
coalesced), with one backend client shared by all threads (MODE ``shared``) or one client per thread
(``per-agent``), against a server started as :mod:`benchmarks.run` starts it. Prints the wall time,
requests per second, the 50th/99th percentile latency, and the CPU seconds of this process and of the
server: what one request costs the client, independent of the rendezvous (docs/benchmarks.md, "One
client per agent").
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from rdzv_core import KVBackend, open_backend

from .servers import Servers

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rpc_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=("redis", "etcd-v2", "etcd-v3"))
    p.add_argument("mode", choices=("shared", "per-agent"))
    p.add_argument("threads", type=int)
    p.add_argument("calls", type=int, help="get calls per thread")
    args = p.parse_args(argv)
    if args.threads < 1 or args.calls < 1:
        p.error(f"threads and calls must be >= 1, got {args.threads} and {args.calls}")
    servers = Servers([args.target])
    try:
        url = servers.rdzv_url(args.target, "rpc-rate")
        shared = open_backend(url) if args.mode == "shared" else None
        clients: list[KVBackend] = [shared or open_backend(url) for _ in range(args.threads)]
        for c in clients:  # every connection made before the clock starts
            c.get("rpc-rate/warm")
        latencies: list[float] = []
        go = threading.Event()

        def run(kv: KVBackend, i: int) -> None:
            go.wait()
            for _ in range(args.calls):
                t = time.monotonic()
                kv.get(f"rpc-rate/k{i}")
                latencies.append(time.monotonic() - t)

        threads = [threading.Thread(target=run, args=(c, i)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        cpu, server_cpu, started = os.times(), servers.cpu_seconds(args.target), time.monotonic()
        go.set()
        for t in threads:
            t.join()
        wall, after, server_after = time.monotonic() - started, os.times(), servers.cpu_seconds(args.target)
        latencies.sort()
        calls = len(latencies)
        client = after.user - cpu.user + after.system - cpu.system
        server = None if server_cpu is None or server_after is None else server_after - server_cpu
        print(f"{args.target} {args.mode} threads={args.threads} calls={calls}: wall {wall:.2f} s, "
              f"{calls / wall:.0f} requests/s, p50 {1e3 * latencies[calls // 2]:.1f} ms, "
              f"p99 {1e3 * latencies[int(calls * 0.99)]:.1f} ms, client CPU {client:.2f} s "
              f"({1e3 * client / calls:.2f} ms/request), server CPU "
              f"{'?' if server is None else f'{server:.2f}'} s")
        for c in set(clients):
            c.close()
    finally:
        servers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
