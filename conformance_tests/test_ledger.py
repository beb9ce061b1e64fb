"""The node ledger and the gate before a round, on every backend (marker ``rendezvous``).

The promises (``docs/node-health.md``): concurrent updates of a node's entry all land; a failure is
attributed to the node whose workers failed first, whatever order the reports arrive in; a node with
``quarantine_after`` offences within the window is quarantined, for a cooldown that doubles; a quarantined
node does not join while the others can go on without it (a spare takes its place), is admitted anyway when
they cannot (fail-open), joins once forgiven or once its entry is gone, and ends with ``NodeExcludedError``
when the run closes; a node whose pre-flight check fails does not join until it passes.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from typing import Any, Callable

import pytest

from rdzv_core import KVBackend, NodeExcludedError, RendezvousParams
from rdzv_core.rendezvous.ledger import NodeLedger, QuarantinePolicy
from rdzv_core.rendezvous.record import RunKeys

from .agents import Agent, round_of, run_threads
from .waiting import eventually

pytestmark = pytest.mark.rendezvous

TTL = 1.0


class _Clock:
    """A Unix clock the test moves."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class _Check:
    """A pre-flight check the test turns on and off."""

    healthy: bool = False
    check: str = "command"
    reason: str = "GPU 3 missing"
    runs: int = 0

    def __call__(self) -> "_Check":
        self.runs += 1
        return dataclasses.replace(self)


@pytest.fixture
def crew(kv_factory: Callable[[], KVBackend]):
    """``crew(names, **params)`` -> one agent per node name, each on its own client, of one fresh run."""
    run_id = f"ldg{uuid.uuid4().hex[:10]}"
    made: list[Agent] = []

    def make(names: list[str], **params: Any) -> list[Agent]:
        base = {"min_nodes": 1, "keep_alive_ttl": TTL, "timeout": 60.0, "last_call_timeout": 0.5, **params}
        new = [Agent(kv_factory(), run_id, RendezvousParams(node_name=name, **base)) for name in names]
        made.extend(new)
        return new

    yield make
    for agent in made:
        if agent.thread is not None and agent.thread.is_alive():
            agent.kv.close()  # a failed test's agent: its next_round ends at once
            agent.thread.join(10)


def test_concurrent_offences_of_one_node_all_land(kv_factory: Callable[[], KVBackend]) -> None:
    keys = RunKeys("torchelastic/p2p", f"ldg{uuid.uuid4().hex[:10]}")
    ledgers = [NodeLedger(kv_factory(), keys, QuarantinePolicy(after=0)) for _ in range(4)]
    run_threads(4, lambda i: [ledgers[i].offend("node-a", "failed", f"writer {i} #{n}") for n in range(3)])
    entry = ledgers[0].read("node-a")
    assert sorted(o.detail for o in entry.offences) == sorted(f"writer {i} #{n}" for i in range(4) for n in range(3))
    assert not entry.quarantined()


def test_quarantine_needs_k_offences_within_the_window_and_its_cooldown_doubles(kv: KVBackend) -> None:
    clock = _Clock()
    ledger = NodeLedger(kv, RunKeys("torchelastic/p2p", f"ldg{uuid.uuid4().hex[:10]}"),
                        QuarantinePolicy(after=2, window=100.0, cooldown=10.0), clock=clock)
    assert not ledger.offend("n1", "failed", "exit 1").quarantined(clock.now)
    clock.now += 150  # the first offence is out of the window
    assert not ledger.offend("n1", "failed", "exit 1").quarantined(clock.now)
    entry = ledger.offend("n1", "check", "disk full")
    assert entry.quarantined(clock.now) and entry.until == clock.now + 10.0 and entry.quarantines == 1
    assert "disk full" in entry.why
    clock.now += 11
    assert not ledger.read("n1").quarantined(clock.now)
    ledger.offend("n1", "failed", "exit 1")  # within the window of the two before: quarantined again, twice as long
    again = ledger.read("n1")
    assert again.quarantined(clock.now) and again.until == clock.now + 20.0 and again.quarantines == 2
    forgiven = ledger.forgive("n1")
    assert not forgiven.quarantined(clock.now) and forgiven.offences == ()
    assert [e.name for e in ledger.entries()] == ["n1"]


