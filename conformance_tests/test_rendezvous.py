"""Rendezvous state-machine scenarios, run against every backend (marker ``rendezvous``).

Agents are threads, each with its own backend client (as separate hosts would
have). Every wait is bounded by a deadline; assertions are on ranks, world
sizes, versions and raised errors.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable

import pytest

from rdzv_core import (
    KVBackend,
    Rendezvous,
    RendezvousClosedError,
    RendezvousParams,
    RendezvousStateError,
    RendezvousTimeoutError,
    RoundResult,
)
from rdzv_core.rendezvous import RunKeys

from .agents import TTL, Agent, Hooked
from .waiting import eventually

pytestmark = pytest.mark.rendezvous

def _wait_all(agents: list[Agent], timeout: float = 30.0) -> list[RoundResult]:
    deadline = time.monotonic() + timeout
    return [a.wait(max(0.0, deadline - time.monotonic())) for a in agents]


def _assert_round(results: list[RoundResult], world: int) -> None:
    assert sorted(r.rank for r in results) == list(range(world))
    assert {r.world_size for r in results} == {world}
    assert len({r.version for r in results}) == 1


def test_min_equals_max(agents) -> None:
    group = [a.start() for a in agents(3, min_nodes=3, max_nodes=3)]
    _assert_round(_wait_all(group), 3)


def test_min_below_max_closes_after_last_call(agents) -> None:
    group = agents(2, min_nodes=2, max_nodes=4, last_call_timeout=0.5)
    t0 = time.monotonic()
    for a in group:
        a.start()
    results = _wait_all(group)
    _assert_round(results, 2)
    assert time.monotonic() - t0 >= 0.5  # the last call was waited out


def test_max_reached_ends_last_call_early(agents) -> None:
    group = agents(3, min_nodes=2, max_nodes=3, last_call_timeout=60.0)
    t0 = time.monotonic()
    for a in group:
        a.start()
    _assert_round(_wait_all(group, timeout=50.0), 3)
    assert time.monotonic() - t0 < 50.0  # did not wait for the 60 s last call


def test_thirty_two_agents_get_distinct_ranks(agents) -> None:
    group = [a.start() for a in agents(32, min_nodes=32, max_nodes=32, keep_alive_ttl=3.0, timeout=60.0)]
    _assert_round(_wait_all(group, timeout=60.0), 32)


def test_late_node_is_counted_waiting_then_admitted(agents) -> None:
    first = [a.start() for a in agents(2, min_nodes=2, max_nodes=3, last_call_timeout=0.3)]
    r1 = _wait_all(first)
    _assert_round(r1, 2)
    late = agents(1, min_nodes=2, max_nodes=3, last_call_timeout=0.3)[0].start()
    deadline = time.monotonic() + 20
    while first[0].rdzv.num_nodes_waiting() != 1:
        assert time.monotonic() < deadline, "late node never counted as waiting"
        assert not late.done.is_set(), f"late node finished early: {late.result} {late.error}"
        time.sleep(0.05)
    assert first[1].rdzv.num_nodes_waiting() == 1
    for a in first:  # the members re-rendezvous to admit it (as the agent's monitor loop does)
        a.start()
    results = _wait_all(first + [late])
    _assert_round(results, 3)
    assert results[0].version > r1[0].version
    assert first[0].rdzv.num_nodes_waiting() == 0


def test_lapsed_keep_alive_destroys_final_round(agents, kv_factory) -> None:
    """A member dies (its key left to lapse); the survivor re-rendezvouses at once and a newcomer arrives: the
    round is destroyed and the two form the next one. The newcomer, not a member, acts on the missing key only
    after its judgement (``docs/design.md``, "The backend away"), then joins the survivor's new round: its last
    call (2 s) leaves a loaded host's newcomer time to take its ticket."""
    group = [a.start() for a in agents(2, min_nodes=1, max_nodes=3, last_call_timeout=2.0)]
    r1 = _wait_all(group)
    _assert_round(r1, 2)
    crashed, survivor = group
    crashed.kv.close()  # the process "dies": its keep-alive stops, its key is left to lapse
    newcomer = agents(1, min_nodes=1, max_nodes=3, last_call_timeout=2.0)[0]
    t0 = time.monotonic()
    survivor.start()
    newcomer.start()
    results = _wait_all([survivor, newcomer])
    _assert_round(results, 2)
    assert results[0].version > r1[0].version
    assert time.monotonic() - t0 < TTL + 10  # TTL + detection + last call, with margin


