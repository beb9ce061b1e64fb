"""What the agents of one round agree on through the round's store: worker ranks and the exit barrier.

Both follow torch's agent (``torch.distributed.elastic.agent.server.api``), with its
keys and value formats, so the numbers are the ones torchrun gives:

* :func:`assign_ranks` -- torch's ``_assign_worker_ranks``: every agent publishes
  ``(role, group rank, local world size)``; group rank 0 reads them all and writes
  each agent's ``[base global rank, world size, base role rank, role world size]``;
  global ranks follow group rank order, then local rank, so nodes may run
  different numbers of workers (``--nproc-per-node``). O(1) per agent, O(N) on rank 0.
* :func:`exit_barrier` -- torch's ``_exit_barrier`` (``store_util.barrier``): an agent
  whose workers succeeded counts itself in (under torch's key prefix, which tells
  rdzv's handler the member finished) and waits until every agent of the round
  has, at most ``timeout`` seconds. Unlike torch's it also ends as soon as
  ``should_leave()`` is true (the round is gone: another member failed and the others
  re-form), instead of holding the node for the whole timeout, and it outlasts a
  backend restart.

Every wait on the store is cut into slices; between slices ``should_leave()`` is asked,
so an agent never blocks on a round that no longer exists.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

from torch.distributed import DistError

from rdzv_core.errors import RdzvError

__all__ = ["RoundGone", "SetupTimeout", "wait_keys", "wait_values", "assign_ranks", "exit_barrier", "BARRIER_PREFIX",
           "COMPLETE", "LEFT", "TIMED_OUT", "UNREACHABLE"]

#: torch's keys (``_TERMINAL_STATE_SYNC_ID``, ``_assign_worker_ranks``'s prefixes).
BARRIER_PREFIX = "torchelastic/agent/terminal_state"
ROLE_INFO_PREFIX = "torchelastic/role_info/"
ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"

#: :func:`exit_barrier` outcomes.
COMPLETE, LEFT, TIMED_OUT, UNREACHABLE = "complete", "left", "timeout", "unreachable"


#: Seconds between two writes of an agent's own key while it waits at the exit barrier.
BARRIER_REASSERT = 5.0


class RoundGone(Exception):
    """The round ended (``should_leave()``) while the agent waited on its store: re-rendezvous."""


class SetupTimeout(Exception):
    """The keys did not appear in the round's store within the deadline (an agent of the round vanished)."""


def wait_keys(store: Any, keys: Sequence[str], deadline: float, poll: float | None,
              should_leave: Callable[[], bool]) -> None:
    """Wait until every key in ``keys`` is set in the c10d ``store``.

    Args:
        deadline: ``time.monotonic()`` value to give up at.
        poll: seconds per wait slice (> 0); ``should_leave()`` is called after each empty slice.
            ``None``: one wait until the deadline (a store hosted by a node that leaves once the
            keys are set, torch's static rendezvous: a later slice would find it gone).

    Raises:
        RoundGone: ``should_leave()`` returned true.
        SetupTimeout: not all set by ``deadline``.
    """
    while True:
        started = time.monotonic()
        remaining = deadline - started
        slice_s = max(0.001, remaining if poll is None else min(poll, remaining))
        try:
            store.wait(list(keys), datetime.timedelta(seconds=slice_s))
            return
        except (DistError, RdzvError) as exc:  # a slice ran out (or the backend failed): look around
            if poll is not None and should_leave():
                raise RoundGone(f"the round ended while waiting for {list(keys)[:3]} in its store") from exc
            if poll is None or time.monotonic() >= deadline:
                raise SetupTimeout(f"store keys {list(keys)[:3]} not set in time: {exc}") from exc
            early = slice_s - (time.monotonic() - started)  # a backend that refuses at once: no busy loop
            if early > 0:
                time.sleep(min(early, max(0.0, deadline - time.monotonic())))


def wait_values(store: Any, keys: Sequence[str], deadline: float, poll: float | None,
                should_leave: Callable[[], bool]) -> list[bytes]:
    """The values of ``keys`` once all are set (:func:`wait_keys`, then one ``multi_get``).

    Raises:
        RoundGone, SetupTimeout: see :func:`wait_keys`.
    """
    wait_keys(store, keys, deadline, poll, should_leave)
    return list(store.multi_get(list(keys)))


