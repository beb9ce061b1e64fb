"""``python -m benchmarks.admission`` — the admission order measured: the displacement trial and a long churn.

(a) *Displacement trial*, in two variants, ``--trials`` times per target (``--parallel`` trials at once, each
its own run):
members A, B, C form a round (``min_nodes=2, max_nodes=3, last_call_timeout=1, keep_alive_ttl=3``);
spare S1, then spare S2, wait (each counted once its progress says ``spare``); C calls ``leave()``; A and B
poll ``num_nodes_waiting()`` every P s (P uniform in [0.5, 2.0], a random phase) and call ``next_round()``
when it is >= 1. The next round is the first that all its members (world size) report. Counted: trials where A or
B is not in it (*displaced*), trials where S2 is in it and S1 not (*FIFO broken*), trials where no next
round formed within ``--trial-timeout`` s.

(b) *Churn*: :func:`conformance_tests.churn.run_churn` with ``--churn-agents`` agents for ``--churn-seconds``
s, checked by :class:`conformance_tests.history.History` (violations counted by kind).

Servers (Redis, etcd) are started on free loopback ports and stopped at the end (:mod:`benchmarks.servers`).
Prints one table per part; the results are recorded in ``docs/benchmarks.md``, "Admission order".
"""

from __future__ import annotations

import argparse
import functools
import logging
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from conformance_tests.churn import run_churn
from rdzv_core import KVBackend, Progress, Rendezvous, RendezvousParams, RoundResult, open_backend

from .servers import Servers

__all__ = ["main", "displacement_trial", "TrialOutcome"]

TARGETS = ("memory", "file", "redis", "etcd-v3", "etcd-v2")
TRIAL_PARAMS = {"min_nodes": 2, "max_nodes": 3, "last_call_timeout": 1.0, "keep_alive_ttl": 3.0, "timeout": 120.0}


@dataclass(frozen=True)
class TrialOutcome:
    """One displacement trial: who is in the next round (``None``: none formed in time), and its seconds
    from C's ``leave()`` to the third member's return; ``setup``: see :func:`displacement_trial`."""

    next_round: frozenset[str] | None
    seconds: float
    setup: frozenset[str] | None = None

    @property
    def displaced(self) -> bool:
        """A or B is not in the next round."""
        return self.next_round is not None and not {"A", "B"} <= self.next_round

    @property
    def fifo_broken(self) -> bool:
        """S2 is in the next round and S1 is not."""
        return self.next_round is not None and "S2" in self.next_round and "S1" not in self.next_round


class _Node:
    """A Rendezvous on its own client whose ``next_round`` runs on a thread; ``spare`` is set on its
    first ``spare`` progress."""

    def __init__(self, name: str, kv: KVBackend, run_id: str, params: RendezvousParams,
                 results: list[tuple[str, RoundResult, float]], lock: threading.Lock) -> None:
        self.name, self.kv, self.results, self.lock = name, kv, results, lock
        self.spare = threading.Event()
        self.rdzv = Rendezvous(kv, run_id, params, on_progress=self._progress)
        self.thread: threading.Thread | None = None

    def _progress(self, progress: Progress) -> None:
        if progress.phase == "spare":
            self.spare.set()

    def start(self, before: Callable[[], None] | None = None) -> None:
        def run() -> None:
            try:
                if before is not None:
                    before()
                result = self.rdzv.next_round()
            except Exception:  # the trial's end closes the client: expected
                return
            with self.lock:
                self.results.append((self.name, result, time.monotonic()))

        self.thread = threading.Thread(target=run, name=f"trial-{self.name}", daemon=True)
        self.thread.start()


