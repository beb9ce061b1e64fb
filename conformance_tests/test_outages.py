"""Backend outages that end no round (marker ``outages``): the backend away from every node, paused,
restarted empty, failed over to a replica that lost recent writes.

The rule under test (``docs/design.md``, "The backend away"): a member of a final round keeps its
place through an outage of any length when membership did not change -- its keep-alive writes its
key again, the round's record is re-established where the backend lost it, and nobody acts on a
missing key until the backend has answered for a whole ``keep_alive_ttl`` -- while a member that
really died during the outage is let go once that time has passed. Every scenario runs on every
URL: the outage is a :class:`~conformance_tests.gate.Gate` in front of each node's real client
(the server keeps running, its TTLs run out), the lost keys are deleted or rewritten through an
ungated client while the gate is closed; a real SIGSTOP of the server is added where the URL's
server has a controller.

Agents are threads, each with its own client. "No restart" is asserted as no member's
``num_nodes_waiting()`` ever answering >= 1 (what makes an agent stop its workers) and the same
round (version and id) final at the end.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest

from rdzv_core import KVBackend
from rdzv_core.errors import BackendUnavailableError
from rdzv_core.rendezvous import RoundRecord, Status

from .gate import Gate, GatedBackend
from .plugin import backends_opened
from .agents import Agent, crew_of, round_of

pytestmark = pytest.mark.outages

TTL = 2.0  #: keep_alive_ttl (seconds)
OP_TIMEOUT = 0.5  #: seconds a call waits at a closed gate (and the clients' operation_timeout)
OUTAGE = TTL + 1.0  #: seconds the backend is away: longer than the TTL, so every key lapses meanwhile
MARGIN = 3.0  #: scheduling slack (seconds) on deadlines


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def direct(rdzv_base_url: str) -> Iterator[Callable[[], KVBackend]]:
    """Ungated clients (what the failing server does to the keys happens through them)."""
    base, _, query = rdzv_base_url.partition("?")
    url = base + "?" + "&".join(q for q in (query, f"operation_timeout={2 * OP_TIMEOUT}") if q)
    with backends_opened(lambda: url) as factory:
        yield factory


@pytest.fixture
def crew(direct: Callable[[], KVBackend], gate: Gate) -> Iterator[Callable[..., list[Agent]]]:
    """``crew(n, **params)`` -> n agents of one fresh run, each on its own client behind ``gate``."""
    defaults = {"keep_alive_ttl": TTL, "last_call_timeout": 0.3, "timeout": 60.0}
    with crew_of(lambda: GatedBackend(direct(), gate, OP_TIMEOUT), "outage", defaults, leave=True) as make:
        yield make


class Restarts:
    """Polls every member's ``num_nodes_waiting()`` (as an agent's monitor does) and records any >= 1."""

    def __init__(self, members: list[Agent], every: float = 0.1) -> None:
        self.members, self.every = members, every
        self.seen: list[tuple[int, int, float]] = []  # (member index, answer, monotonic time)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, member in enumerate(self.members):
                try:
                    waiting = member.rdzv.num_nodes_waiting()
                except BackendUnavailableError:
                    continue  # the handler answers 0 while the backend is away
                if waiting >= 1:
                    self.seen.append((i, waiting, time.monotonic()))
            self._stop.wait(self.every)

    def stop(self) -> list[tuple[int, int, float]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def _record(kv: KVBackend, members: list[Agent]) -> RoundRecord | None:
    entry = kv.get(members[0].rdzv.keys.round_record)
    return None if entry is None else RoundRecord.decode(entry)


def _alive(kv: KVBackend, member: Agent, version: int, rid: str) -> list[int]:
    entries = kv.list(member.rdzv.keys.alive_dir(version, rid or None))[0]
    return sorted(int(e.key.rsplit("_", 1)[1]) for e in entries)


def _outlast_the_judgement(kv: KVBackend, members: list[Agent], until: float) -> None:
    """Watch the run until ``until`` (monotonic): the window in which a wrong judgement would end the round."""
    tree = members[0].rdzv.keys.tree
    revision = kv.list(tree)[1]
    while (left := until - time.monotonic()) > 0:
        events = kv.watch(tree, revision, left)
        if events:
            revision = max(e.revision for e in events)


def _wipe(kv: KVBackend, members: list[Agent]) -> int:
    """Delete every key of the run (what a server restarted without its data does to it): how many."""
    entries = kv.list(members[0].rdzv.keys.tree)[0]
    for e in entries:
        kv.delete(e.key)
    return len(entries)


def _pause(how: str, gate: Gate, server: Any) -> Callable[[], None]:
    """Start the outage; return what ends it."""
    if how == "paused":
        server.pause()
        return server.resume
    gate.close()
    return gate.open


@pytest.fixture(params=["gated", "paused"])
def outage(request: pytest.FixtureRequest) -> str:
    """``gated``: every node cut off from the backend; ``paused``: the server itself stopped (SIGSTOP),
    where the URL's server has a controller."""
    if request.param == "paused":
        server = request.getfixturevalue("rdzv_server")
        request.addfinalizer(server.resume)
    return str(request.param)


