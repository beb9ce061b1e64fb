"""Elastic data-parallel training of a small digit classifier: the project's main example.

A 64 -> 128 -> 10 MLP learns scikit-learn's bundled handwritten-digits data set
(``sklearn.datasets.load_digits()``: 1,797 8x8 images, shipped inside scikit-learn, no download)
with ``DistributedDataParallel`` over the gloo backend on CPU.  The job checkpoints every epoch
and, after any restart, resumes from the last checkpoint -- also when the world size changed,
because the model state does not depend on it and the data is re-sharded on each start.

Usage::

    rdzv-run --standalone --nproc-per-node 2 examples/train_digits.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_digits.py
    python examples/train_digits.py              # one process, no process group

The process group is initialised from the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; ``init_method="env://"``) with a short timeout
(``--pg-timeout``, 60 s) so a dead peer fails the job quickly.  Without ``WORLD_SIZE`` the script
trains in a single process and creates no process group.

Data: a fixed-seed, stratified 80/20 train/held-out split; features are standardised with the
training statistics.  The training set is sharded by ``RANK``/``WORLD_SIZE`` with a
``DistributedSampler`` (``set_epoch`` every epoch).  ``--batch-size`` is the *global* batch size;
each worker takes ``ceil(batch_size / world_size)`` samples per step, so the optimisation barely
changes when the world size does.

Checkpoint: rank 0 writes ``{"model", "optimizer", "epoch", ...}`` after every epoch, atomically
(temporary file in the same directory, fsync, ``os.replace``).  ``epoch`` counts *completed*
epochs.  On start, rank 0 reads the checkpoint (if any) and broadcasts it, so every rank resumes
from the same epoch.  Default path (``--checkpoint``)::

    <tempdir>/rdzv-train-digits/<TORCHELASTIC_RUN_ID>/checkpoint.pt   # under a launcher
    <tempdir>/rdzv-train-digits/local/checkpoint.pt                   # TORCHELASTIC_RUN_ID unset

``<tempdir>`` is ``tempfile.gettempdir()``.  ``--standalone`` draws a fresh run id per launch, so
the bare command starts from scratch every time while restarts *within* a run resume; launching
twice with the same ``--rdzv-id`` continues the same job (a finished checkpoint just evaluates
again).  Across hosts, pass a ``--checkpoint`` on storage that every host sees.

Fault injection, for tests:

``--fail-at-epoch E --fail-rank R``
    Worker ``R`` exits with code 3 (message on stderr) at the start of epoch ``E`` (counted from
    1, as in the progress lines) -- only on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or
    unset), or on every attempt with ``--fail-always``.
``--epoch-sleep S``
    Sleep ``S`` seconds per epoch, leaving time to kill a node mid-training.

Machine-readable lines on rank 0's stdout, in this order (one value per line, nothing else on it):

``WORLD_SIZE_SEEN <n>``
    Once per (re)start: the world size of this attempt.
``RESUMED_FROM_EPOCH <k>``
    Once per (re)start: completed epochs read from the checkpoint (0 when starting fresh).
``epoch <e>/<N> world_size=<n> loss=<x.xxxx>``
    After each epoch: the 1-based epoch, the target, the world size and the mean training loss
    over all ranks.
``accuracy=<a.aaaa>``
    Held-out accuracy with 4 decimals; always the LAST line rank 0 prints.

Exit codes: 0 on success, 2 for bad arguments, 3 for an injected failure.

Caveat with torch's own launcher (torch 2.13): by default ``torchrun``'s c10d rendezvous shares
its TCPStore with the workers and keeps it across restarts, so after a restart gloo can read the
*previous* attempt's peer addresses and fail in ``connectFullMesh`` with "Connection refused"
(pytorch/pytorch#135712).  To exercise restarts under ``torchrun``, set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the launcher's environment::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 --max-restarts 1 examples/train_digits.py --fail-at-epoch 2 --fail-rank 1
"""

from __future__ import annotations

