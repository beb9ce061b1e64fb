"""Jobs of real ``rdzv-run`` launchers on the hosts of a multi-host cluster (``conformance_tests.multihost``).

:class:`HostJob` is :class:`tests.support.membership_jobs.Job` with one launcher per host (``--local-addr`` the host's
address), and the run's state read by an :class:`Observer` process on the server's host (a client in
the test process cannot reach another network namespace). :func:`rounds_consistent` checks the
invariant every partition test asserts: each round's steps come from exactly its world's ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from tests.support.agent_workers.harness import HERE, Launcher
from tests.support.membership_jobs import Backend, Job

from conformance_tests.multihost import Host

OBSERVER = os.path.join(HERE, "observer.py")


class Observer:
    """A process on ``host`` that answers ``describe()`` of runs over its own client of ``base_url``."""

    def __init__(self, host: Host, base_url: str) -> None:
        self.proc = host.popen([sys.executable, OBSERVER, base_url], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"observer on {host.name} did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"observer exited ({self.proc.wait(5)})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def describe(self, run_id: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(run_id + "\n")
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class HostJob(Job):
    """A run whose nodes are launchers on hosts; ``query`` holds the rendezvous URL's query values."""

    def __init__(self, backend: Backend, workdir: str, hosts: dict[str, Host], observer: Observer,
                 query: dict[str, str]) -> None:
        super().__init__(backend, workdir)
        self.hosts = hosts
        self.observer = observer
        self.query = dict(query)

    def start(self, name: str, nnodes: str, **kwargs: Any) -> Launcher:
        """Start node ``name`` on the host of that name."""
        host = self.hosts[name]
        extra = ("--local-addr", host.address, *kwargs.pop("extra", ()))
        return self.node(name, nnodes, extra=extra, prefix=host.command_prefix, **kwargs)

    def state(self) -> dict[str, Any]:
        return self.observer.describe(self.run_id)

    def is_closed(self) -> bool:
        return self.state().get("status") == "closed"

    def steps(self, after: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in self.records() if r["t"] > after]

    def pids(self, node: str, after: float = 0.0) -> set[int]:
        return {r["pid"] for r in self.records(node) if r["t"] > after}

    def training(self, nodes: list[str], world: int, after: float = 0.0, steps: int = 1) -> bool:
        """Whether every node of ``nodes`` made ``steps`` steps at ``world`` after ``after``, all in one round."""
        found = [r for r in self.steps(after) if r["world"] == world and r["node"] in nodes]
        for master in {r["master"] for r in found}:
            if all(sum(1 for r in found if r["node"] == n and r["master"] == master) >= steps for n in nodes):
                return True
        return False

    def final_round(self, world: int, newer_than: int = 0) -> dict[str, Any] | None:
        """The run's state if its round is final with ``world`` participants and a version > ``newer_than``."""
        state = self.state()
        if state.get("status") == "final" and state.get("participants") == world and \
                state.get("version", 0) > newer_than:
            return state
        return None


def rounds_consistent(records: list[dict[str, Any]]) -> list[str]:
    """What breaks the invariant in ``records`` (step records): every round -- one process group, named by
    its ``master`` -- must have steps from exactly ``world`` distinct ranks ``0 .. world-1``, one world size.
    Returns the violations (empty when none)."""
    problems = []
    for master in sorted({r["master"] for r in records}):
        mine = [r for r in records if r["master"] == master]
        worlds = {r["world"] for r in mine}
        ranks = {r["rank"] for r in mine}
        nodes = {r["node"] for r in mine}
        if len(worlds) != 1 or ranks != set(range(next(iter(worlds)))):
            problems.append(f"round {master}: worlds {sorted(worlds)}, ranks {sorted(ranks)}, nodes {sorted(nodes)}")
    return problems


def wait_for(predicate: Any, timeout: float, what: str, job: Job) -> tuple[Any, float]:
    """``eventually`` that also returns when (``time.time()``) the predicate held."""
    from tests.support.waiting import eventually

    value = eventually(predicate, timeout, what, job.tails)
    return value, time.time()