def test_the_node_that_failed_first_is_the_culprit_whatever_order_the_reports_arrive_in(crew) -> None:
    agents = crew(["early", "late", "bystander"], min_nodes=3, quarantine_after=0)
    round_of([a.start() for a in agents], 30)
    early, late = agents[0].rdzv, agents[1].rdzv
    t0 = early.ledger.clock()
    verdicts: dict[str, Any] = {}
    # the late node's report (its worker exited 0.3 s after the early one's) arrives first
    late_thread = threading.Thread(target=lambda: verdicts.update(late=late.report_failure(t0 + 0.3, "exit 1", 1.0)))
    late_thread.start()
    current = late.current
    assert current is not None
    reports = late.ledger.failures_dir(current.version, current.round_id or None)
    eventually(lambda: early.kv.list(reports)[0], 10, "the late node's report")
    verdicts["early"] = early.report_failure(t0, "exit 3: CUDA error", 1.0)
    late_thread.join(10)
    assert verdicts["early"].first and verdicts["early"].culprit == "early"
    assert not verdicts["late"].first and verdicts["late"].culprit == "early"
    assert [o.kind for o in early.ledger.read("early").offences] == ["failed"]
    assert early.ledger.read("late").offences == ()


def test_failures_from_a_lost_peer_are_blamed_on_nobody(crew) -> None:
    """A node that was killed reports nothing; its peers' workers fail because it is gone and say so: no offence,
    no culprit, and no wait for earlier reports."""
    agents = crew(["a", "b", "killed"], min_nodes=3, quarantine_after=1)
    round_of([x.start() for x in agents], 30)
    now = agents[0].rdzv.ledger.clock()
    verdicts = [x.rdzv.report_failure(now + i * 0.01, "Connection closed by peer", 30.0, peer=True)
                for i, x in enumerate(agents[:2])]
    assert all(v is not None and v.culprit is None and not v.first for v in verdicts), verdicts
    assert agents[0].rdzv.ledger.entries() == []  # nobody offended


def test_a_quarantined_node_waits_and_a_spare_takes_its_place(crew) -> None:
    a, b, lemon, spare = crew(["a", "b", "lemon", "spare"], min_nodes=2, max_nodes=3, quarantine_after=1)
    round_of([x.start() for x in (a, b, lemon)], 30)
    spare.start()
    eventually(lambda: a.rdzv.describe().get("waiting") == 1, 20, "the spare counted as waiting")
    verdict = lemon.rdzv.report_failure(lemon.rdzv.ledger.clock(), "exit 1", 0.0)
    assert verdict is not None and verdict.first and verdict.entry.quarantined()
    lemon.start()  # its restart: it withdraws, the others re-form without it
    for x in (a, b):
        x.start()
    results = round_of([a, b, spare], 30)
    assert {r.world_size for r in results} == {3}
    assert not lemon.done.is_set(), "the quarantined node joined"
    a.rdzv.set_closed()
    assert lemon.done.wait(20), "the quarantined node did not end when the run closed"
    assert isinstance(lemon.error, NodeExcludedError) and lemon.error.node == "lemon"
    assert "quarantined" in lemon.error.reason


def test_a_quarantined_node_is_admitted_when_the_run_cannot_go_on_without_it(crew) -> None:
    a, lemon = crew(["a", "lemon"], min_nodes=2, max_nodes=2, quarantine_after=1)
    first = round_of([a.start(), lemon.start()], 30)
    lemon.rdzv.report_failure(lemon.rdzv.ledger.clock(), "exit 1", 0.0)
    results = round_of([a.start(), lemon.start()], 30)
    assert results[0].version > first[0].version
    entry = lemon.rdzv.ledger.read("lemon")
    assert entry.quarantined() and entry.fail_open is not None