import argparse
import gc
import glob
import math
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SPLIT_SEED = 0
"""Seed of the train/held-out split, the model initialisation and the sampler shuffle."""

CHECKPOINT_FORMAT = 1
"""Version of the checkpoint dictionary; a checkpoint with another version is refused."""

INJECTED_FAILURE_EXIT_CODE = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line; bad values exit with status 2 and name the option."""
    parser = argparse.ArgumentParser(
        description="Elastic DDP training of an MLP on scikit-learn's digits (gloo, CPU).",
    )
    parser.add_argument("--epochs", type=int, default=20, help="epochs to train (default 20)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument(
        "--batch-size", type=int, default=64,
        help="global batch size, split over the workers (default 64)",
    )
    parser.add_argument(
        "--checkpoint", default=None,
        help="checkpoint path (default: <tempdir>/rdzv-train-digits/<TORCHELASTIC_RUN_ID or "
             "'local'>/checkpoint.pt)",
    )
    parser.add_argument(
        "--pg-timeout", type=float, default=60.0,
        help="process-group timeout in seconds (default 60)",
    )
    parser.add_argument(
        "--fail-at-epoch", type=int, default=None,
        help="inject a failure (exit code 3) at the start of this 1-based epoch",
    )
    parser.add_argument(
        "--fail-rank", type=int, default=0, help="rank that fails (default 0)",
    )
    parser.add_argument(
        "--fail-always", action="store_true",
        help="fail on every attempt, not only when TORCHELASTIC_RESTART_COUNT is 0",
    )
    parser.add_argument(
        "--epoch-sleep", type=float, default=0.0, help="seconds to sleep per epoch (default 0)",
    )
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive finite number, got {args.lr}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (args.pg_timeout > 0 and math.isfinite(args.pg_timeout)):
        parser.error(f"--pg-timeout must be a positive finite number of seconds, got {args.pg_timeout}")
    if args.fail_at_epoch is not None and args.fail_at_epoch < 1:
        parser.error(f"--fail-at-epoch must be >= 1, got {args.fail_at_epoch}")
    if args.fail_rank < 0:
        parser.error(f"--fail-rank must be >= 0, got {args.fail_rank}")
    if not (args.epoch_sleep >= 0 and math.isfinite(args.epoch_sleep)):
        parser.error(f"--epoch-sleep must be a finite number of seconds >= 0, got {args.epoch_sleep}")
    return args


def default_checkpoint_path() -> str:
    """Return the default checkpoint path, keyed by ``TORCHELASTIC_RUN_ID`` (``local`` if unset)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    safe_run_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id).lstrip(".")
    return os.path.join(
        tempfile.gettempdir(), "rdzv-train-digits", safe_run_id or "local", "checkpoint.pt",
    )


def load_data() -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """Return the standardised training set and the held-out features and labels.

    The split is stratified 80/20 with a fixed seed, so every rank and every restart sees the
    same partition; the scaler is fitted on the training part only.
    """
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.2, stratify=digits.target,
        random_state=SPLIT_SEED,
    )
    scaler = StandardScaler().fit(x_train)
    train = TensorDataset(
        torch.from_numpy(scaler.transform(x_train).astype(np.float32)),
        torch.from_numpy(y_train.astype(np.int64)),
    )
    x_held = torch.from_numpy(scaler.transform(x_test).astype(np.float32))
    y_held = torch.from_numpy(y_test.astype(np.int64))
    return train, x_held, y_held


def build_model() -> nn.Module:
    """Return the 64 -> 128 -> 10 MLP, initialised from ``SPLIT_SEED``."""
    torch.manual_seed(SPLIT_SEED)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: temporary file, fsync, ``os.replace``.

    A reader sees either the previous checkpoint or the new one, never a torn file.
    """
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass
        raise


def remove_stale_temporaries(path: str) -> None:
    """Delete temporary files that a writer killed mid-``save_checkpoint`` left next to ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.tmp")):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass


def read_checkpoint(path: str) -> dict[str, Any] | None:
    """Return the checkpoint at ``path``, or None if there is none.

    Raises:
        RuntimeError: the file exists but has another ``CHECKPOINT_FORMAT``.
    """
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise RuntimeError(
            f"checkpoint {path!r} has format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}"
        )
    return state


def load_shared_checkpoint(path: str, rank: int, distributed: bool) -> dict[str, Any] | None:
    """Read the checkpoint on rank 0 and broadcast it, so every rank resumes from the same epoch."""
    state = None
    if rank == 0:
        remove_stale_temporaries(path)  # only rank 0 writes, and no attempt is writing now
        state = read_checkpoint(path)
    if distributed:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def maybe_inject_failure(args: argparse.Namespace, epoch: int, rank: int) -> None:
    """Exit with code 3 if this rank is told to fail at the start of this 1-based ``epoch``."""
    if args.fail_at_epoch != epoch or args.fail_rank != rank:
        return
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart_count != 0 and not args.fail_always:
        return
    print(
        f"train_digits: injected failure: rank {rank} exits with code "
        f"{INJECTED_FAILURE_EXIT_CODE} at the start of epoch {epoch} "
        f"(TORCHELASTIC_RESTART_COUNT={restart_count})",
        file=sys.stderr, flush=True,
    )
    sys.exit(INJECTED_FAILURE_EXIT_CODE)


def train_epoch(
    model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, distributed: bool,
) -> float:
    """Train one epoch on this rank's shard; return the mean loss over all ranks' samples."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    totals = torch.zeros(2, dtype=torch.float64)  # [sum of sample losses, sample count]
    for features, labels in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(features), labels)
        loss.backward()
        optimizer.step()
        totals += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
    if distributed:
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])


@torch.no_grad()
def accuracy(model: nn.Module, features: torch.Tensor, labels: torch.Tensor) -> float:
    """Return the fraction of ``features`` that ``model`` labels correctly."""
    model.eval()
    return float((model(features).argmax(dim=1) == labels).float().mean())


def main(argv: list[str] | None = None) -> int:
    """Train, checkpoint every epoch, evaluate on rank 0; return the exit status (0)."""
    args = parse_args(argv)
    checkpoint_path = args.checkpoint or default_checkpoint_path()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1
    torch.set_num_threads(1)  # workers share few cores; one thread each avoids oversubscription

    train_set, x_held, y_held = load_data()
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = load_shared_checkpoint(checkpoint_path, rank, distributed)
    start_epoch = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = int(state["epoch"])
    if rank == 0:
        print(f"WORLD_SIZE_SEEN {world_size}", flush=True)
        print(f"RESUMED_FROM_EPOCH {start_epoch}", flush=True)

    ddp_model: nn.Module = DistributedDataParallel(model) if distributed else model
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=SPLIT_SEED,
    )
    loader = DataLoader(
        train_set, batch_size=math.ceil(args.batch_size / world_size), sampler=sampler,
    )

    for epoch in range(start_epoch, args.epochs):
        maybe_inject_failure(args, epoch + 1, rank)
        sampler.set_epoch(epoch)
        loss = train_epoch(ddp_model, loader, optimizer, distributed)
        if args.epoch_sleep:
            time.sleep(args.epoch_sleep)
        if rank == 0:
            save_checkpoint(checkpoint_path, {
                "format": CHECKPOINT_FORMAT,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
                "world_size": world_size,
            })
            print(f"epoch {epoch + 1}/{args.epochs} world_size={world_size} loss={loss:.4f}",
                  flush=True)

    held_out_accuracy = accuracy(model, x_held, y_held) if rank == 0 else None
    if distributed:
        dist.barrier()  # no rank leaves while rank 0 may still write its last checkpoint
        # DDP's reducer holds the process group: free it first, so gloo's threads are joined here and
        # not at interpreter exit, where they may abort the process (SIGABRT; pytorch#190489).
        del ddp_model
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        print(f"accuracy={held_out_accuracy:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
