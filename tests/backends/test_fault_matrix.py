"""The agent kill matrix: one agent PROCESS dies at each phase of a round; the others recover.

Three agents of one run (``tests/support/fault_agents/agent.py``, one process each):
the victim V and the survivors S1, S2; ``min_nodes=2``, ``max_nodes=3``,
``keep_alive_ttl`` = :data:`TTL`, ``last_call_timeout`` = :data:`LAST_CALL`.
V is stopped at an exact point of the state machine (the agent's
``--block-at``) or sits in a final round, and is then sent SIGKILL (dies,
leaves nothing) or SIGTERM (leaves cleanly: ``leave()``, never ``set_closed``).
Each test runs the SIGKILL run and the SIGTERM run side by side (two runs,
six processes; each V is signalled as soon as it is at the phase), which
halves the suite's time; each run is judged on its own.

Expected every time: S1 and S2 complete a new round of world size 2 within
:func:`recovery_bound` seconds of V stopping — ``keep_alive_ttl +
last_call_timeout`` plus a margin of the backend's declared ``ttl_resolution``
(how late it may notice an expiry) and :data:`MARGIN` seconds of scheduling
slack on a loaded 2-core machine. "V stopping" is its arrival at the stopping
point (to the others a stopped agent is already a dead one) or, in a final
round, the signal. No survivor raises or waits past its overall ``timeout``;
the leaving agent never closes the run.

===========  ==========================================  =======================================
phase        where V is when signalled                   what the survivors wait out
===========  ==========================================  =======================================
setup        created the setup record (TTL), not made    the setup record's TTL, then a round
             joinable                                    of 2 with its last call
join         holds ticket 1 of a joinable round          the round freezes with V in it; the
             (below min_nodes)                           frozen record's TTL; a new round
last_call    owns the last call (record marked, TTL),    the marked record's TTL (or a frozen
             no refresh since                            round with V in it); a new round
confirm      member of the frozen round, not confirmed   no confirmation for a TTL (the frozen
                                                         record has no TTL); a new round
final        member of the final round (keep-alive key)  nothing: they re-rendezvous at once,
                                                         find the round no longer whole and
                                                         destroy it; a new round
===========  ==========================================  =======================================

SIGTERM before ``final`` leaves the same state as SIGKILL (V holds no
keep-alive key yet; a leaving agent does not withdraw a ticket or a setup
record), so both take about as long. ``memory://`` is skipped (in-process
only; the agents are processes). ``docs/reliability.md`` is rendered from
these tests by ``conformance_tests/reliability_table.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass

import pytest

from tests.support.fault_agents import AgentGroup, AgentProcess
from tests.support.waiting import eventually
from rdzv_core import (
    Rendezvous,
    RendezvousClosedError,
    RendezvousParams,
    list_backends,
    open_backend,
    parse_backend_url,
)
from rdzv_core.outage import LATEST_JUDGEMENT
from rdzv_core.rendezvous import RoundRecord, RunKeys, Status

pytestmark = [pytest.mark.slow, pytest.mark.launchers]

TTL = 1.0  #: keep_alive_ttl (seconds)
LAST_CALL = 1.0  #: last_call_timeout (seconds)
TIMEOUT = 30.0  #: the agents' overall rendezvous timeout (seconds)
MARGIN = 3.0  #: scheduling slack on top of TTL + last call + ttl_resolution (seconds)
START = 60.0  #: seconds for the agent processes to start and reach their phase (a loaded machine)

PHASES = ("setup", "join", "last_call", "confirm", "final")
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}

def recovery_bound(ttl_resolution: float) -> float:
    """Seconds from V stopping to the survivors' new round: TTL + last call + ``ttl_resolution`` + margin."""
    return TTL + LAST_CALL + ttl_resolution + MARGIN


@dataclass
class Trio:
    """One run's three agents: the victim and two survivors.

    ``stopped`` is when V stopped taking part, from the others' point of view: its
    ``blocked`` event (a stopped agent is as good as dead to them) or, in a final
    round (where its keep-alive runs until the end), the signal.
    """

    url: str
    victim: AgentProcess
    survivors: tuple[AgentProcess, AgentProcess]
    stopped: float = 0.0


@pytest.fixture
def group(tmp_path):
    made = AgentGroup(str(tmp_path))
    yield made
    made.kill_all()


@pytest.fixture
def new_run(rdzv_base_url, rdzv_url):
    """``new_run()`` -> a fresh run's URL with the matrix's parameters (memory:// skipped)."""
    if rdzv_base_url.startswith("memory://"):
        pytest.skip("memory:// is one process's keyspace; these agents are separate processes")
    return lambda: rdzv_url(min_nodes=2, max_nodes=3, keep_alive_ttl=TTL, last_call_timeout=LAST_CALL,
                            timeout=TIMEOUT)


def _start(group: AgentGroup, url: str, tag: str, phase: str) -> Trio:
    victim = group.start(f"{tag}-V", url, block_at=None if phase == "final" else phase)
    return Trio(url, victim, (group.start(f"{tag}-S1", url), group.start(f"{tag}-S2", url)))