# -- the scenarios ----------------------------------------------------------------------------
def test_members_keep_their_round_through_an_outage_longer_than_the_ttl(
        outage: str, request: pytest.FixtureRequest, crew, direct, gate: Gate, capabilities) -> None:
    """The backend away for 3 x TTL (every key lapses) with a full round of 3 and a spare waiting.

    Expected: no member is ever told to re-rendezvous, the spare destroys nothing; once the backend answers
    again every member's key is written again, and when the backend has answered for a TTL (the time a
    wrong judgement would act) the same round is still final with all three keys.
    """
    server = request.getfixturevalue("rdzv_server") if outage == "paused" else None
    members = crew(3, min_nodes=3, max_nodes=3)
    first = round_of([m.start() for m in members], 30)
    spare = crew(1, min_nodes=3, max_nodes=3)[0].start()
    observer = direct()
    restarts = Restarts(members)
    end = _pause(outage, gate, server)
    try:
        time.sleep(OUTAGE)  # the outage itself: its length is the scenario, nothing to wait for
    finally:
        end()
    back = time.monotonic()
    version, rid = first[0].version, first[0].round_id
    deadline = back + TTL + capabilities.ttl_resolution + MARGIN
    while _alive(observer, members[0], version, rid) != [0, 1, 2]:
        assert time.monotonic() < deadline, f"the members' keys were not written again: {members[0].rdzv.describe()}"
        time.sleep(0.05)
    _outlast_the_judgement(observer, members, back + 2 * TTL + capabilities.ttl_resolution + 0.5)
    seen = restarts.stop()
    record = _record(observer, members)
    assert record is not None and record.status is Status.FINAL and record.is_round(version, rid or None), record
    assert _alive(observer, members[0], version, rid) == [0, 1, 2]
    assert not seen, f"members were told to re-rendezvous: {seen[:5]}"
    assert not spare.done.is_set(), f"the spare left its wait: {spare.result or spare.error}"


def test_a_member_that_died_during_the_outage_is_let_go_after_it(crew, direct, gate: Gate, capabilities) -> None:
    """One of three members dies while the backend is away (its client closed: no refresh, no delete).

    Expected: once the backend answers again, the round is destroyed within one TTL (the survivors' own
    judgement) plus slack, and the two survivors form a round of 2 -- never a round with the dead member.
    """
    members = crew(3, min_nodes=2, max_nodes=3)
    first = round_of([m.start() for m in members], 30)
    observer = direct()
    gate.close()
    try:
        members[2].kv.close()  # dies: its keep-alive ends, its key lapses and nobody writes it again
        time.sleep(OUTAGE)
    finally:
        gate.open()
    back = time.monotonic()
    deadline = back + TTL + capabilities.ttl_resolution + MARGIN
    while (record := _record(observer, members)) is not None and record.is_round(first[0].version,
                                                                                 first[0].round_id or None):
        assert time.monotonic() < deadline, f"the dead member's round stands: {members[0].rdzv.describe()}"
        time.sleep(0.05)
    second = round_of([m.start() for m in members[:2]], 30)
    assert second[0].world_size == 2 and second[0].version > first[0].version