def displacement_trial(url: str, rng: random.Random, timeout: float = 60.0, retried: bool = False) -> TrialOutcome:
    """Run one displacement trial against base URL ``url`` (see the module) with a fresh run id. With
    ``retried``, the spares first try once: C re-joins, A and B re-join when they see it, S1 and S2 queue
    for that round and are left out (it keeps its members), and wait as spares again before C leaves.

    Raises:
        RuntimeError: a round the trial sets up, or a spare, did not come within ``timeout`` s, or a spare
            took a place in the round that was to keep its members.

    Returns:
        the outcome; with ``retried``, ``setup`` holds the members of the round after C re-joined when it is
        not A, B, C (a spare displaced a member there already), and the trial ends there.
        KVError: from the backend.
    """
    run_id = f"adm{uuid.uuid4().hex[:10]}"
    params = RendezvousParams(**TRIAL_PARAMS)  # type: ignore[arg-type]
    results: list[tuple[str, RoundResult, float]] = []
    lock = threading.Lock()
    nodes = {name: _Node(name, open_backend(url), run_id, params, results, lock)
             for name in ("A", "B", "C", "S1", "S2")}
    stop = threading.Event()

    def next_round_after(version: int, until: float) -> tuple[int, frozenset[str], float] | None:
        """The first round after ``version`` that all its members reported: version, members, last return."""
        while time.monotonic() < until:
            with lock:
                later = [(n, r, t) for n, r, t in results if r.version > version]
            for v in sorted({r.version for _, r, _ in later}):
                members = [(n, t) for n, r, t in later if r.version == v]
                if len(members) == min(r.world_size for _, r, _ in later if r.version == v):
                    return v, frozenset(n for n, _ in members), max(t for _, t in members)
            time.sleep(0.05)
        return None

    def poll_then_rejoin(node: _Node) -> Callable[[], None]:
        period = rng.uniform(0.5, 2.0)
        phase = rng.uniform(0.0, period)

        def wait() -> None:  # the agent's monitor loop: a poll every period s, from a random phase
            if stop.wait(phase):
                raise RuntimeError("trial over")
            while node.rdzv.num_nodes_waiting() < 1:
                if stop.wait(period):
                    raise RuntimeError("trial over")

        return wait

    try:
        deadline = time.monotonic() + timeout
        for name in ("A", "B", "C"):
            nodes[name].start()
        first = next_round_after(0, deadline)
        if first is None:
            raise RuntimeError(f"{url}: the first round did not form within {timeout} s")
        for name in ("S1", "S2"):
            nodes[name].start()
            if not nodes[name].spare.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{url}: {name} did not wait as a spare within {timeout} s")
        if retried:
            for name in ("S1", "S2"):
                nodes[name].spare.clear()
            # the round runs a while first: a round younger than keep_alive_ttl is not judged over at once by
            # its members' round watch, which then does not mark A and B re-joining at once
            if stop.wait(params.keep_alive_ttl):
                raise RuntimeError("trial over")
            nodes["C"].start()
            for name in ("A", "B"):
                nodes[name].start(before=poll_then_rejoin(nodes[name]))
            second = next_round_after(first[0], time.monotonic() + timeout)
            if second is None:
                raise RuntimeError(f"{url}: no round formed within {timeout} s after C re-joined")
            if second[1] != frozenset("ABC"):
                return TrialOutcome(None, 0.0, setup=second[1])
            first = second
            for name in ("S1", "S2"):
                if not nodes[name].spare.wait(timeout):
                    raise RuntimeError(f"{url}: {name} did not wait as a spare again within {timeout} s")
        left_at = time.monotonic()
        nodes["C"].rdzv.leave()
        for name in ("A", "B"):
            nodes[name].start(before=poll_then_rejoin(nodes[name]))
        after = next_round_after(first[0], time.monotonic() + timeout)
        if after is None:
            return TrialOutcome(None, time.monotonic() - left_at)
        return TrialOutcome(after[1], after[2] - left_at)
    finally:
        stop.set()
        for node in nodes.values():
            node.kv.close()
        for node in nodes.values():
            if node.thread is not None:
                node.thread.join(10)


