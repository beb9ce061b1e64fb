"""torchrun's per-worker options and worker-variable defaults, as torch 2.13 has them.

* :func:`local_world_size` -- ``--nproc-per-node`` (torch's ``determine_local_world_size``);
* :func:`python_exec` -- the workers' Python, ``PYTHON_EXEC`` (torch's ``config_from_args``);
* :func:`parse_signals` -- ``--signals-to-handle`` (torch's ``launcher.api`` / ``multiprocessing.api``);
* :func:`local_rank_env` -- ``LOCAL_RANK`` and ``--virtual-local-rank``'s ``CUDA_VISIBLE_DEVICES``
  (torch's ``LocalElasticAgent._set_local_rank_env``);
* :func:`torch_defaults` -- ``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default (torch's agent);
* :func:`numa_plan` / :func:`numa_argv` -- ``--numa-binding`` (``torch.numa.binding``).

docs/torchrun.md has the parity table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
from torch.distributed.run import determine_local_world_size
from torch.numa import binding as _numa

from rdzv_core.errors import ConfigError

__all__ = [
    "HandledSignals", "DEFAULT_SIGNALS", "SIGNALS_ENV", "NUMA_MODES", "local_world_size", "parse_signals",
    "local_rank_env", "torch_defaults", "python_exec", "PYTHON_EXEC_ENV", "check_virtual_local_rank", "numa_plan",
    "numa_argv",
]

#: torchrun's ``--signals-to-handle`` default and the variable its launcher sets from it.
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: torchrun's variable for the workers' Python.
PYTHON_EXEC_ENV = "PYTHON_EXEC"
#: ``--numa-binding`` policies (torch's ``AffinityMode`` values).
NUMA_MODES = tuple(mode.value for mode in _numa.AffinityMode)
_VISIBLE = "CUDA_VISIBLE_DEVICES"
_UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})


def local_world_size(text: str) -> int:
    """``--nproc-per-node``: an integer >= 1, ``cpu``, ``gpu``, ``xpu``, the PrivateUse1 backend's name or ``auto``.

    The names are torch's ``determine_local_world_size`` (``auto``: the accelerator
    count, else the CPUs this process may use). Unlike torch, 0 and negative
    numbers are refused.

    Raises:
        argparse.ArgumentTypeError: the reason (e.g. ``gpu`` without CUDA); argparse names the flag.
    """
    try:
        value = int(text)
    except ValueError:
        try:
            value = determine_local_world_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {exc} (expected a positive integer, auto, cpu, gpu, xpu or "
                f"{torch._C._get_privateuse1_backend_name()})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


@dataclass(frozen=True)
class HandledSignals:
    """``--signals-to-handle``: the text as given (for ``TORCHELASTIC_SIGNALS_TO_HANDLE``) and its signals."""

    text: str
    signals: tuple[signal.Signals, ...]


def parse_signals(text: str) -> HandledSignals:
    """``SIGTERM,SIGINT,...`` -> :class:`HandledSignals` (names as in :mod:`signal`, spaces allowed).

    torch logs a warning for a name it cannot register and goes on without it;
    here a bad name is an error.

    Raises:
        argparse.ArgumentTypeError: an empty list, an unknown name, or SIGKILL/SIGSTOP (cannot be handled).
    """
    found: list[signal.Signals] = []
    for name in (part.strip() for part in text.split(",")):
        sig = signal.Signals.__members__.get(name)
        if sig is None:
            raise argparse.ArgumentTypeError(f"{name!r} in {text!r} is not a signal name (e.g. SIGTERM,SIGUSR1)")
        if sig in _UNCATCHABLE:
            raise argparse.ArgumentTypeError(f"{name} cannot be handled")
        if sig not in found:
            found.append(sig)
    return HandledSignals(text, tuple(found))


def python_exec(environ: Mapping[str, str]) -> str:
    """The workers' Python: ``PYTHON_EXEC`` (a path, or a name looked up on PATH), else ``sys.executable``.

    torch's ``config_from_args`` (``os.getenv("PYTHON_EXEC", sys.executable)``).

    Raises:
        ConfigError: ``PYTHON_EXEC`` names no executable file (torch fails at each worker's start instead).
    """
    raw = environ.get(PYTHON_EXEC_ENV)
    if raw is None:
        return sys.executable
    program = raw if os.sep in raw else (shutil.which(raw, path=environ.get("PATH")) or raw)
    if not (os.path.isfile(program) and os.access(program, os.X_OK)):
        raise ConfigError(PYTHON_EXEC_ENV, raw, "not an executable file")
    return program


def check_virtual_local_rank(parent_env: Mapping[str, str], nproc_per_node: int) -> None:
    """With ``--virtual-local-rank``, every local rank needs a device in the parent's ``CUDA_VISIBLE_DEVICES``.

    torch raises this when it starts the workers; here it is checked at start-up.

    Raises:
        ConfigError: naming ``--virtual-local-rank`` and the variable's value.
    """
    visible = parent_env.get(_VISIBLE)
    if visible is not None and nproc_per_node > len(visible.split(",")):
        raise ConfigError("--virtual-local-rank", f"{_VISIBLE}={visible}",
                          f"{nproc_per_node} workers per node but only {len(visible.split(','))} devices listed")


def local_rank_env(parent_env: Mapping[str, str], local_rank: int, virtual: bool) -> dict[str, str]:
    """``LOCAL_RANK`` (and ``CUDA_VISIBLE_DEVICES``) for one worker: torch's ``_set_local_rank_env``.

    ``virtual`` (``--virtual-local-rank``): ``LOCAL_RANK=0`` and ``CUDA_VISIBLE_DEVICES`` is
    the worker's own device: item ``local_rank`` of the parent's list, or ``local_rank``
    if the parent has none. Otherwise ``LOCAL_RANK=local_rank`` and the parent's list is kept.
    """
    if not virtual:
        return {"LOCAL_RANK": str(local_rank)}
    visible = parent_env.get(_VISIBLE)
    device = visible.split(",")[local_rank].strip() if visible is not None else str(local_rank)
    return {"LOCAL_RANK": "0", _VISIBLE: device}


def torch_defaults(parent_env: Mapping[str, str]) -> dict[str, str]:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING``: the parent's, else ``1`` (torch's ``LocalElasticAgent._start_workers``)."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": parent_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


@contextlib.contextmanager
def _cpu_devices(nproc_per_node: int) -> Iterator[None]:
    """Without CUDA, torch's policies see one device per local rank, spread over the NUMA nodes in blocks.

    torch's ``binding`` finds a GPU's NUMA node from its PCI address; with no GPU
    local rank ``i`` of ``n`` gets node ``nodes[i * len(nodes) // n]`` (``nodes``: those with CPUs
    this process may use). The two
    device look-ups of ``torch.numa.binding`` are swapped for that while the plan
    is computed (once, at start-up, in the launcher's main thread).
    """
    nodes = sorted(n for n in _numa._get_systemwide_numa_node_indices()
                   if _numa._get_allowed_logical_cpu_indices_for_numa_node(numa_node_index=n))
    saved = _numa._get_gpu_count, _numa._get_numa_node_index_for_gpu_index

    def node_of(*, gpu_index: int) -> int:
        return nodes[gpu_index * len(nodes) // nproc_per_node]

    _numa._get_gpu_count, _numa._get_numa_node_index_for_gpu_index = (lambda: nproc_per_node), node_of
    try:
        yield
    finally:
        _numa._get_gpu_count, _numa._get_numa_node_index_for_gpu_index = saved


def numa_plan(mode: str, nproc_per_node: int) -> dict[int, frozenset[int]]:
    """``--numa-binding MODE``: local rank -> the logical CPUs its worker is bound to.

    torch's policies (``torch.numa.binding``: ``node``, ``socket``, ``exclusive``,
    ``core-complex``) choose the CPUs near the GPU whose index is the local rank;
    without CUDA, see :func:`_cpu_devices`. Computed at start-up, so that a binding
    that cannot be made is a usage error before anything runs (torch fails each
    worker's start instead).

    Raises:
        ConfigError: naming ``--numa-binding``: ``numactl`` is not on PATH, or the policy
            cannot bind every worker (e.g. ``exclusive`` with more workers than cores).
    """
    if shutil.which("numactl") is None:
        raise ConfigError("--numa-binding", mode, "needs the numactl program on PATH (e.g. apt-get install "
                          "numactl); none found")
    options = _numa.NumaOptions(affinity_mode=_numa.AffinityMode(mode))
    cuda = torch.cuda.is_available()
    plan: dict[int, frozenset[int]] = {}
    with contextlib.nullcontext() if cuda else _cpu_devices(nproc_per_node):
        for local_rank in range(nproc_per_node):
            try:
                cpus = _numa._get_validated_logical_cpus_to_bind_to(gpu_index=local_rank, numa_options=options)
            except (OSError, RuntimeError, ValueError, IndexError) as exc:
                raise ConfigError("--numa-binding", mode, f"cannot bind local rank {local_rank}: {exc}") from None
            plan[local_rank] = frozenset(cpus)
    return plan


def numa_argv(argv: Sequence[str], cpus: frozenset[int] | None) -> list[str]:
    """``argv`` under ``numactl --physcpubind=CPUS`` (torch's ``_assemble_numactl_command_args``), or as is."""
    if cpus is None:
        return list(argv)
    return list(_numa._assemble_numactl_command_args(original_command_args=tuple(argv), logical_cpu_indices=set(cpus)))