def test_members_restore_their_round_after_the_backend_lost_every_key(
        crew, direct, gate: Gate, capabilities) -> None:
    """The backend loses every key of the run while it is away (a server restarted empty).

    Expected: no member is told to re-rendezvous; the first member to look re-establishes the final record
    (same version, id and members) and the version counter, every member writes its key again; a node that
    arrives afterwards waits as a spare of that round instead of starting round 1.
    """
    members = crew(2, min_nodes=2, max_nodes=2)
    first = round_of([m.start() for m in members], 30)
    version, rid = first[0].version, first[0].round_id
    observer = direct()
    before = _record(observer, members)
    restarts = Restarts(members)
    gate.close()
    try:
        assert _wipe(observer, members) > 0
        time.sleep(OUTAGE)
    finally:
        gate.open()
    back = time.monotonic()
    deadline = back + TTL + capabilities.ttl_resolution + MARGIN
    while _record(observer, members) is None or _alive(observer, members[0], version, rid) != [0, 1]:
        assert time.monotonic() < deadline, f"the round was not re-established: {members[0].rdzv.describe()}"
        time.sleep(0.05)
    late = crew(1, min_nodes=2, max_nodes=2)[0].start()
    _outlast_the_judgement(observer, members, back + 2 * TTL + capabilities.ttl_resolution + 0.5)
    seen = restarts.stop()
    assert _record(observer, members) == before
    counter = observer.get(members[0].rdzv.keys.version_counter)
    assert counter is not None and int(counter.value) >= version
    assert not seen, f"members were told to re-rendezvous: {seen[:5]}"
    assert not late.done.is_set(), f"a node arriving after the restore formed another round: {late.result}"


def test_a_failover_that_lost_the_final_state_and_a_key_is_repaired(
        crew, direct, gate: Gate, capabilities) -> None:
    """The backend comes back from a failover to a replica that missed the last writes: the round's
    record is still frozen (the final compare-and-swap lost) and one member's keep-alive key is missing.

    Expected: the members make the same round final again and write the key again; nobody re-rendezvouses.
    """
    members = crew(3, min_nodes=3, max_nodes=3)
    first = round_of([m.start() for m in members], 30)
    version, rid = first[0].version, first[0].round_id
    observer = direct()
    final = _record(observer, members)
    assert final is not None
    restarts = Restarts(members)
    gate.close()
    try:
        keys = members[0].rdzv.keys
        entry = observer.get(keys.round_record)
        assert entry is not None
        observer.compare_and_swap(keys.round_record, final.replace(status=Status.FROZEN, ranks=None).encode(),
                                  entry.revision)
        observer.delete(keys.alive(version, rid or None, 1))
        time.sleep(2 * OP_TIMEOUT)
    finally:
        gate.open()
    back = time.monotonic()
    deadline = back + TTL + capabilities.ttl_resolution + MARGIN
    while _record(observer, members) != final or _alive(observer, members[0], version, rid) != [0, 1, 2]:
        assert time.monotonic() < deadline, f"the round was not repaired: {members[0].rdzv.describe()}"
        time.sleep(0.05)
    _outlast_the_judgement(observer, members, back + 2 * TTL + capabilities.ttl_resolution + 0.5)
    seen = restarts.stop()
    assert _record(observer, members) == final
    assert not seen, f"members were told to re-rendezvous: {seen[:5]}"