def assign_ranks(store: Any, role: str, group_rank: int, group_world_size: int, local_world_size: int,
                 deadline: float, poll: float | None, should_leave: Callable[[], bool]) -> tuple[int, int, int, int]:
    """``(base global rank, world size, base role rank, role world size)`` of this agent's workers.

    torch's algorithm and keys (module docstring); with ``TORCH_ELASTIC_WORKER_IDENTICAL=1``
    (torch's fast path: every node runs the same workers) nothing is exchanged.

    Raises:
        RoundGone, SetupTimeout: see :func:`wait_values`.
    """
    if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
        base = group_rank * local_world_size
        world = group_world_size * local_world_size
        return base, world, base, world
    info = {"role": role, "rank": group_rank, "local_world_size": local_world_size}
    store.set(f"{ROLE_INFO_PREFIX}{group_rank}", json.dumps(info).encode("utf-8"))
    if group_rank == 0:
        raw = wait_values(store, [f"{ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)], deadline, poll,
                          should_leave)
        infos = [json.loads(bytes(r).decode("utf-8")) for r in raw]
        role_sizes: dict[str, int] = defaultdict(int)
        for i in infos:
            role_sizes[i["role"]] += int(i["local_world_size"])
        world = sum(role_sizes.values())
        base, role_bases = 0, defaultdict[str, int](int)
        keys, values = [], []
        for i, member in enumerate(infos):
            keys.append(f"{ASSIGNED_RANKS_PREFIX}{i}")
            values.append(json.dumps([base, world, role_bases[member["role"]], role_sizes[member["role"]]]))
            base += int(member["local_world_size"])
            role_bases[member["role"]] += int(member["local_world_size"])
        store.multi_set(keys, values)
    mine = wait_values(store, [f"{ASSIGNED_RANKS_PREFIX}{group_rank}"], deadline, poll, should_leave)[0]
    base, world, role_base, role_world = json.loads(bytes(mine).decode("utf-8"))
    return int(base), int(world), int(role_base), int(role_world)


def exit_barrier(store: Any, group_rank: int, group_world_size: int, timeout: float, poll: float | None,
                 should_leave: Callable[[], bool]) -> str:
    """Count this agent in and wait for the round's other agents, at most ``timeout`` seconds.

    Each agent sets its own key ``BARRIER_PREFIX/arrived/GROUP_RANK`` (torch counts
    with ``add``, which a retry after a lost answer could count twice) and waits for
    all of them; backend errors are retried within the timeout, so a backend restart
    at the end of the job is waited out (torch's barrier logs them and gives up). The
    key is set again every :data:`BARRIER_REASSERT` seconds of waiting, so a backend
    restarted without its data loses no arrival.

    Returns:
        :data:`COMPLETE` (every agent of the round arrived), :data:`LEFT`
        (``should_leave()``: the round ended, its other members re-form),
        :data:`TIMED_OUT` (``timeout`` seconds passed first) or :data:`UNREACHABLE` (they passed while the
        store failed: whether the others finished is unknown).
    """
    if group_world_size <= 1:
        return COMPLETE
    deadline = time.monotonic() + timeout
    keys = [f"{BARRIER_PREFIX}/arrived/{r}" for r in range(group_world_size)]
    while True:  # set our key, wait a while; set it again (a backend that lost its keys), wait again
        try:
            store.set(keys[group_rank], b"1")
        except (DistError, RdzvError):
            if should_leave():
                return LEFT
            if time.monotonic() >= deadline:
                return UNREACHABLE
            time.sleep(min(poll or 0.5, max(0.0, deadline - time.monotonic())))
            continue
        until = deadline if poll is None else min(deadline, time.monotonic() + BARRIER_REASSERT)
        try:
            wait_keys(store, keys, until, poll, should_leave)
        except RoundGone:
            return LEFT
        except SetupTimeout:
            if time.monotonic() >= deadline:
                return TIMED_OUT
            continue
        break
    return COMPLETE
