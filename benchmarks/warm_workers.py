"""Warm workers against cold starts: recovery time after a worker failure, and the memory a warm process holds.

    python -m benchmarks.warm_workers [--reps 3] [--nproc 2]

Runs ``rdzv-run --standalone --max-restarts 1`` with and without ``--warm-workers``, alternating, ``--reps``
times each. The workers (this file, run as a script) ``init_process_group`` (gloo); in the first attempt
they idle :data:`TRAIN_SECONDS` (training, while the next warm generation imports), then local rank 0 fails
after writing the time. Measured, per run:

* **recovery**: from local rank 0's failure to ``init_process_group`` returning in the new generation
  (slowest rank): detection, re-rendezvous, start, imports, process group;
* **first start**: from the launcher's start to ``init_process_group`` returning in the first generation;
* **warm process memory**: RSS and USS (psutil) of one idle warm process of the next generation, measured
  while the second generation runs (warm runs), next to a running worker's.

Prints one line per run and the medians as a Markdown table (docs/warm-workers.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

#: Seconds the first generation "trains" (idles) before local rank 0 fails.
TRAIN_SECONDS = 8.0


def _worker() -> None:
    """The benchmark's worker (run by rdzv-run)."""
    import torch.distributed as dist

    out, rank = os.environ["BENCH_OUT"], int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    ready = time.time()
    proc = psutil.Process()
    mem = proc.memory_full_info()
    with open(os.path.join(out, f".{rank}-{restart}"), "w") as f:
        json.dump({"init_done": ready, "pid": os.getpid(), "rss": mem.rss, "uss": mem.uss}, f)
    os.rename(os.path.join(out, f".{rank}-{restart}"), os.path.join(out, f"{rank}-{restart}.json"))
    if restart == 0:
        time.sleep(TRAIN_SECONDS)  # the round trains: the next warm generation imports meanwhile
    if restart == 0 and rank == 0:
        with open(os.path.join(out, ".failed_at"), "w") as f:
            f.write(repr(time.time()))
        os.rename(os.path.join(out, ".failed_at"), os.path.join(out, "failed_at"))
        os._exit(1)
    if restart > 0:
        gate = os.path.join(out, "gate")
        while not os.path.exists(gate):
            time.sleep(0.01)
    dist.destroy_process_group()


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark run stalled")
        time.sleep(0.02)


def _run(warm: bool, nproc: int) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix="warm-bench-")
    env = dict(os.environ, BENCH_OUT=out)
    argv = [sys.executable, "-m", "rdzv_agent.launch.launcher", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", "1", "--monitor-interval", "0.1", *(["--warm-workers"] if warm else []),
            os.path.abspath(__file__), "--worker"]
    start = time.time()
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        second = [os.path.join(out, f"{r}-1.json") for r in range(nproc)]
        _wait_for(lambda: all(os.path.exists(p) for p in second), 300)
        reports = {}
        for name in os.listdir(out):
            if name.endswith(".json") and not name.startswith("."):
                with open(os.path.join(out, name)) as f:
                    reports[name[:-5]] = json.load(f)
        workers = {r["pid"] for k, r in reports.items() if k.endswith("-1")}
        warm_mem = None
        if warm:
            def idle() -> list[psutil.Process]:
                return [p for p in psutil.Process(launcher.pid).children()
                        if p.pid not in workers and any(a.endswith("_warm_boot.py") for a in p.cmdline())]
            _wait_for(lambda: len(idle()) == nproc, 120)
            proc = idle()[0]
            _wait_for(lambda: proc.cpu_percent(0.2) < 5, 120)  # its imports done: idle on its socket
            warm_mem = proc.memory_full_info()
        with open(os.path.join(out, "failed_at")) as f:
            failed_at = float(f.read())
        open(os.path.join(out, "gate"), "w").close()
        if launcher.wait(120) != 0:
            raise RuntimeError("benchmark launcher failed")
    finally:
        if launcher.poll() is None:
            launcher.kill()
    result = {
        "recovery": max(reports[f"{r}-1"]["init_done"] for r in range(nproc)) - failed_at,
        "first_start": max(reports[f"{r}-0"]["init_done"] for r in range(nproc)) - start,
        "worker_rss": reports["0-1"]["rss"] / 2**20, "worker_uss": reports["0-1"]["uss"] / 2**20,
    }
    if warm_mem is not None:
        result.update(warm_rss=warm_mem.rss / 2**20, warm_uss=warm_mem.uss / 2**20)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker()
        return
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.reps):
        for warm in (False, True):
            result = _run(warm, args.nproc)
            runs[warm].append(result)
            print("warm" if warm else "cold", {k: round(v, 3) for k, v in result.items()}, flush=True)
    print("\n| | cold | warm |\n|---|---|---|")
    for key, unit in (("recovery", "s"), ("first_start", "s"), ("worker_rss", "MiB"), ("worker_uss", "MiB"),
                      ("warm_rss", "MiB"), ("warm_uss", "MiB")):
        cells = [f"{statistics.median(r[key] for r in runs[w]):.2f} {unit}" if key in runs[w][0] else "-"
                 for w in (False, True)]
        print(f"| {key} (median of {args.reps}) | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
