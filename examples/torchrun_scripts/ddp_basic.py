"""PyTorch's "Getting Started with DDP" ``elastic_ddp.py``, CPU/gloo variant, unchanged in spirit.

Written for ``torchrun`` (it reads only the variables torchrun sets) and used by
``tests/torchrun/test_torchrun_scripts.py`` to show it runs the same under ``rdzv-run``. Differences from
the tutorial: gloo on the CPU instead of the accelerator, a fixed seed, a few steps of synthetic
data, the DDP model freed before ``destroy_process_group`` (see there), and one machine-readable line
per rank at the end::

    RESULT rank=R world_size=W loss=L checksum=C

``checksum`` is the sum of the trained parameters (equal on every rank: DDP keeps them in step).
"""


import gc
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(steps=5):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=generator))
        labels = torch.randn(20, 5, generator=generator)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    line = f"RESULT rank={rank} world_size={dist.get_world_size()} loss={loss.item():.6f} checksum={checksum:.9f}"
    sys.stdout.write(line + "\n")  # one write: the ranks share the stream
    sys.stdout.flush()
    # Free DDP (its reducer holds the process group) before destroying the group, so gloo's worker
    # threads are joined now and not at interpreter exit, where they may abort the process
    # ("terminate called without an active exception", SIGABRT after the last line: 2 of 17 runs
    # under rdzv-run and 1 of 5 under torchrun at load 11; pytorch#190489).
    del ddp_model, optimizer
    gc.collect()
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    demo_basic()
