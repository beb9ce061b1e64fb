"""End-to-end elasticity benchmark: how fast a 3-node training job recovers from membership events.

    python -m benchmarks.elastic                 # every target, event and setting, 3 repetitions
    python -m benchmarks.elastic --smoke         # rdzv-run over file, kill and spare, once, lc1 (CI)
    python -m benchmarks.elastic --quick         # every target and event at both settings, once, short holds
    python -m benchmarks.elastic --write-docs    # also rewrite docs/elastic-phases.json, docs/elastic-phases.png
                                                 # and the table in docs/benchmarks.md

A job is 3 nodes on this host -- launchers as separate process trees (their own
sessions), 1 worker each (``benchmarks/trainer.py``: a gloo ``all_reduce`` + 50 ms
sleep per step, process-group timeout 60 s, each step recorded with its time and
world size) -- with ``--max-restarts 3``, ``--monitor-interval 0.1`` (torchrun's
default) and every handler's default keep-alive, at each *setting* (``--settings``):
``defaults`` (no ``last_call_timeout`` given: torch's 30 s; the first round of a
job that starts below ``max_nodes`` waits it out) and ``lc1``
(``last_call_timeout=1``). Launchers log at INFO; each recovery is split into
phases (:mod:`benchmarks.elastic_phases`). Events, each measured as the seconds
from the event until a step completes at the new world size
(:mod:`benchmarks.elastic_report` has the targets):

==========  ==========================================================================
kill        SIGKILL of node C's whole process tree (``--nnodes 2:3``; until world size 2)
freeze      SIGSTOP of node C's whole tree (no FIN, no RST); killed at the end
leave       SIGTERM to node C's launcher
grow        C, started beforehand and held at a gate after its imports, is let in while A
            and B train at ``--nnodes 2:3`` (until world size 3)
spare       ``--nnodes 2:2``, A and B train, C starts: restarts of A and B are counted over
            the hold (``--spare-hold``, 60 s), then B is killed: until C makes a step
==========  ==========================================================================

The event comes after the job has trained at its starting world size for ``--settle``
seconds (15; 0 with ``--smoke``): a failure in a long job comes in steady state, when the
next warm generation is ready (it is started ``RDZV_WARM_AFTER`` = 10 s after the workers).
The victim is never node A, which hosts the TCPStore of torch's ``c10d`` baseline
(``is_host=1``; the others ``is_host=0``: killing the host ends that job). Each
repetition's launcher logs and worker records are kept under ``--logs``.
Targets: ``rdzv-run`` over redis, etcd-v3 and file (as by default: warm workers where the
trainer qualifies; ``rdzv-run+warm:*`` with ``--warm-workers``, ``rdzv-run+cold:*`` with
``--no-warm-workers``); ``torchrun`` with the
``rdzv-redis`` handler; the baselines ``torchrun`` with torch's ``c10d`` and
``etcd-v2`` handlers -- same servers, same job, in one run, repetitions
interleaved (rep 1 of every event and target, then rep 2, ...). A target that does
not recover within ``--limit`` seconds is recorded as such.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import psutil

from . import elastic_phases
from .servers import Servers
from .trainer_records import read_records

__all__ = ["TARGETS", "EVENTS", "run_event", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAINER = os.path.join(HERE, "trainer.py")

#: target -> (launcher, backend); the launcher is ``rdzv-run`` or ``torchrun``.
TARGETS: dict[str, tuple[str, str]] = {
    "rdzv-run:redis": ("rdzv-run", "redis"),
    "rdzv-run:etcd-v3": ("rdzv-run", "etcd-v3"),
    "rdzv-run:file": ("rdzv-run", "file"),
    "torchrun:rdzv-redis": ("torchrun", "rdzv-redis"),
    "torchrun:c10d": ("torchrun", "c10d"),
    "torchrun:etcd-v2": ("torchrun", "etcd-v2"),
    "rdzv-run+warm:redis": ("rdzv-run", "redis"),
    "rdzv-run+warm:etcd-v3": ("rdzv-run", "etcd-v3"),
    "rdzv-run+warm:file": ("rdzv-run", "file"),
    "rdzv-run+cold:redis": ("rdzv-run", "redis"),
    "rdzv-run+cold:etcd-v3": ("rdzv-run", "etcd-v3"),
    "rdzv-run+cold:file": ("rdzv-run", "file"),
}
#: ``rdzv-run`` flags per target variant: warm workers as by default (``rdzv-run:*``: on where the trainer
#: qualifies, :mod:`rdzv_agent.workers.warm_check`), asked for (``+warm``) or off (``+cold``).
VARIANT_FLAGS = {"rdzv-run+warm": ["--warm-workers"], "rdzv-run+cold": ["--no-warm-workers"]}
#: Seconds the job trains at its starting world size before the event (``--settle``): failures in a long job
#: come in steady state, after the first ``RDZV_WARM_AFTER`` (10 s) in which no warm generation exists yet.
SETTLE = 15.0
EVENTS = ("kill", "freeze", "leave", "grow", "spare")
#: setting -> ``last_call_timeout`` given to every target (seconds; ``None``: not given, the handler's default).
SETTINGS: dict[str, float | None] = {"defaults": None, "lc1": 1.0}
START_LIMIT = 120.0  #: seconds for a job to be training before the event (a first round may wait 30 s)
#: event -> (nodes training before it that may detect it, nodes of the new round, its world size).
ROUNDS = {"kill": (["A", "B"], ["A", "B"], 2), "freeze": (["A", "B"], ["A", "B"], 2),
          "leave": (["A", "B"], ["A", "B"], 2), "grow": (["A", "B"], ["A", "B", "C"], 3),
          "spare": (["A"], ["A", "C"], 2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """One launcher process tree (its own session) running the trainer; ``gate``: wait for a file first."""

    def __init__(self, argv: list[str], module: str, name: str, workdir: str, gate: str | None = None) -> None:
        self.name = name
        if gate is None:
            cmd = [sys.executable, "-m", module, *argv]
        else:  # imports done, then waits at the gate: a node that joins on cue without an import's delay
            code = ("import os, runpy, sys, time\n"
                    f"import {module}\n"
                    f"while not os.path.exists({gate!r}): time.sleep(0.01)\n"
                    f"sys.argv = [{module!r}, *sys.argv[1:]]\n"
                    f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
            cmd = [sys.executable, "-c", code, *argv]
        env = {**os.environ, "TRAINER_NODE": name, "PYTHONUNBUFFERED": "1", "TMPDIR": workdir, "LOGLEVEL": "INFO"}
        env.pop("RDZV_URL", None)
        self.log = open(os.path.join(workdir, f"{name}.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=workdir, start_new_session=True)
        self.known: set[int] = set()

    def tree(self) -> list[int]:
        try:
            pids = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            pids = []
        self.known.update(pids)
        return [self.proc.pid, *pids]

    def signal_tree(self, sig: int) -> None:
        """``sig`` to the launcher (first) and every descendant: torchrun's workers have sessions of their own."""
        for pid in self.tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        self.tree()
        for pid in [self.proc.pid, *self.known]:
            for fn in (os.killpg, os.kill):
                try:
                    fn(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


class Job:
    """The 3 nodes of one repetition of one event on one target."""

    def __init__(self, target: str, servers: Servers, workdir: str, last_call: float | None) -> None:
        self.launcher, self.backend = TARGETS[target]
        self.flags = VARIANT_FLAGS.get(target.split(":")[0], [])
        self.last_call = last_call
        self.servers = servers
        self.workdir = workdir
        self.out = os.path.join(workdir, "out")
        os.makedirs(self.out, exist_ok=True)
        self.run_id = f"el{uuid.uuid4().hex[:10]}"
        self.nodes: dict[str, Node] = {}
        self.c10d_port = _free_port()

    def _rdzv_args(self, name: str) -> list[str]:
        if self.launcher == "rdzv-run":
            base = self.servers.rdzv_url(self.backend, self.run_id)
            url = base.replace("?", self.run_id + "?", 1) if "?" in base else base + self.run_id
            if self.last_call is None:
                return ["--rdzv", url]
            sep = "&" if "?" in url else "?"
            return ["--rdzv", f"{url}{sep}last_call_timeout={self.last_call:g}"]
        if self.backend == "rdzv-redis":
            endpoint = self.servers.redis.address
        elif self.backend == "etcd-v2":
            endpoint = self.servers.etcd.address
        else:  # c10d: node A's agent hosts the TCPStore on this port
            endpoint = f"127.0.0.1:{self.c10d_port}"
        conf = [] if self.last_call is None else [f"last_call_timeout={self.last_call:g}"]
        if self.backend == "c10d":  # node A hosts the store, as the endpoint's host would across hosts
            conf.append(f"is_host={int(name == 'A')}")
        conf_args = ["--rdzv-conf", ",".join(conf)] if conf else []
        return ["--rdzv-backend", self.backend, "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id, *conf_args]

    def start(self, name: str, nnodes: str, gate: str | None = None) -> Node:
        argv = ["--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.1",
                *self.flags, *self._rdzv_args(name),
                TRAINER, "--out", self.out, "--collective", "--pg-timeout", "60"]
        module = "rdzv_agent.launch.launcher" if self.launcher == "rdzv-run" else "torch.distributed.run"
        node = self.nodes[name] = Node(argv, module, name, self.workdir, gate)
        return node

    def steps(self, name: str) -> list[dict[str, Any]]:
        return read_records(self.out, name)

    def first_step(self, names: list[str], world: int, after: float) -> float | None:
        """The earliest time (``time.time()``) a step at ``world`` completed on any of ``names`` after ``after``."""
        times = [r["t"] for n in names for r in self.steps(n) if r["world"] == world and r["t"] > after]
        return min(times) if times else None

    def wait_training(self, names: list[str], world: int, limit: float, after: float = 0.0) -> bool:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if all(any(r["world"] == world and r["t"] > after for r in self.steps(n)) for n in names):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()


def run_event(target: str, event: str, servers: Servers, limit: float, spare_hold: float,
              setting: str = "lc1", keep: str | None = None, settle: float = SETTLE) -> dict[str, Any]:
    """One repetition: start the job, let it train ``settle`` s, cause ``event``, measure and split into phases;
    the job is torn down and its directory removed in every case (its logs and records copied to ``keep`` first,
    if given)."""
    workdir = tempfile.mkdtemp(prefix=f"rdzv-elastic-{event}-")
    job = Job(target, servers, workdir, SETTINGS[setting])
    result: dict[str, Any] = {"target": target, "event": event, "setting": setting, "recovery_s": None,
                              "status": "ok"}
    t0: float | None = None
    recovered: float | None = None
    try:
        if event == "grow":
            gate = os.path.join(workdir, "gate")
            for name in ("A", "B"):
                job.start(name, "2:3")
            job.start("C", "2:3", gate=gate)
            if not job.wait_training(["A", "B"], 2, START_LIMIT):
                return {**result, "status": "no start"}
            time.sleep(settle)
            t0 = time.time()
            open(gate, "w").close()
            recovered = _wait_first(job, ["A", "B", "C"], 3, t0, limit)
        elif event == "spare":
            for name in ("A", "B"):
                job.start(name, "2:2")
            if not job.wait_training(["A", "B"], 2, START_LIMIT):
                return {**result, "status": "no start"}
            job.start("C", "2:2")
            time.sleep(spare_hold)  # the measured quantity is what happens during the hold
            result["member_restarts"] = sum(len({r["pid"] for r in job.steps(n)}) - 1 for n in ("A", "B"))
            result["spare_steps_in_hold"] = len(job.steps("C"))
            t0 = time.time()
            job.nodes["B"].signal_tree(signal.SIGKILL)
            recovered = _wait_first(job, ["C"], 2, t0, limit)
        else:
            for name in ("A", "B", "C"):
                job.start(name, "2:3")
            if not job.wait_training(["A", "B", "C"], 3, START_LIMIT):
                return {**result, "status": "no start"}
            time.sleep(settle)
            victim = job.nodes["C"]
            t0 = time.time()
            if event == "kill":
                victim.signal_tree(signal.SIGKILL)
            elif event == "freeze":
                victim.signal_tree(signal.SIGSTOP)
            else:
                victim.terminate()
            recovered = _wait_first(job, ["A", "B"], 2, t0, limit)
        if recovered is None:
            result["status"] = "not recovered"
        else:
            result["recovery_s"] = round(recovered - t0, 3)
        return result
    finally:
        job.stop()
        if t0 is not None:
            survivors, new_round, world = ROUNDS[event]
            result["t0"] = t0
            result.update(elastic_phases.phases(workdir, job.out, t0, survivors, new_round, world, recovered))
        if keep is not None:
            _keep(workdir, job.out, keep)
            result["logs"] = keep
        shutil.rmtree(workdir, ignore_errors=True)


def _keep(workdir: str, out: str, dest: str) -> None:
    """Copy the launchers' logs and the trainer's records of one repetition to ``dest``."""
    os.makedirs(dest, exist_ok=True)
    for folder in (workdir, out):
        for name in os.listdir(folder):
            if name.endswith((".log", ".jsonl")):
                shutil.copy(os.path.join(folder, name), dest)


def _wait_first(job: Job, names: list[str], world: int, t0: float, limit: float) -> float | None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = job.first_step(names, world, t0)
        if found is not None:
            return found
        time.sleep(0.05)
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets (default: all)")
    p.add_argument("--events", default=",".join(EVENTS), help="comma-separated events (default: all)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per target and event (default 3)")
    p.add_argument("--limit", type=float, default=90.0, help="seconds to wait for a recovery (default 90)")
    p.add_argument("--spare-hold", type=float, default=60.0, help="seconds the spare waits (default 60)")
    p.add_argument("--settle", type=float, default=SETTLE,
                   help=f"seconds the job trains before the event (default {SETTLE:g}; the spare's hold is its own)")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="comma-separated settings: defaults (torch's 30 s last call), lc1 (last_call_timeout=1)")
    p.add_argument("--smoke", action="store_true",
                   help="rdzv-run:file, kill and spare (hold 5 s), once, lc1, no settling")
    p.add_argument("--quick", action="store_true",
                   help="the chosen targets, events and settings once, spare hold 5 s, limit 45 s")
    p.add_argument("--out", default=None, help="JSON file to write (default: a new temporary file)")
    p.add_argument("--logs", default=None,
                   help="keep every repetition's launcher logs and trainer records under this directory "
                        "(default: a 'logs' directory beside the JSON file)")
    p.add_argument("--write-docs", action="store_true",
                   help="write docs/elastic-phases.{json,png} and the table in docs/benchmarks.md")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a job did not even start (the numbers would mean nothing)."""
    args = _parser().parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    events = [e for e in args.events.split(",") if e]
    settings = [s for s in args.settings.split(",") if s]
    reps, hold, limit = args.reps, args.spare_hold, args.limit
    if args.smoke:
        targets, events, settings, reps, hold, limit = ["rdzv-run:file"], ["kill", "spare"], ["lc1"], 1, 5.0, 60.0
        args.settle = 0.0
    elif args.quick:
        reps, hold, limit = 1, 5.0, 45.0
    for name, known, valid in (("--targets", targets, TARGETS), ("--events", events, EVENTS),
                               ("--settings", settings, SETTINGS)):
        bad = [x for x in known if x not in valid]
        if bad or not known:
            _parser().error(f"{name}: unknown {bad or known!r}; valid: {', '.join(valid)}")
    needs = sorted({"redis" if "redis" in b else "etcd-v2" if "etcd" in b else "file"
                    for b in (TARGETS[t][1] for t in targets)})
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="rdzv-elastic-"), "elastic.json")
    logs = args.logs or os.path.join(os.path.dirname(os.path.abspath(out)), "logs")
    docs = os.path.join(ROOT, "docs")
    previous = _previous(next((os.path.join(docs, name) for name in ("elastic-phases.json", "elastic.json")
                               if os.path.exists(os.path.join(docs, name))), ""))
    servers = Servers(needs)
    started, load_start = time.time(), list(os.getloadavg())
    results: list[dict[str, Any]] = []
    try:
        for rep in range(reps):
            for event in events:
                for setting in settings:
                    for target in targets:
                        keep = os.path.join(logs, f"{setting}-{event}-{target.replace(':', '-')}-{rep}")
                        one = run_event(target, event, servers, limit, hold, setting, keep, args.settle)
                        one["rep"] = rep
                        results.append(one)
                        print(json.dumps(one), flush=True)
    finally:
        versions = servers.versions()
        servers.stop()
    record = {
        "command": "python -m benchmarks.elastic " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())},
        "servers": versions,
        "config": {"targets": targets, "events": events, "settings": {s: SETTINGS[s] for s in settings},
                   "reps": reps, "limit_s": limit, "spare_hold_s": hold, "settle_s": args.settle,
                   "keep_alive_ttl_s": 5.0,
                   "last_call_timeout_default_s": 30.0},
        "code": _commit(),
        "previous": previous,
        "results": results,
    }
    from . import elastic_report

    record["summary"] = elastic_report.summarize(record)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(elastic_report.markdown(record))
    print(f"results: {out}")
    if args.write_docs:
        elastic_report.write_docs(record, os.path.join(ROOT, "docs"))
    return 1 if any(r["status"] == "no start" for r in results) else 0


def _previous(path: str) -> dict[str, Any] | None:
    """The medians at ``last_call_timeout=1`` of the run recorded in ``path`` (an older record: all its cells)."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    medians = {f"{c['target']}|{c['event']}": c["median_s"] for c in old.get("summary", {}).get("cells", [])
               if c.get("setting", "lc1") == "lc1"}
    return {"command": old.get("command"), "started": old.get("started"), "reps": old.get("config", {}).get("reps"),
            "medians_s": medians}


def _commit() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "rdzv_core", "rdzv_backends", "rdzv_agent"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "library_changes": []}
    return {"commit": commit or None, "library_changes": [line for line in dirty if line.strip()]}


if __name__ == "__main__":
    sys.exit(main())
