"""A training script written for ``torchrun`` that uses torch elastic's hooks: ``@record``, the
file-based watchdog timer and the metrics API.

Used by ``tests/torchrun/test_torchrun_scripts.py`` to show it behaves the same under ``rdzv-run``.

* ``@record`` (``torch.distributed.elastic.multiprocessing.errors``) writes the worker's error file
  (``TORCHELASTIC_ERROR_FILE``) when ``main`` raises;
* with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` set for the launcher, each step runs under
  ``timer.expires(after=...)`` through ``FileTimerClient(TORCHELASTIC_TIMER_FILE)``: a step that
  overruns is killed by the launcher's timer server;
* ``torch.distributed.elastic.metrics.put_metric`` counts the steps into a handler that appends
  ``METRIC name value`` lines to ``--metrics-file``.

Options: ``--steps N``, ``--fail-rank R`` (rank R raises in its first attempt),
``--hang-rank R`` (rank R's second step sleeps past its timer scope in its first attempt),
``--metrics-file PATH``. Prints ``RESULT rank=R world_size=W attempt=A sum=S watchdog=0|1`` at the end, where
``S`` is the all-reduced sum of ``rank + 1`` over the steps.
"""

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic import metrics, timer
from torch.distributed.elastic.multiprocessing.errors import record

SCOPE = 2.0  # seconds a step may take


class FileMetricHandler(metrics.MetricHandler):
    def __init__(self, path):
        self.path = path

    def emit(self, metric_data):
        with open(self.path, "a") as f:
            f.write(f"METRIC {metric_data.group_name}.{metric_data.name} {metric_data.value}\n")


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--metrics-file", default=None)
    args = parser.parse_args()

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    watchdog = bool(os.environ.get("TORCHELASTIC_TIMER_FILE"))  # the launcher runs a timer server
    if watchdog:
        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    if args.metrics_file:
        metrics.configure(FileMetricHandler(f"{args.metrics_file}.{os.environ['RANK']}"), "train")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == args.fail_rank and attempt == 0:
        raise RuntimeError(f"injected failure on rank {rank}")
    total = 0.0
    for step in range(args.steps):
        with timer.expires(after=SCOPE) if watchdog else contextlib.nullcontext():
            if rank == args.hang_rank and attempt == 0 and step == 1:
                time.sleep(15 * SCOPE)  # overruns its scope: the watchdog kills this process
            value = torch.tensor([float(rank + 1)])
            dist.all_reduce(value)
            total += float(value)
        metrics.put_metric("steps", 1, "train")
    world = dist.get_world_size()
    line = f"RESULT rank={rank} world_size={world} attempt={attempt} sum={total:g} watchdog={int(watchdog)}"
    sys.stdout.write(line + "\n")  # one write: the ranks share the stream
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