def _trials(url: str, count: int, parallel: int, seed: int, timeout: float, retried: bool) -> list[TrialOutcome]:
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(
            lambda i: displacement_trial(url, random.Random(seed * 1_000_003 + i), timeout, retried), range(count)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="memory,redis,etcd-v3", help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--trials", type=int, default=100, help="displacement trials per target (0: skip)")
    p.add_argument("--variants", default="fresh,retried", help="fresh (spares never joined), retried (spares "
                   "queued once for a round that kept its members), comma-separated")
    p.add_argument("--parallel", type=int, default=4, help="displacement trials run at once")
    p.add_argument("--trial-timeout", type=float, default=60.0, help="s a trial waits for a round")
    p.add_argument("--churn-agents", type=int, default=32)
    p.add_argument("--churn-seconds", type=float, default=60.0, help="0: skip the churn")
    p.add_argument("--seed", type=int, default=None, help="default: drawn and printed")
    args = p.parse_args(argv)
    logging.getLogger("rdzv_core").setLevel(logging.ERROR)  # a closed client's expected warnings at each end
    targets = [t for t in args.targets.split(",") if t]
    bad = [t for t in targets if t not in TARGETS]
    if bad or args.trials < 0 or args.parallel < 1 or args.churn_agents < 2:
        p.error(f"bad arguments: unknown targets {bad}" if bad else "trials >= 0, parallel >= 1, churn-agents >= 2")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    servers = Servers(targets)
    try:
        if args.trials:
            print(f"\n(a) displacement trial, {args.trials} trials per target and variant, {TRIAL_PARAMS}")
            print(f"{'target':<9} {'variant':<8} {'trials':>6} {'displaced':>9} {'FIFO broken':>11} {'no round':>8} "
                  f"{'setup':>5} {'p50 s':>6} {'p90 s':>6}")
            for target in targets:
                for variant in [v for v in args.variants.split(",") if v]:
                    url = servers.rdzv_url(target, f"admission-{uuid.uuid4().hex[:6]}")
                    started = time.monotonic()
                    out = _trials(url, args.trials, args.parallel, seed, args.trial_timeout, variant == "retried")
                    formed = [o for o in out if o.setup is None]
                    times = sorted(o.seconds for o in formed if o.next_round is not None)
                    p50 = f"{times[len(times) // 2]:.2f}" if times else "-"
                    p90 = f"{times[int(len(times) * 0.9)]:.2f}" if times else "-"
                    print(f"{target:<9} {variant:<8} {len(out):>6} {sum(o.displaced for o in out):>9} "
                          f"{sum(o.fifo_broken for o in out):>11} {sum(o.next_round is None for o in formed):>8} "
                          f"{len(out) - len(formed):>5} {p50:>6} {p90:>6}   ({time.monotonic() - started:.0f} s)",
                          flush=True)
        if args.churn_seconds > 0:
            print(f"\n(b) churn: {args.churn_agents} agents, {args.churn_seconds:g} s, min_nodes=2, max_nodes=4, "
                  "last_call_timeout=0.5, keep_alive_ttl=2")
            print(f"{'target':<9} {'rounds':>6} {'admitted':>8} {'kills':>5} {'leaves':>6} {'arrivals':>8} "
                  f"{'displaced':>9} {'FIFO':>5} {'ranks':>5} {'errors':>6}")
            for target in targets:
                url = servers.rdzv_url(target, f"churn-{uuid.uuid4().hex[:6]}")
                result = run_churn(functools.partial(open_backend, url), seed, agents=args.churn_agents,
                                   duration=args.churn_seconds)
                violations = result.history.violations()
                kinds = [v.split(":", 1)[0] for v in violations]
                displaced = kinds.count("survivor displaced")
                fifo = kinds.count("FIFO broken")
                print(f"{target:<9} {result.rounds:>6} {result.admissions:>8} {result.kills:>5} {result.leaves:>6} "
                      f"{result.arrivals:>8} {displaced:>9} {fifo:>5} {len(violations) - displaced - fifo:>5} "
                      f"{len(result.errors):>6}", flush=True)
                for line in result.errors:
                    print(f"  error: {line}")
    finally:
        servers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
