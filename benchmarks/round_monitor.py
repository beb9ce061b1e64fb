"""``python -m benchmarks.round_monitor URL [--prefix bench] [--every 1]`` -- one line per look at the newest run.

Prints, for the newest run under ``PREFIX/`` on the backend at ``URL`` (a base URL, e.g.
``etcd-v3://127.0.0.1:2379/``): seconds since start, the round record's status and version, the join and
confirmation tickets taken and the keep-alive keys present. One client, one look per ``--every`` seconds: a
timeline of where a large benchmark round stalls (docs/benchmarks.md, "One client per agent"). Ends on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import time

from rdzv_core import open_backend
from rdzv_core.errors import RdzvError
from rdzv_core.rendezvous import RunKeys


def look(kv, prefix: str) -> str | None:
    """The newest run's state as one line, ``None`` if there is no run under ``prefix``."""
    records = [e for e in kv.list(prefix + "/")[0] if e.key.endswith("/state/round")]
    if not records:
        return None
    entry = max(records, key=lambda e: e.revision)
    record = json.loads(entry.value)
    run_id = entry.key.split("/")[-3][len("run_"):]
    keys = RunKeys(prefix, run_id)
    version, rid = record.get("version"), record.get("id")
    if not version:
        return f"{record.get('status')}"
    joined, confirmed = kv.tickets(keys.joined(version, rid)), kv.tickets(keys.confirmed(version, rid))
    alive = len(kv.list(keys.alive_dir(version, rid))[0])
    return (f"{record.get('status')} v={version} participants={record.get('participants')} joined={joined} "
            f"confirmed={confirmed} alive={alive}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.round_monitor", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="backend base URL, e.g. etcd-v3://127.0.0.1:2379/")
    parser.add_argument("--prefix", default="bench", help="rendezvous key prefix (the benchmark's: bench)")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between looks")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with open_backend(args.url) as kv:
        while True:
            try:
                line = look(kv, args.prefix)
            except (RdzvError, ValueError) as exc:
                line = f"error {type(exc).__name__}: {exc}"[:200]
            print(f"{time.monotonic() - started:7.1f} {line or '-'}", flush=True)
            time.sleep(args.every)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
