"""The parent side of the latency benchmark: a pool of worker processes per target.

A :class:`WorkerPool` spawns ``procs`` worker processes (``spawn`` start method:
no gRPC channel or SQLite connection crosses a ``fork``) for one target and
keeps them for every N of that target. One *round* (:meth:`WorkerPool.round`):

1. every worker builds its agents for a fresh run id and starts one thread per
   agent, all blocked;
2. the parent reads ``time.monotonic()`` (``t0``) and sets one
   ``multiprocessing.Event`` — the start barrier — which releases every thread
   of every worker at once;
3. each agent records when it held its rank (``t_rank``) and when
   ``next_rendezvous`` returned (``t_done``);
4. latency = ``max(t_done) - t0``: until *every* agent holds its rank and
   MASTER_ADDR/PORT.

A round that has not finished ``limit`` seconds after ``t0`` is a timeout: the
workers report which agents finished (and every agent's counts so far); agents
still running are marked ``unfinished`` and the caller kills the pool (this
pool's own processes, by object) and records the timeout with its N. A worker
that does not even report within :data:`REPORT_GRACE` seconds more raises
:class:`CellTimeout` (the pool is killed).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from typing import Any, Callable

from .agents import worker_main

__all__ = ["WorkerPool", "LazyPool", "CellTimeout", "check_ranks", "split"]

#: Start events made per pool (each round uses the next one).
MAX_EVENTS = 64
#: Seconds a worker may take to start (import torch, open its client).
START_LIMIT = 120.0
#: Seconds after a round's limit for the workers' (partial) reports to arrive.
REPORT_GRACE = 30.0


class CellTimeout(Exception):
    """A round did not finish within its limit (the pool is dead afterwards)."""


class WorkerPool:
    """``procs`` worker processes for one target.

    Args:
        target: ``{"kind": "rdzv"|"torch", "name": ..., "url"|"torch_backend"+"endpoint": ...}``.
        procs: worker processes (``memory`` needs 1: its keyspace is per process).
        entry: the workers' entry point ``(conn, events, target)``; it answers
            ``("hello", None)`` once ready (default: :func:`benchmarks.agents.worker_main`).

    Raises:
        RuntimeError: a worker failed to start (with its traceback).
    """

    def __init__(self, target: dict[str, Any], procs: int, entry: Callable[..., None] = worker_main) -> None:
        self.target = target
        self.procs = procs
        ctx = mp.get_context("spawn")
        self.events = [ctx.Event() for _ in range(MAX_EVENTS)]
        self._next_event = 0
        self.conns = []
        self.processes = []
        self.alive = True
        for i in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=entry, args=(child, self.events, target),
                               name=f"bench-{target['name']}-{i}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(proc)
        self.gather("hello", time.monotonic() + START_LIMIT)

    # -- messaging ---------------------------------------------------------------
    def _send_all(self, message: tuple[Any, ...], only: list[int] | None = None) -> None:
        for i, conn in enumerate(self.conns):
            if only is None or i in only:
                conn.send(message)

    def gather(self, expected: str, deadline: float, only: list[int] | None = None) -> list[Any]:
        """One answer per (selected) worker, in worker order, by ``deadline`` (monotonic)."""
        out: dict[int, Any] = {}
        wanted = [i for i in range(self.procs) if only is None or i in only]
        while len(out) < len(wanted):
            remaining = deadline - time.monotonic()
            pending = [self.conns[i] for i in wanted if i not in out]
            ready = mp.connection.wait(pending, timeout=max(0.0, remaining))
            if not ready:
                self.kill()
                missing = len(wanted) - len(out)
                raise CellTimeout(f"{missing} of {len(wanted)} workers did not answer {expected!r} in time")
            for conn in ready:
                i = self.conns.index(conn)
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    self.kill()
                    raise RuntimeError(f"worker {i} of {self.target['name']} died (exit code "
                                       f"{self.processes[i].exitcode})") from None
                if kind != expected:
                    self.kill()
                    raise RuntimeError(f"worker {i} of {self.target['name']} answered {kind!r}: {payload}")
                out[i] = payload
        return [out[i] for i in wanted]

    def call(self, messages: list[tuple[Any, ...]], expected: str, limit: float) -> list[Any]:
        """Send ``messages[i]`` to worker ``i``; their answers ``expected`` within ``limit`` seconds."""
        if len(messages) != len(self.conns):
            raise ValueError(f"{len(messages)} messages for {len(self.conns)} workers")
        for conn, message in zip(self.conns, messages, strict=True):
            conn.send(message)
        return self.gather(expected, time.monotonic() + limit)

    def next_event(self) -> tuple[int, Any]:
        """A fresh start event: ``(index, multiprocessing.Event)``."""
        index = self._event()
        return index, self.events[index]

    def _event(self) -> int:
        if self._next_event >= MAX_EVENTS:
            raise RuntimeError("out of start events; make a new pool")
        self._next_event += 1
        return self._next_event - 1

    # -- rounds --------------------------------------------------------------------
    def setup(self, n: int, *, min_nodes: int, max_nodes: int, timeout: float, last_call_timeout: float,
              keep_alive_ttl: float, victim: bool = False) -> str:
        """Build ``n`` agents spread over the workers for a fresh run id (returned)."""
        run_id = f"r{uuid.uuid4().hex[:10]}"
        per = split(n, self.procs)
        for i, conn in enumerate(self.conns):
            conn.send(("setup", {
                "run_id": run_id, "n_threads": per[i], "min_nodes": min_nodes, "max_nodes": max_nodes,
                "timeout": timeout, "last_call_timeout": last_call_timeout, "keep_alive_ttl": keep_alive_ttl,
                "victim": victim and i == 0,
            }))
        self.gather("ready", time.monotonic() + max(START_LIMIT, timeout))
        return run_id

    def round(self, limit: float, who: str = "all") -> tuple[float, list[dict[str, Any]], dict[str, Any]]:
        """Release the agents built by :meth:`setup` together; return ``(t0, agent results, log tally)``.

        Raises:
            CellTimeout: not every agent finished within ``limit`` seconds (the pool is killed).
        """
        index = self._event()
        self._send_all(("go", index, who, limit))
        self.gather("armed", time.monotonic() + START_LIMIT)  # every agent thread exists and waits
        t0 = time.monotonic()
        self.events[index].set()
        # Workers report at the limit whoever finished by then; allow for the report itself.
        answers = self.gather("done", t0 + limit + REPORT_GRACE)
        tally: dict[str, Any] = {"counts": {}, "examples": []}
        for part in answers:
            for key, n in part["log"]["counts"].items():
                tally["counts"][key] = tally["counts"].get(key, 0) + n
            tally["examples"].extend(part["log"]["examples"][: 5 - len(tally["examples"])])
        return t0, [res for part in answers for res in part["agents"]], tally

    def kill_victim(self) -> float:
        """Crash the victim (worker 0's agent 0): close its client; return when (monotonic)."""
        self.conns[0].send(("kill",))
        return self.gather("killed", time.monotonic() + 30.0, only=[0])[0]

    def cleanup(self, limit: float = 120.0) -> None:
        """Every agent leaves its round (rdzv) or stops its heartbeats (PyTorch)."""
        self._send_all(("cleanup",))
        self.gather("clean", time.monotonic() + limit)

    def close(self) -> None:
        """Ask the workers to exit; kill those that do not within 30 s."""
        if not self.alive:
            return
        try:
            self._send_all(("exit",))
            self.gather("bye", time.monotonic() + 30.0)
        except (CellTimeout, RuntimeError, OSError):
            pass
        for proc in self.processes:
            proc.join(5.0)
        self.kill()

    def kill(self) -> None:
        """SIGKILL this pool's worker processes (and only those)."""
        self.alive = False
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
        for proc in self.processes:
            proc.join(10.0)
        for conn in self.conns:
            conn.close()


class LazyPool:
    """The current :class:`WorkerPool` of one target: made on first use and again after a kill.

    Args:
        target, procs: as :class:`WorkerPool`.
    """

    def __init__(self, target: dict[str, Any], procs: int) -> None:
        self.target, self.procs = target, procs
        self._pool: WorkerPool | None = None

    def get(self) -> WorkerPool:
        """A live pool (a new one if there is none or the last one was killed)."""
        if self._pool is None or not self._pool.alive:
            self._pool = WorkerPool(self.target, self.procs)
        return self._pool

    def kill(self) -> None:
        """Kill the current pool (its agents may still be running after a timeout)."""
        if self._pool is not None:
            self._pool.kill()
            self._pool = None

    def close(self) -> None:
        """Let the current pool's workers exit."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def split(n: int, parts: int) -> list[int]:
    """``n`` agents over ``parts`` workers, as even as possible (first workers get the extra)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def check_ranks(results: list[dict[str, Any]], world: int) -> str | None:
    """``None`` if the agents hold ranks ``0..world-1`` exactly once, all with ``world_size == world``
    and (rdzv) one round version; else what is wrong."""
    unfinished = sum(1 for r in results if r.get("unfinished"))
    if unfinished:
        return f"{unfinished} of {len(results)} agents did not finish in time"
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return f"{len(errors)} agent(s) failed, e.g. {errors[0]}"
    ranks = sorted(r["rank"] for r in results)
    if ranks != list(range(world)):
        return f"ranks are not 0..{world - 1} exactly once: {ranks[:10]}..."
    worlds = {r["world"] for r in results}
    if worlds != {world}:
        return f"world sizes {sorted(worlds)} != {world}"
    versions = {r["version"] for r in results if "version" in r}
    if len(versions) > 1:
        return f"agents ended in different rounds: {sorted(versions)}"
    return None
