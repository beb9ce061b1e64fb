"""A run of real launchers (``rdzv-run`` or plain torchrun) with ``benchmarks/trainer.py`` workers on one backend:
:class:`Backend` (scheme and endpoint) and :class:`Job` (its nodes, their step records, the run's state). Used by
``tests/multihost/test_membership.py`` and, one launcher per host, by :mod:`tests.support.multihost_jobs`."""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.trainer_records import read_records
from rdzv_core import Rendezvous, RendezvousParams, open_backend
from rdzv_core.torch_api.store import KVStore
from tests.support.agent_workers.harness import REPO, Launcher

TRAINER = os.path.join(REPO, "benchmarks", "trainer.py")
TTL = 2.0  # keep_alive_ttl of these runs (seconds)
START = 120.0  # seconds for launchers to start, meet and make their first steps (torch imports on 2 cores)
#: ``--rdzv-backend`` of plain torchrun for each rdzv scheme (see rdzv_core.torch_api.torchrun).
TORCHRUN_BACKEND = {"file": "rdzv-file", "redis": "rdzv-redis", "etcd-v2": "rdzv-etcd", "etcd-v3": "rdzv-etcd-v3"}


@dataclass(frozen=True)
class Backend:
    scheme: str
    endpoint: str  # HOST:PORT, or the file backend's directory

    def url(self, run_id: str, **query: Any) -> str:
        where = self.endpoint if self.scheme != "file" else "/" + self.endpoint.strip("/")
        pairs = "&".join(f"{k}={v}" for k, v in query.items())
        return f"{self.scheme}://{where}/{run_id}" + (f"?{pairs}" if pairs else "")

    def base_url(self) -> str:
        return self.url("x").rsplit("/", 1)[0] + "/"


class Job:
    """The nodes of one run, their step records, and the run's state read through the backend."""

    def __init__(self, backend: Backend, workdir: str) -> None:
        self.backend = backend
        self.workdir = workdir
        self.run_id = f"mb{uuid.uuid4().hex[:10]}"
        self.out = os.path.join(workdir, "out")
        os.makedirs(self.out)
        self.nodes: dict[str, Launcher] = {}
        self.query = {"last_call_timeout": "0.5", "keep_alive_ttl": str(TTL), "timeout": "120"}
        self._kv: Any = None

    def node(self, name: str, nnodes: str, nproc: int = 1, collective: bool = True, torchrun: bool = False,
             max_restarts: int = 3, pg_timeout: float = 60.0, extra: tuple[str, ...] = (),
             trainer_args: tuple[str, ...] = (), prefix: tuple[str, ...] = ()) -> Launcher:
        common = ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                  "--monitor-interval", "0.1", *extra]
        if torchrun:
            conf = ",".join(f"{k}={v}" for k, v in {**self.query, "join_timeout": self.query["timeout"]}.items()
                            if k != "timeout")
            argv = [*common, "--rdzv-backend", TORCHRUN_BACKEND[self.backend.scheme],
                    "--rdzv-endpoint", self.backend.endpoint, "--rdzv-id", self.run_id, "--rdzv-conf", conf]
            module = "torch.distributed.run"
        else:
            argv = [*common, "--rdzv", self.backend.url(self.run_id, **self.query),
                    "--log-dir", os.path.join(self.workdir, "logs")]
            module = "rdzv_agent.launch.launcher"
        argv += [TRAINER, "--out", self.out, "--pg-timeout", str(pg_timeout), *trainer_args]
        if collective:
            argv.append("--collective")
        launcher = Launcher(argv, self.workdir, name, env={"TRAINER_NODE": name}, module=module, prefix=prefix)
        self.nodes[name] = launcher
        return launcher

    def records(self, node: str | None = None, kind: str = "step") -> list[dict[str, Any]]:
        return [r for name in ([node] if node else list(self.nodes)) for r in read_records(self.out, name, kind)]

    def steps_at(self, node: str, world: int, after: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in self.records(node) if r["world"] == world and r["t"] > after]

    def touch(self, name: str) -> None:
        open(os.path.join(self.out, name), "w").close()

    def _observer(self) -> Rendezvous:
        """A read-only view of the run through a client of the test's own (opened on first use)."""
        if self._kv is None:
            self._kv = open_backend(self.backend.base_url())
        return Rendezvous(self._kv, self.run_id, RendezvousParams(min_nodes=1))

    def state(self) -> dict[str, Any]:
        return self._observer().describe()

    def is_closed(self) -> bool:
        return self._observer().is_closed()

    def round_store_has(self, key: str) -> bool:
        """Whether the current round's store (the c10d Store the agents and workers share) holds ``key``."""
        rdzv = self._observer()
        state = rdzv.describe()
        if not state.get("version"):
            return False
        store = KVStore(rdzv.kv, rdzv.store_prefix(state["version"], state.get("id")), datetime.timedelta(seconds=5))
        return bool(store.check([key]))

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()

    def tails(self) -> str:
        return "\n".join(n.tail() for n in self.nodes.values())


def training(job: Job, nodes: list[str], world: int, after: float = 0.0, steps: int = 1) -> Callable[[], bool]:
    """A condition: each of ``nodes`` recorded at least ``steps`` steps at world size ``world`` after ``after``."""
    return lambda: all(len(job.steps_at(n, world, after)) >= steps for n in nodes)
