"""Admission order, on every backend (marker ``rendezvous``): who gets the places of a round that re-forms.

The promise (``docs/design.md``, "Admission order"): a member of the previous round that is alive and
re-joins is never displaced by a node that was not a member, for ``keep_alive_ttl`` after the round ended
(its agent may notice late: a slow monitor, a loaded host); nodes waiting for a place are admitted in the
order they began to wait. Each scenario forces the interleaving that broke the promise with hooks on the
real clients (the hooks wait for events, bounded), so it fails on every run where the rule is missing.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable

import pytest

from rdzv_core import KVBackend, RendezvousParams
from rdzv_core.rendezvous import roundwatch
from rdzv_core.rendezvous.record import RunKeys

from .agents import Agent, Hooked
from .waiting import eventually

pytestmark = pytest.mark.rendezvous

TTL = 2.0  # keep_alive_ttl of these scenarios (s): a slow survivor re-joins 2/3 of it after its round ended
SLOW = TTL * 2 / 3


class _Run:
    """Agents of one fresh run, each on its own client (optionally hooked); all left and closed at the end."""

    def __init__(self, kv_factory: Callable[[], KVBackend], **params: Any) -> None:
        self.kv_factory = kv_factory
        self.run_id = f"adm{uuid.uuid4().hex[:10]}"
        self.params = RendezvousParams(**{"keep_alive_ttl": TTL, "timeout": 60.0, **params})
        self.made: list[Agent] = []

    def agent(self, **hooks: Callable[[Any], None]) -> Agent:
        kv = self.kv_factory()
        made = Agent(Hooked(kv, **hooks) if hooks else kv, self.run_id, self.params)  # type: ignore[arg-type]
        self.made.append(made)
        return made

    def close(self) -> None:
        for agent in self.made:
            if agent.thread is not None and agent.thread.is_alive():
                agent.kv.close()  # a failed test's agent: its next_round ends at once
                agent.thread.join(10)


@pytest.fixture
def run(kv_factory: Callable[[], KVBackend]):
    made: list[_Run] = []

    def make(**params: Any) -> _Run:
        made.append(_Run(kv_factory, **params))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _form(agents: list[Agent]) -> int:
    """Start ``agents`` and return the version of the round they form together."""
    results = [a.start() for a in agents]
    versions = {a.wait(30).version for a in results}
    assert len(versions) == 1, versions
    return versions.pop()


def _spares(run: _Run, count: int, member: Agent, **hooks: Callable[[Any], None]) -> list[Agent]:
    """Start ``count`` spares one after the other (each counted as waiting before the next starts)."""
    spares = []
    for i in range(count):
        spares.append(run.agent(**hooks).start())
        eventually(lambda: member.rdzv.describe().get("waiting") == i + 1, 20, f"spare {i + 1} counted as waiting")
    return spares


def _assert_survivors_and_first_spare(v1: int, a: Agent, b: Agent, s1: Agent, s2: Agent) -> None:
    """Members A and B and spare S1 (re-joining) form one round of 3 after round ``v1``; spare S2 waits on."""
    ra, rb = a.wait(10 * TTL), b.wait(10 * TTL)
    assert ra.version == rb.version > v1 and ra.world_size == 3, (ra, rb)
    rs1 = s1.wait(10 * TTL)
    assert rs1.version == ra.version, rs1
    assert sorted(x.rank for x in (ra, rb, rs1)) == [0, 1, 2]
    assert not s2.done.is_set(), f"the second spare ended: {s2.result} {s2.error!r}"


def _ticket_event(version: int) -> tuple[threading.Event, Callable[[Any], None]]:
    """An event set when the hooked client takes a join ticket in a round after ``version``."""
    event = threading.Event()

    def hook(key: Any) -> None:
        if isinstance(key, str) and key.endswith("/joined") and f"/v_{version}." not in key:
            event.set()

    return event, hook


def _looks_after(observer: Agent, version: int, event: threading.Event) -> Callable[[Any], None]:
    """A ``before_list`` hook: a look at round ``version``'s keep-alive keys, once that round is over, waits
    until ``event`` (at most 10 s)."""
    alive = observer.rdzv.keys.alive_dir(version, observer.rdzv.describe().get("id"))

    def hook(prefix: Any) -> None:
        if prefix == alive and observer.rdzv.describe().get("version") != version:
            event.wait(10)

    return hook


def test_a_survivor_that_re_joins_late_keeps_its_place_against_two_spares(run) -> None:
    """A, B, C train (max 3), spares S1 and S2 wait. C leaves the run; B re-joins at once, A only 2/3 of the
    TTL later (its agent's monitor is slow). The spares look at the old round only once B joined the new one
    (hooked): by then B's key is no longer the live member's key it was. A and B must both be members of the
    next round, with S1 (the first spare); S2 waits on as a spare."""
    r = run(min_nodes=2, max_nodes=3, last_call_timeout=1.0)
    b_joined, on_ticket = _ticket_event(1)
    a, c = r.agent(), r.agent()
    b = r.agent(before_take_ticket=on_ticket)
    v1 = _form([a, b, c])
    s1, s2 = _spares(r, 2, a, before_list=_looks_after(a, v1, b_joined))
    c.rdzv.leave()
    eventually(lambda: b.rdzv.num_nodes_waiting() >= 1, 10 * TTL, "B told to re-form")
    b.start()
    time.sleep(SLOW)  # A's agent looks late: that is the scenario
    assert a.rdzv.num_nodes_waiting() >= 1
    a.start()
    _assert_survivors_and_first_spare(v1, a, b, s1, s2)


def test_spares_are_admitted_in_the_order_they_came(run) -> None:
    """A and B train (max 3, full with C), spares S1 then S2 wait. C leaves; A and B re-join at once. S1 is slow
    to take its ticket (hooked: it waits for S2's ticket, at most half the TTL): S2 must not take the place
    first -- the one free place goes to S1, who came first."""
    r = run(min_nodes=2, max_nodes=3, last_call_timeout=1.0)
    a, b, c = r.agent(), r.agent(), r.agent()
    v1 = _form([a, b, c])
    s2_joined, on_s2_ticket = _ticket_event(v1)

    def s1_slow(key: Any) -> None:
        if isinstance(key, str) and key.endswith("/joined") and f"/v_{v1}." not in key:
            s2_joined.wait(TTL / 2)

    s1 = _spares(r, 1, a, before_take_ticket=s1_slow)[0]
    s2 = r.agent(before_take_ticket=on_s2_ticket).start()
    eventually(lambda: a.rdzv.describe().get("waiting") == 2, 20, "spare 2 counted as waiting")
    c.rdzv.leave()
    eventually(lambda: a.rdzv.num_nodes_waiting() >= 1 and b.rdzv.num_nodes_waiting() >= 1, 10 * TTL,
                "A and B told to re-form")
    ra, rb = a.start(), b.start()
    results = [ra.wait(10 * TTL), rb.wait(10 * TTL), s1.wait(10 * TTL)]
    assert len({x.version for x in results}) == 1 and results[0].version > v1, results
    assert sorted(x.rank for x in results) == [0, 1, 2]
    assert not s2.done.is_set(), f"the second spare ended: {s2.result} {s2.error!r}"


def test_a_newcomer_does_not_take_a_slow_survivors_place(run) -> None:
    """A, B, C train (max 3); C leaves; B re-joins at once; two nodes that never waited arrive while the round
    re-forms; A re-joins 2/3 of the TTL later. A and B are members of the next round with one newcomer."""
    r = run(min_nodes=2, max_nodes=3, last_call_timeout=1.0)
    a, b, c = r.agent(), r.agent(), r.agent()
    v1 = _form([a, b, c])
    c.rdzv.leave()
    eventually(lambda: b.rdzv.num_nodes_waiting() >= 1, 10 * TTL, "B told to re-form")
    b.start()
    newcomers = [r.agent().start() for _ in range(2)]
    time.sleep(SLOW)  # A's agent looks late: that is the scenario
    a.start()
    ra, rb = a.wait(10 * TTL), b.wait(10 * TTL)
    assert ra.version == rb.version > v1 and ra.world_size == 3, (ra, rb)
    eventually(lambda: sum(n.done.is_set() for n in newcomers) >= 1, 10 * TTL, "a newcomer admitted")
    admitted = [n.wait(1) for n in newcomers if n.done.is_set()]
    assert len(admitted) == 1 and admitted[0].version == ra.version, admitted


def test_the_last_call_waits_for_a_slow_survivor(run) -> None:
    """min_nodes=1, max 3: A, B, C train, a spare waits. C leaves; B re-joins at once and owns the new round's
    (short) last call; the spare looks at the old round once B joined (hooked); A re-joins 2/3 of the TTL
    later. The last call must not freeze the round while A, a member of the previous round, is expected and
    a place is free: A, B and the spare form the next round."""
    r = run(min_nodes=1, max_nodes=3, last_call_timeout=0.3)
    b_joined, on_ticket = _ticket_event(1)
    a, c = r.agent(), r.agent()
    b = r.agent(before_take_ticket=on_ticket)
    v1 = _form([a, b, c])
    spare = _spares(r, 1, a, before_list=_looks_after(a, v1, b_joined))[0]
    c.rdzv.leave()
    eventually(lambda: b.rdzv.num_nodes_waiting() >= 1, 10 * TTL, "B told to re-form")
    b.start()
    time.sleep(SLOW)  # A's agent looks late: that is the scenario
    ra = a.start().wait(10 * TTL)
    results = [ra, b.wait(10 * TTL), spare.wait(10 * TTL)]
    assert len({x.version for x in results}) == 1 and ra.version > v1 and ra.world_size == 3, results


def _in_round_watch() -> bool:
    """Whether the calling thread is a round watch's (:mod:`rdzv_core.rendezvous.roundwatch`)."""
    return threading.current_thread().name.startswith(roundwatch.THREAD_PREFIX)


def test_the_round_watch_marks_the_survivors_when_the_next_round_is_set_up_while_it_looks(run) -> None:
    """A, B, C train (max 3) for a TTL, spares S1 and S2 wait. C leaves; a spare destroys the round first, and
    sets up the next one while A's and B's round watch, which judged C's key lost and found the round gone,
    looks whether the round is over: no record, then the version counter, then the new round's record
    (hooked). That is the end of the round: the watch must mark A and B re-joining, whose agents re-join 2/3
    of the TTL later. A and B must be members of the next round, with S1; S2 waits on as a spare."""
    r = run(min_nodes=2, max_nodes=3, last_call_timeout=1.0)
    keys = RunKeys(r.params.prefix, r.run_id)
    c_left, destroyed, counter_read, set_up = (threading.Event() for _ in range(4))

    def watch_reads(key: Any) -> None:
        if not _in_round_watch() or not c_left.is_set():
            return
        if key == keys.closed:  # a spare destroys the round first
            destroyed.wait(10)
        elif key == keys.version_counter:  # the next round is set up between its reads of the counter and record
            counter_read.set()
            set_up.wait(10)

    def spare_creates(key: Any) -> None:
        if key == keys.round_record and c_left.is_set():
            destroyed.set()
            counter_read.wait(10)

    def spare_counts(key: Any) -> None:
        if key == keys.version_counter and counter_read.is_set():
            set_up.set()

    a, b, c = (r.agent(before_get=watch_reads) for _ in range(3))
    v1 = _form([a, b, c])
    formed = time.monotonic()
    s1, s2 = _spares(r, 2, a, before_create=spare_creates, before_add=spare_counts)
    # The watch judges a missing key at once only in a round whose members' keep-alives answered for a TTL.
    time.sleep(max(0.0, formed + TTL * 1.25 - time.monotonic()))
    c_left.set()
    c.rdzv.leave()
    eventually(lambda: a.rdzv.num_nodes_waiting() >= 1 and b.rdzv.num_nodes_waiting() >= 1, 10 * TTL,
                "A and B told to re-form")
    eventually(lambda: counter_read.is_set() and set_up.is_set(), 10 * TTL,
                "the next round set up while the round watch looked")
    time.sleep(SLOW)  # A's and B's agents look late: that is the scenario
    a.start(), b.start()
    _assert_survivors_and_first_spare(v1, a, b, s1, s2)