def _bring_to_phase(phase: str, trio: Trio, deadline: float) -> None:
    """Drive the trio until V is at ``phase`` with the survivors asked for a round (``final``: all three
    finished round 1)."""
    victim, (s1, s2) = trio.victim, trio.survivors
    for agent in (victim, s1, s2):
        agent.wait_for("ready", deadline)
    joining = lambda d: d["phase"] == "joining"  # noqa: E731
    if phase == "last_call":  # V must hold ticket min_nodes = 2: S1 joins first
        s1.send("round")
        s1.wait_for("progress", deadline, match=joining)
        victim.send("round")
        victim.wait_for("blocked", deadline)
        s2.send("round")
        return
    victim.send("round")  # V first: it holds ticket 1, so it is in round 1 whatever the timing
    if phase in ("setup", "join"):
        victim.wait_for("blocked", deadline)
        s1.send("round")
        s2.send("round")
        return
    victim.wait_for("progress", deadline, match=joining)
    s1.send("round")
    s2.send("round")
    if phase == "confirm":
        victim.wait_for("blocked", deadline)
        return
    versions = {a.wait_for("round", deadline)[1].data["version"] for a in (victim, s1, s2)}  # final
    assert len(versions) == 1, f"round 1 did not form with all three agents: {versions}"


def _signal(trio: Trio, phase: str, sig: int) -> list[int]:
    """Signal V; return where to look for the survivors' new round in their events."""
    # Before a final round the survivors were asked for one round only: any round they report is the
    # new one. In a final round they already reported round 1: the new one comes after it.
    marks = [len(s.events) if phase == "final" else 0 for s in trio.survivors]
    signalled = trio.victim.signal(sig)
    if phase == "final":  # their workers would have failed with V's: they re-rendezvous
        trio.stopped = signalled
        for s in trio.survivors:
            s.send("round")
    else:
        trio.stopped = trio.victim.wait_for("blocked", signalled)[1].at
    return marks


def _judge(trio: Trio, sig_name: str, phase: str, marks: list[int], bound: float) -> tuple[float, list[str]]:
    """Wait for the survivors' new round; return (seconds after V stopped, problems found)."""
    problems: list[str] = []
    rounds = []
    partner_died = lambda: any(other.ended for other in trio.survivors)  # noqa: E731  (no round of 2 then)
    for s, mark in zip(trio.survivors, marks, strict=True):
        try:
            rounds.append(s.wait_for("round", trio.stopped + TIMEOUT, after=mark, give_up=partner_died)[1])
        except AssertionError as exc:
            return float("inf"), [f"{sig_name}: {exc}"]
        errors = [e.data for e in s.events[mark:] if e.kind == "error"]
        if errors:
            problems.append(f"{sig_name}: {s.name} raised while recovering: {errors}")
    elapsed = max(e.at for e in rounds) - trio.stopped
    outcome = sorted((e.data["rank"], e.data["world_size"]) for e in rounds)
    if outcome != [(0, 2), (1, 2)] or len({e.data["version"] for e in rounds}) != 1:
        problems.append(f"{sig_name}: survivors did not form one round of 2: {[e.data for e in rounds]}")
    if elapsed > bound:
        problems.append(f"{sig_name}: survivors took {elapsed:.2f} s after V stopped at {phase} (bound {bound:.2f} s)")
    status = trio.victim.wait_exit(10)
    expected = 128 + signal.SIGTERM if sig_name == "SIGTERM" else -signal.SIGKILL
    if status != expected:
        problems.append(f"{sig_name}: V exited with {status}, expected {expected}")
    if sig_name == "SIGTERM" and not any(e.kind == "left" for e in trio.victim.events):
        problems.append("SIGTERM: V did not leave cleanly")
    with open_backend(trio.url) as kv:
        if Rendezvous(kv, parse_backend_url(trio.url)[1].run_id, RendezvousParams(min_nodes=1)).is_closed():
            problems.append(f"{sig_name}: the run was closed")
    return elapsed, problems


@pytest.mark.parametrize("phase", PHASES)
def test_survivors_reform_after_an_agent_dies(phase: str, new_run, rdzv_base_url: str, group: AgentGroup,
                                              record_property) -> None:
    """SIGKILL V at ``phase`` in one run and SIGTERM V at ``phase`` in another: in both, S1 and S2 form
    a new round of 2 within :func:`recovery_bound` seconds of V stopping, raising nothing; V never closes
    the run. Each run's V is signalled as soon as it is at ``phase``."""
    scheme = rdzv_base_url.split("://", 1)[0]
    bound = recovery_bound(list_backends()[scheme].spec.capabilities.ttl_resolution)
    record_property("bound_s", round(bound, 2))
    started = time.monotonic()
    trios = {name: _start(group, new_run(), name, phase) for name in SIGNALS}
    marks = {}
    for name, trio in trios.items():
        _bring_to_phase(phase, trio, started + START)
        marks[name] = _signal(trio, phase, SIGNALS[name])
    record_property("to_phase_s", round(time.monotonic() - started, 2))
    problems = []
    for name, trio in trios.items():
        elapsed, found = _judge(trio, name, phase, marks[name], bound)
        record_property(f"{name}_recovery_s", round(elapsed, 2))
        problems += found
    assert not problems, "\n".join(problems) + "\n" + group.describe()


