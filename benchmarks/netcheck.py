"""What the network check of a round costs: seconds from the round going final to each node's verdict.

``python -m benchmarks.netcheck --nodes 3 8 32 [--mib 4] [--repeat 1]``: for each N, N handlers
(``rdzv_core.create_handler``) in threads of this process over ``file://`` in a temporary directory, their
listeners on loopback, form a round (``next_round``) and run the check (``rdzv_core.torch_api.netcheck``)
with the default settings; prints one row per N: the median and slowest node's check time, the median link
rate, the outliers found, how often the links were measured (2x: a node looked slow and was measured again).
One process and the GIL: the transfers share this process's cores, so the times are an upper bound of the
check's cost on real hosts, where each node sends and receives on its own link. docs/benchmarks.md
("Network check") has the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid

from rdzv_core import create_handler
from rdzv_core.torch_api.netcheck import NetcheckSettings, Verdict, check_round


def measure(nodes: int, mib: float, base: str) -> list[Verdict]:
    """One round of ``nodes`` handlers over the ``file://`` URL ``base`` and its check; every node's verdict.

    Raises:
        RuntimeError: a node did not form the round or check it (its error as the cause).
    """
    run_id = f"nc{uuid.uuid4().hex[:8]}"
    url = (f"{base}{run_id}?min_nodes={nodes}&max_nodes={nodes}&last_call_timeout=1&keep_alive_ttl=10"
           f"&timeout=300&network_check=1&network_check_mib={mib}")
    settings = NetcheckSettings(enabled=True, mib=mib)
    handlers = [create_handler(url, local_addr="127.0.0.1", node_name=f"n{i}") for i in range(nodes)]
    out: list[Verdict | BaseException | None] = [None] * nodes

    def node(i: int) -> None:
        rdzv = handlers[i].rendezvous  # type: ignore[attr-defined]
        try:
            out[i] = check_round(rdzv, rdzv.next_round(), settings, "127.0.0.1")
        except BaseException as exc:  # reported below
            out[i] = exc

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for h in handlers:
        h.shutdown()
    bad = [v for v in out if not isinstance(v, Verdict)]
    if bad:
        raise RuntimeError(f"{len(bad)} of {nodes} nodes had no verdict: {bad[0]!r}")
    return [v for v in out if isinstance(v, Verdict)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.netcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[3, 8, 32], help="round sizes (default 3 8 32)")
    p.add_argument("--mib", type=float, default=4.0, help="MiB per link (default 4, the check's default)")
    p.add_argument("--repeat", type=int, default=1, help="rounds per size (default 1)")
    args = p.parse_args(argv)
    print(f"network check, {args.mib:g} MiB per link, handlers in threads over file:// on loopback")
    print(f"{'nodes':>5} {'median s':>9} {'slowest s':>10} {'median rate':>14} {'outliers':>9} {'measured':>9} "
          f"{'wall s':>7}")
    with tempfile.TemporaryDirectory(prefix="rdzv-netcheck-") as tmp:
        for n in args.nodes:
            for _ in range(args.repeat):
                began = time.monotonic()
                verdicts = measure(n, args.mib, f"file://{tmp}/")
                wall = time.monotonic() - began
                seconds = [v.seconds for v in verdicts]
                rate = statistics.median(v.median for v in verdicts) / 2**20
                found = max(len(v.outliers) for v in verdicts)
                times = max(v.attempts for v in verdicts)
                print(f"{n:>5} {statistics.median(seconds):>9.2f} {max(seconds):>10.2f} {rate:>9.0f} MiB/s "
                      f"{found:>9} {times:>8}x {wall:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