def _until(kv: KVBackend, prefix: str, check: Callable[[], bool], timeout: float, what: str) -> None:
    """Re-check ``check()`` after every change under ``prefix`` (and at least every 0.5 s) until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        revision = kv.list(prefix)[1]
        if check():
            return
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        kv.watch(prefix, revision, min(0.5, max(0.0, deadline - time.monotonic())))


def test_lapsed_keep_alive_key_is_written_again(agents, kv) -> None:
    """A member's keep-alive key vanishes (a backend stall longer than the TTL): its keep-alive writes it again.

    EtcdRendezvous' lease renewal stopped for good at the first lapse, so the member
    vanished from a round it still trained in.
    """
    group = [a.start() for a in agents(2, min_nodes=2, max_nodes=2)]
    results = _wait_all(group)
    member, result = group[0], results[0]
    alive_key = member.rdzv.keys.alive(result.version, result.round_id, result.rank)
    kv.delete(alive_key)
    _until(kv, member.rdzv.keys.alive_dir(result.version, result.round_id), lambda: kv.get(alive_key) is not None,
           10 * TTL, "the lapsed keep-alive key was not written again")


def test_member_of_a_destroyed_round_is_told_to_re_rendezvous(agents, kv) -> None:
    """The final round is destroyed while its members train (a late node saw a keep-alive lapse during a stall).

    Expected: every member's ``num_nodes_waiting()`` turns >= 1 -- even before the
    late node has joined the next round -- so its agent re-rendezvouses; EtcdRendezvous
    answered 0 (the round record was no longer final) and the late node waited
    alone until its timeout. Then all three form the next round.
    """
    params = {"min_nodes": 2, "max_nodes": 3, "keep_alive_ttl": 3 * TTL}  # the late node is expected that long
    group = [a.start() for a in agents(2, **params)]
    r1 = _wait_all(group)
    assert [a.rdzv.num_nodes_waiting() for a in group] == [0, 0]
    state_key = group[0].rdzv.keys.round_record
    entry = kv.get(state_key)
    assert entry is not None
    kv.compare_and_delete(state_key, entry.revision)  # what the late node's destroy does
    assert [a.rdzv.num_nodes_waiting() >= 1 for a in group] == [True, True]
    late = agents(1, **params)[0].start()
    eventually(lambda: group[0].rdzv.describe().get("queued") == 1, 20, "the late node queued")
    for a in group:  # the agents' monitor loop re-rendezvouses on num_nodes_waiting() > 0
        a.start()
    results = _wait_all(group + [late])
    _assert_round(results, 3)
    assert results[0].version > r1[0].version
    assert [a.rdzv.num_nodes_waiting() for a in group] == [0, 0]


def test_frozen_round_whose_members_never_confirm_is_destroyed(agents, kv, run_id) -> None:
    """A round froze with 2 members that died before confirming (its record has no TTL).

    Expected: nodes that arrive see no confirmation progress for keep_alive_ttl,
    destroy the round and form a new one.
    """
    keys = RunKeys("torchelastic/p2p", run_id)
    kv.put(keys.version_counter, b"1")
    kv.put(keys.round_record,
           b'{"status": "frozen", "version": 1, "participants": 2, "id": "dead"}')
    t0 = time.monotonic()
    group = [a.start() for a in agents(2, min_nodes=2, max_nodes=2)]
    results = _wait_all(group)
    _assert_round(results, 2)
    assert results[0].version == 2
    assert time.monotonic() - t0 >= TTL  # waited out the stall, did not destroy at first sight


def test_a_stalled_frozen_round_that_turns_final_under_its_destroyer_is_kept(kv_factory, run_id) -> None:
    """B's confirmation is held back past keep_alive_ttl, so A, confirmed, finds the frozen round stalled
    and compare-and-deletes it; just before A's delete reaches the backend, B confirms and makes the round
    final. Expected: A's delete loses the race and A keeps the final round (one version, ranks 0 and 1).
    Before the fix A gave the round up anyway and deleted its keep-alive key, which destroyed B's round
    too, and waited alone in the next one (seen in CI over etcd-v3)."""
    keys = RunKeys("torchelastic/p2p", run_id)
    release, held = threading.Event(), threading.Event()
    b_holder: list[Agent] = []

    def hold_confirmation(key: str) -> None:
        if key.endswith("/confirmed") and not release.is_set():
            held.set()
            release.wait(30)

    def let_b_finish_first(key: str) -> None:
        if key == keys.round_record and not release.is_set():
            release.set()
            b_holder[0].done.wait(30)

    params = RendezvousParams(min_nodes=2, max_nodes=2, keep_alive_ttl=TTL, last_call_timeout=0.5, timeout=15)
    a = Agent(Hooked(kv_factory(), before_compare_and_delete=let_b_finish_first), run_id, params)  # type: ignore[arg-type]
    b = Agent(Hooked(kv_factory(), before_take_ticket=hold_confirmation), run_id, params)  # type: ignore[arg-type]
    b_holder.append(b)
    try:
        a.start(), b.start()
        results = _wait_all([a, b], timeout=30)
        _assert_round(results, 2)
        assert release.is_set() and held.is_set(), "the race was not staged: A never tried to destroy the round"
    finally:
        release.set()
        for agent in (a, b):
            agent.rdzv.leave()


def test_a_confirmation_lost_to_a_backend_error_is_repaired_not_the_round_destroyed(kv_factory, run_id) -> None:
    """B's first confirmation (``take_ticket``) fails before it reaches the backend (a transient error: the node cannot
    tell it from one that took effect, so it never counts again). Expected: the round of 2 becomes final in
    its first version, found complete from the members' keep-alive keys. Before, the count stayed at 1,
    the frozen round stalled and was destroyed after keep_alive_ttl, and a second round was formed (what
    1,024 clients on one overloaded machine met again and again)."""
    from rdzv_core.errors import BackendUnavailableError

    failed = threading.Event()

    def lose_first_confirmation(key: str) -> None:
        if key.endswith("/confirmed") and not failed.is_set():
            failed.set()
            raise BackendUnavailableError("injected: the confirmation never reached the backend")

    params = RendezvousParams(min_nodes=2, max_nodes=2, keep_alive_ttl=TTL, last_call_timeout=0.5, timeout=15)
    a = Agent(kv_factory(), run_id, params)
    b = Agent(Hooked(kv_factory(), before_take_ticket=lose_first_confirmation), run_id, params)  # type: ignore[arg-type]
    try:
        a.start(), b.start()
        results = _wait_all([a, b], timeout=30)
        assert failed.is_set(), "the fault was not injected: B never confirmed"
        _assert_round(results, 2)
        assert results[0].version == 1, [r.version for r in results]
    finally:
        for agent in (a, b):
            agent.rdzv.leave()


def test_leaving_member_lets_others_reform_promptly(agents) -> None:
    group = [a.start() for a in agents(3, min_nodes=2, max_nodes=3, last_call_timeout=0.3)]
    r1 = _wait_all(group)
    _assert_round(r1, 3)
    group[0].rdzv.leave()  # a clean leave deletes the keep-alive key at once
    for a in group[1:]:
        a.start()
    results = _wait_all(group[1:])
    _assert_round(results, 2)
    assert results[0].version > r1[0].version
    assert not group[0].rdzv.is_closed()


def test_closed_run_refuses_new_rounds(agents) -> None:
    group = [a.start() for a in agents(2, min_nodes=2, max_nodes=3)]
    _assert_round(_wait_all(group), 2)
    waiting = agents(1, min_nodes=2, max_nodes=3)[0].start()  # a late node: waits until the members re-form
    eventually(lambda: group[0].rdzv.num_nodes_waiting() == 1, 20, "the late node counted as waiting")
    group[0].rdzv.set_closed()
    assert group[1].rdzv.is_closed()
    with pytest.raises(RendezvousClosedError):
        waiting.wait(20)
    with pytest.raises(RendezvousClosedError):
        group[1].start().wait(20)


def test_overall_timeout(agents) -> None:
    lonely = agents(1, min_nodes=2, max_nodes=2, timeout=1.0)[0]
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeoutError):
        lonely.start().wait(10)
    assert 1.0 <= time.monotonic() - t0 <= 3.0


def test_extra_data(agents) -> None:
    group = [a.start() for a in agents(2, min_nodes=2, max_nodes=2)]
    r = _wait_all(group)
    payload = bytes(range(256))
    group[0].rdzv.store_extra_data(r[0].version, "weights/../x\x00", payload)
    assert group[1].rdzv.load_extra_data(r[0].version, "weights/../x\x00", timeout=5) == payload
    with pytest.raises(RendezvousTimeoutError):
        group[1].rdzv.load_extra_data(r[0].version, "never", timeout=0.3)


@pytest.mark.parametrize(
    "garbage",
    [b"not json", b"[1, 2]", b'{"status": "final", "version": -3, "participants": 2}',
     b'{"status": "final", "version": 1, "participants": "x"}', b"\xff" * 5000],
)
def test_corrupt_round_record_is_a_state_error(agents, kv, run_id, garbage: bytes) -> None:
    kv.put(RunKeys("torchelastic/p2p", run_id).round_record, garbage)
    agent = agents(1, min_nodes=1, max_nodes=1)[0]
    with pytest.raises(RendezvousStateError) as info:
        agent.start().wait(10)
    assert info.value.key == f"torchelastic/p2p/run_{run_id}/state/round"  # the key as operators see it


def test_two_runs_are_independent(kv_factory) -> None:
    p = RendezvousParams(min_nodes=1, max_nodes=1, keep_alive_ttl=TTL, timeout=20)
    a = Agent(kv_factory(), f"a{uuid.uuid4().hex[:8]}", p).start()
    b = Agent(kv_factory(), f"b{uuid.uuid4().hex[:8]}", p).start()
    ra, rb = a.wait(20), b.wait(20)
    assert (ra.rank, ra.world_size, rb.rank, rb.world_size) == (0, 1, 0, 1)
    a.rdzv.set_closed()
    assert not b.rdzv.is_closed()
    a.rdzv.leave()
    b.rdzv.leave()


def test_parameters_are_validated() -> None:
    from rdzv_core import ConfigError

    with pytest.raises(ConfigError, match="min_nodes"):
        RendezvousParams(min_nodes=3, max_nodes=2)
    with pytest.raises(ConfigError, match="keep_alive_ttl"):
        RendezvousParams(min_nodes=1, keep_alive_ttl=0)
    with pytest.raises(ConfigError, match="min_nodes"):
        RendezvousParams(min_nodes=0)


@pytest.mark.parametrize("run_id", ["a/b", "..", "", "x" * 129, "a\x00b", "job?min_nodes=1"])
def test_a_run_id_that_could_escape_its_prefix_is_refused(kv, run_id: str) -> None:
    """Also when the state machine is built in code rather than from a URL: ``a/b`` would live inside run ``a``."""
    from rdzv_core import InvalidURLError

    with pytest.raises(InvalidURLError) as info:
        Rendezvous(kv, run_id, RendezvousParams(min_nodes=1))
    assert info.value.field == "run_id"


# -- membership rules: lapse detection by members, spares, finished members ------------------------------------


def test_members_notice_a_lost_member_without_a_waiting_node(agents, capabilities) -> None:
    """A member dies without leaving (its client closed: no delete, the key lapses); no node waits to join.

    Expected: the other members' ``num_nodes_waiting()`` turn >= 1 within about the TTL plus the
    backend's expiry resolution -- their own watch of the round's keep-alive keys destroyed it -- so
    their agents re-form; then they form a round of 2. (EtcdRendezvous left this to waiting nodes: with
    none, the survivors trained on with a dead peer until their collectives timed out.)
    """
    group = [a.start() for a in agents(3, min_nodes=2, max_nodes=3, last_call_timeout=0.3)]
    r1 = _wait_all(group)
    _assert_round(r1, 3)
    lost, *survivors = group
    lost.kv.close()  # a host lost without warning: its keep-alive stops, its key is left to lapse
    t0 = time.monotonic()
    eventually(lambda: all(a.rdzv.num_nodes_waiting() >= 1 for a in survivors),
               TTL + capabilities.ttl_resolution + 3.0, "the survivors noticed the lost member")
    took = time.monotonic() - t0
    assert took >= 0.5 * TTL  # a lapse, not a false alarm at first sight
    for a in survivors:
        a.start()
    results = _wait_all(survivors)
    _assert_round(results, 2)
    assert results[0].version > r1[0].version


def test_a_member_that_leaves_is_noticed_at_once(agents) -> None:
    """A member leaves cleanly (deletes its key): the others see ``num_nodes_waiting() >= 1`` well within the TTL."""
    group = [a.start() for a in agents(3, min_nodes=2, max_nodes=3, last_call_timeout=0.3)]
    _assert_round(_wait_all(group), 3)
    group[0].rdzv.leave()
    eventually(lambda: all(a.rdzv.num_nodes_waiting() >= 1 for a in group[1:]), 20 * TTL,
                "the others noticed the member that left")


def test_a_spare_does_not_disturb_a_full_round_and_takes_a_lost_place(agents, kv_factory) -> None:
    """``max_nodes`` members train; a third node arrives: it is counted as waiting but the members'
    ``num_nodes_waiting()`` stay 0 (no restart storm). A member is lost: the spare takes its place."""
    members = [a.start() for a in agents(2, min_nodes=2, max_nodes=2)]
    r1 = _wait_all(members)
    spare = agents(1, min_nodes=2, max_nodes=2, timeout=2 * TTL)[0].start()
    eventually(lambda: members[0].rdzv.describe().get("waiting") == 1, 20, "the spare counted as waiting")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * TTL:  # longer than the spare's own timeout: a spare does not time out
        assert [m.rdzv.num_nodes_waiting() for m in members] == [0, 0]
        assert not spare.done.is_set(), f"the spare ended: {spare.result} {spare.error!r}"
        time.sleep(0.05)
    lost, survivor = members
    lost.kv.close()
    eventually(lambda: survivor.rdzv.num_nodes_waiting() >= 1, 20 * TTL, "the survivor told to re-form")
    results = _wait_all([survivor.start(), spare])
    _assert_round(results, 2)
    assert results[0].version > r1[0].version


def test_a_spare_exits_gracefully_when_the_run_closes(agents) -> None:
    from rdzv_core import RendezvousGracefulExitError

    members = [a.start() for a in agents(2, min_nodes=2, max_nodes=2)]
    _wait_all(members)
    spare = agents(1, min_nodes=2, max_nodes=2)[0].start()
    eventually(lambda: members[0].rdzv.describe().get("waiting") == 1, 20, "the spare counted as waiting")
    members[0].rdzv.set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        spare.wait(20 * TTL)


def test_a_finished_member_leaves_without_breaking_the_round(agents, capabilities) -> None:
    """A member whose work is done leaves with ``finished``: the others and a spare carry on in the round."""
    group = [a.start() for a in agents(3, min_nodes=2, max_nodes=3, last_call_timeout=0.3)]
    r1 = _wait_all(group)
    before = group[1].rdzv.describe()
    group[0].rdzv.leave(finished=True)
    spare = agents(1, min_nodes=2, max_nodes=3, last_call_timeout=0.3)[0].start()
    eventually(lambda: group[1].rdzv.describe().get("waiting") == 1, 20, "the spare counted as waiting")
    time.sleep(TTL + capabilities.ttl_resolution + 1.0)  # asserted: nothing happens (a plain key would lapse)
    after = group[1].rdzv.describe()
    assert (after["status"], after["version"], after.get("id")) == ("final", r1[0].version, before.get("id"))
    assert [a.rdzv.num_nodes_waiting() for a in group[1:]] == [0, 0]
    assert not spare.done.is_set()
    assert any(m.get("finished") for m in after["alive"])


def test_others_carry_on_once_the_round_re_formed_without_this_node(agents) -> None:
    group = [a.start() for a in agents(3, min_nodes=2, max_nodes=3, last_call_timeout=0.3)]
    _assert_round(_wait_all(group), 3)
    assert [a.rdzv.others_carry_on() for a in group] == [False, False, False]
    left_behind, *others = group
    others[0].start()  # leaves the round (its key is deleted) and joins the next one
    eventually(lambda: others[1].rdzv.num_nodes_waiting() >= 1, 20 * TTL, "told to re-form")
    others[1].start()
    _assert_round(_wait_all(others), 2)
    assert left_behind.rdzv.others_carry_on()
    assert [a.rdzv.others_carry_on() for a in others] == [False, False]


def test_a_survivor_keeps_its_place_against_two_spares(agents) -> None:
    """A full round of 2 with two spares waiting; a member is lost. The survivor, re-forming as its agent does,
    must not lose its place to the spares (they wait for the old round's live members to join first)."""
    members = [a.start() for a in agents(2, min_nodes=2, max_nodes=2)]
    _wait_all(members)
    spares = [a.start() for a in agents(2, min_nodes=2, max_nodes=2)]
    eventually(lambda: members[1].rdzv.describe().get("waiting") == 2, 20, "both spares counted as waiting")
    lost, survivor = members
    lost.kv.close()
    eventually(lambda: survivor.rdzv.num_nodes_waiting() >= 1, 20 * TTL, "the survivor told to re-form")
    time.sleep(0.2)  # an agent stops its workers first; the spares saw the lapse at least as early
    result = survivor.start().wait(20 * TTL)
    assert result.world_size == 2
    eventually(lambda: sum(s.done.is_set() for s in spares) == 1, 20 * TTL, "one spare admitted")
    admitted = next(s for s in spares if s.done.is_set())
    assert admitted.wait(1).version == result.version
    assert not next(s for s in spares if not s.done.is_set()).done.is_set()  # the other one is a spare again


def test_a_member_marked_finished_may_die_without_breaking_the_round(agents, capabilities) -> None:
    """A member whose work is done (its agent waits at the exit barrier) is marked finished, then dies:
    its key stays, so the others carry on; without the mark they would destroy the round and re-form."""
    group = [a.start() for a in agents(3, min_nodes=2, max_nodes=3, last_call_timeout=0.3)]
    r1 = _wait_all(group)
    assert group[0].rdzv.mark_finished() and not group[0].rdzv.mark_finished()  # idempotent
    assert group[1].rdzv.others_still_working()
    group[0].kv.close()  # dies while it waits: no keep-alive any more
    time.sleep(TTL + capabilities.ttl_resolution + 1.0)  # asserted: nothing happens (an unmarked key would lapse)
    assert [a.rdzv.num_nodes_waiting() for a in group[1:]] == [0, 0]
    state = group[1].rdzv.describe()
    assert (state["status"], state["version"]) == ("final", r1[0].version)


def test_survivors_re_form_at_once_while_a_dead_members_key_still_lives(agents) -> None:
    """A member dies; its key lives on until its (long) TTL. The survivors re-form as their agents do: the first
    at once (its workers failed with the dead peer), the second when told to. They were members of the old
    round, so neither waits for the old round's other keys (a spare would, for at most the TTL): the round of 2
    forms within a fraction of the TTL, not after it."""
    ttl = 10.0
    group = [a.start() for a in agents(3, min_nodes=2, max_nodes=3, last_call_timeout=0.3, keep_alive_ttl=ttl)]
    r1 = _wait_all(group)
    lost, first, second = group
    lost.kv.close()  # its key stays for the TTL
    t0 = time.monotonic()
    first.start()
    eventually(lambda: second.rdzv.num_nodes_waiting() >= 1, ttl / 2, "the second survivor told to re-form")
    results = _wait_all([first, second.start()], timeout=3 * ttl)
    _assert_round(results, 2)
    assert results[0].version > r1[0].version
    took = time.monotonic() - t0
    assert took < ttl / 2, f"the survivors took {took:.1f} s to re-form: they waited for the dead member's key"


def test_a_spare_takes_a_dead_members_place_at_once_while_its_key_still_lives(agents) -> None:
    """A full round of 2 and a spare; a member dies and its key lives on until its (long) TTL. The survivor
    re-forms at once (its workers failed with the dead peer): the spare joins it within a fraction of the TTL,
    not after it (it waits only for the old round's members that may still come, not for the dead one)."""
    ttl = 10.0
    members = [a.start() for a in agents(2, min_nodes=2, max_nodes=2, keep_alive_ttl=ttl)]
    r1 = _wait_all(members)
    spare = agents(1, min_nodes=2, max_nodes=2, keep_alive_ttl=ttl)[0].start()
    eventually(lambda: members[1].rdzv.describe().get("waiting") == 1, 20, "the spare counted as waiting")
    lost, survivor = members
    lost.kv.close()  # its key stays for the TTL
    t0 = time.monotonic()
    results = _wait_all([survivor.start(), spare], timeout=3 * ttl)
    _assert_round(results, 2)
    assert results[0].version > r1[0].version
    took = time.monotonic() - t0
    assert took < ttl / 2, f"the survivor and the spare took {took:.1f} s to re-form: they waited for the dead key"