def test_a_round_stands_when_all_its_members_were_frozen_past_the_ttl(new_run, rdzv_base_url: str,
                                                                     group: AgentGroup) -> None:
    """All three members of a final round SIGSTOPped until the backend expired every keep-alive key (a host
    or VM paused, an overloaded machine that ran none of them), then SIGCONTed together: nobody outside the
    round saw a member lapse, so each member writes its key again and the round stands -- the same record
    for :data:`~rdzv_core.outage.LATEST_JUDGEMENT` TTLs after the thaw, every key back. A member that wakes
    must not judge the keys missing while its own keep-alive has not run since."""
    scheme = rdzv_base_url.split("://", 1)[0]
    resolution = list_backends()[scheme].spec.capabilities.ttl_resolution
    url = new_run()
    deadline = time.monotonic() + START
    agents = [group.start(f"A{i}", url) for i in range(3)]
    for agent in agents:
        agent.wait_for("ready", deadline)
    agents[0].send("round")  # rank 0 first: it holds ticket 1 whatever the timing
    agents[0].wait_for("progress", deadline, match=lambda d: d["phase"] == "joining")
    for agent in agents[1:]:
        agent.send("round")
    assert len({a.wait_for("round", deadline)[1].data["version"] for a in agents}) == 1, group.describe()
    keys = RunKeys("torchelastic/p2p", parse_backend_url(url)[1].run_id)
    with open_backend(url) as kv:
        before = kv.get(keys.round_record)
        record = RoundRecord.decode(before)
        alive = keys.alive_dir(record.version, record.id)
        for agent in agents:
            os.kill(agent.proc.pid, signal.SIGSTOP)
        try:
            eventually(lambda: not kv.list(alive)[0], TTL + resolution + START, "every keep-alive key expired",
                       group.describe)
        finally:
            for agent in agents:
                os.kill(agent.proc.pid, signal.SIGCONT)
        window_end = time.monotonic() + LATEST_JUDGEMENT * TTL + resolution + MARGIN
        under = keys.round_record.rsplit("/", 1)[0] + "/"
        revision = kv.list(under)[1]
        while (left := window_end - time.monotonic()) > 0:  # a change of the record ends the wait early
            events = kv.watch(under, revision, left)
            if any(e.key == keys.round_record for e in events):
                break
            revision = max([revision, *(e.revision for e in events)])
        after = kv.get(keys.round_record)
        assert after is not None and after.revision == before.revision, \
            f"the round was destroyed or rewritten after the thaw: {after}\n{group.describe()}"
        assert len(kv.list(alive)[0]) == 3, f"keep-alive keys not written again: {kv.list(alive)[0]}"
    assert not [e for a in agents for e in a.events if e.kind == "error"], group.describe()


@pytest.mark.parametrize("replacement", ["closed", "setup"])
def test_confirming_member_survives_the_round_being_replaced(replacement: str) -> None:
    """A member waiting in a frozen round for the others to confirm finds the round gone.

    Deterministic form of what the matrix hits when a frozen round lapses: the round
    record is replaced by the next round's setup record (as a survivor that noticed
    the expiry first writes it) or the run is closed (``rdzv close``). Expected: the
    member retries and, the run being closed, raises ``RendezvousClosedError``.
    """
    run_id = f"keyerror{uuid.uuid4().hex[:8]}"
    with open_backend("memory://fault-matrix/") as kv:
        keys = RunKeys("torchelastic/p2p", run_id)
        kv.put(keys.version_counter, b"1")
        kv.put(keys.round_record, RoundRecord(Status.JOINABLE, 1).encode())  # a round without id
        kv.put(keys.joined(1, None), b"1")  # a member that will never confirm holds ticket 1
        saw_setup = threading.Event()
        member = Rendezvous(kv, run_id, RendezvousParams(min_nodes=2, max_nodes=2, keep_alive_ttl=30, timeout=20),
                            on_progress=lambda p: saw_setup.set() if p.phase == "setup" else None)
        outcome: list[BaseException] = []
        thread = threading.Thread(target=lambda: _capture(member.next_round, outcome), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while kv.tickets(keys.confirmed(1, None)) < 1:
            assert time.monotonic() < deadline, "the member never confirmed"
            kv.watch(keys.tree, kv.list(keys.tree)[1], 0.2)
        if replacement == "setup":  # then let the member see it (or die on it) before closing the run
            kv.put(keys.round_record, RoundRecord(Status.SETUP).encode(), ttl=30)
            while not saw_setup.wait(0.05) and thread.is_alive():
                assert time.monotonic() < deadline, "the member never saw the setup record"
        member.set_closed()
        thread.join(15)
        member.leave()
    assert outcome, "next_round did not return"
    if not isinstance(outcome[0], RendezvousClosedError):
        raise outcome[0]


def _capture(fn, out: list[BaseException]) -> None:
    try:
        fn()
        out.append(AssertionError("next_round returned a round"))
    except BaseException as exc:  # handed to the test thread
        out.append(exc)