@pytest.mark.parametrize("release", ["forgive", "wipe"])
def test_a_quarantined_node_joins_once_forgiven_or_its_entry_is_gone(crew, release: str) -> None:
    a, b, lemon = crew(["a", "b", "lemon"], min_nodes=2, max_nodes=3, quarantine_after=1)
    round_of([x.start() for x in (a, b, lemon)], 30)
    lemon.rdzv.report_failure(lemon.rdzv.ledger.clock(), "exit 1", 0.0)
    lemon.start()
    round_of([a.start(), b.start()], 30)
    assert not lemon.done.is_set()
    if release == "forgive":
        a.rdzv.ledger.forgive("lemon")
    else:
        a.kv.delete(a.rdzv.ledger.key("lemon"))
    # it joins as a newcomer: the others' next round has all three
    eventually(lambda: a.rdzv.num_nodes_waiting() > 0, 20, "the released node waiting to join")
    assert {r.world_size for r in round_of([a.start(), b.start(), lemon], 30)} == {3}


def test_a_node_whose_check_fails_does_not_join_until_it_passes(crew) -> None:
    a, b, sick = crew(["a", "b", "sick"], min_nodes=2, max_nodes=3)
    check = _Check()
    sick.rdzv.gate.check, sick.rdzv.gate.interval = check, 0.2
    sick.start()
    round_of([a.start(), b.start()], 30)
    eventually(lambda: check.runs >= 2, 10, "the check re-run while failing")
    assert not sick.done.is_set()
    entry = a.rdzv.ledger.read("sick")
    assert entry.state() == "unhealthy" and "GPU 3 missing" in entry.check
    assert [o.kind for o in entry.offences] == ["check"]  # one offence, not one per re-check
    check.healthy = True
    eventually(lambda: a.rdzv.num_nodes_waiting() > 0, 20, "the healed node waiting to join")
    assert {r.world_size for r in round_of([a.start(), b.start(), sick], 30)} == {3}
    assert a.rdzv.ledger.read("sick").state() == "healthy"


def test_a_node_whose_check_fails_gives_up_when_told_to(crew) -> None:
    (sick,) = crew(["sick"])
    sick.rdzv.gate.check, sick.rdzv.gate.action = _Check(reason="disk /ckpt: 10 MiB free"), "exit"
    sick.start()
    assert sick.done.wait(10)
    assert isinstance(sick.error, NodeExcludedError) and "10 MiB free" in sick.error.reason


def test_runs_under_one_prefix_share_a_prefix_scoped_ledger_and_not_a_run_scoped_one(
        kv_factory: Callable[[], KVBackend]) -> None:
    prefix = f"ldg{uuid.uuid4().hex[:8]}"
    policy = QuarantinePolicy(after=1)
    first, second = (RunKeys(prefix, f"job{i}") for i in (1, 2))
    kv = kv_factory()
    NodeLedger(kv, first, policy, scope="prefix").offend("lemon", "failed", "exit 3")
    assert NodeLedger(kv, second, policy, scope="prefix").read("lemon").quarantined()
    assert NodeLedger(kv, second, policy).read("lemon").offences == ()  # the run's own ledger knows nothing of it
    NodeLedger(kv, first, policy).offend("other", "failed", "exit 3")
    assert not NodeLedger(kv, second, policy, scope="prefix").read("other").offences


def test_when_every_node_fails_its_check_they_give_up_after_the_rendezvous_timeout(crew) -> None:
    """Nobody can form a round: each node waits no longer than its rendezvous ``timeout`` (as a node that finds
    no round would), then ends with ``NodeExcludedError`` naming the check's reason."""
    nodes = crew(["a", "b"], min_nodes=2, timeout=2.0)
    for node in nodes:
        node.rdzv.gate.check, node.rdzv.gate.interval = _Check(reason="disk full"), 0.2
        node.start()
    for node in nodes:
        assert node.done.wait(20), "a node whose check fails waited past its rendezvous timeout"
        assert isinstance(node.error, NodeExcludedError) and "disk full" in node.error.reason, node.error
