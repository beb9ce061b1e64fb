"""A node partitioned during its join, during its confirmation, and while it waits as a spare.

Four hosts (``conformance_tests.multihost``): Redis on ``server``, one rendezvous agent process on each of
``a``, ``b`` and ``v`` (``tests/support/fault_agents/agent.py``: ``Rendezvous.next_round`` on command, stopped
at an exact point of the state machine with ``--block-at``). The victim V is held at its point, its host
is cut off, and it is let go into the partition (``--release-on``): its requests vanish, nothing is
reset. The others must form their round without V within ``keep_alive_ttl + last_call_timeout +
ttl_resolution + 3 s`` (the kill matrix's bound, ``docs/reliability.md``), and V, healed, must not
disturb it. One backend: the state machine's paths are the same on every backend; how each client meets
a silent link is what scenarios 2 and 3 check on all three. Redis: the shortest ``ttl_resolution``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Iterator

import pytest
from tests.support.agent_workers.harness import REPO

pytestmark = pytest.mark.multihost

AGENT = os.path.join(REPO, "tests", "support", "fault_agents", "agent.py")
TTL, LAST_CALL, RESOLUTION = 2.0, 0.5, 0.1
BOUND = TTL + LAST_CALL + RESOLUTION + 3.0


class Agent:
    """One agent process on a host; its JSON events, each with the ``time.time()`` it was read at."""

    def __init__(self, host: Any, url: str, *args: str) -> None:
        self.host = host
        self.proc = host.popen([sys.executable, AGENT, url, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, bufsize=1, cwd=REPO)
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for("ready", 60)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.events.append({**json.loads(line), "t": time.time()})
                self._changed.notify_all()

    def send(self, command: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return time.time()

    def wait_for(self, event: str, timeout: float, after: float = 0.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for e in self.events:
                    if e["event"] == event and e["t"] > after:
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {event!r} from {self.host.name} within {timeout} s: {self.events}")
                self._changed.wait(left)

    def rounds(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "round"]

    def close(self) -> None:
        self.host.kill()


@pytest.fixture(scope="module")
def hosts(rdzv_hosts_module):
    return rdzv_hosts_module(["server", "a", "b", "v"], resolve="self")


@pytest.fixture(scope="module")
def redis(hosts):
    return hosts["server"].start_redis()


@pytest.fixture
def make(hosts, redis, tmp_path) -> Iterator[Any]:
    address = redis.address
    run_id = f"p5{uuid.uuid4().hex[:8]}"
    agents: list[Agent] = []

    def start(host: str, max_nodes: int, *args: str) -> Agent:
        url = (f"redis://{address}/{run_id}?min_nodes=2&max_nodes={max_nodes}&keep_alive_ttl={TTL}"
               f"&last_call_timeout={LAST_CALL}&timeout=60&operation_timeout=1")
        agent = Agent(hosts[host], url, *args)
        agents.append(agent)
        return agent

    try:
        yield start
    finally:
        hosts.heal("v")
        for agent in agents:
            agent.close()


def _pair_round(a: Agent, b: Agent, after: float, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    ra, rb = a.wait_for("round", timeout, after), b.wait_for("round", timeout, after)
    assert (ra["world_size"], rb["world_size"], ra["version"]) == (2, 2, rb["version"]), (ra, rb)
    assert {ra["rank"], rb["rank"]} == {0, 1}
    return ra, rb


@pytest.mark.parametrize("scheme", ["redis"])
def test_a_node_cut_off_during_its_join_is_left_out(scheme, hosts, make, tmp_path, record_property) -> None:
    """V holds ticket 1 when its host is cut; A and B then freeze a round of 3 with V in it, which V never
    confirms: they destroy it after ``keep_alive_ttl`` and form a round of 2. Healed, V leaves their round
    alone (final, same version) and never reports a round they are not in."""
    _cut_during("join", hosts, make, tmp_path, record_property)


@pytest.mark.parametrize("scheme", ["redis"])
def test_a_node_cut_off_during_its_confirmation_is_left_out(scheme, hosts, make, tmp_path, record_property) -> None:
    """V is a member of the frozen round of 3 and has not confirmed when its host is cut: A and B destroy the
    stalled round after ``keep_alive_ttl`` and form a round of 2; healed, V leaves it alone."""
    _cut_during("confirm", hosts, make, tmp_path, record_property)


def _cut_during(phase: str, hosts: Any, make: Any, tmp_path: Any, record_property: Any) -> None:
    release = str(tmp_path / "release")
    v = make("v", 3, "--block-at", phase, "--release-on", release)
    a, b = make("a", 3), make("b", 3)
    if phase == "join":
        v.send("round")
        v.wait_for("blocked", 30)
    else:
        for agent in (v, a, b):
            agent.send("round")
        v.wait_for("blocked", 30)
    hosts.cut("v")
    cut = time.time()
    open(release, "w").close()  # V carries on into the partition
    v.wait_for("released", 10)
    if phase == "join":
        a.send("round")
        b.send("round")
    ra, _ = _pair_round(a, b, cut, BOUND + 5)
    formed = max(e["t"] for e in (a.rounds() + b.rounds()))
    assert formed - cut <= BOUND, f"the round of 2 formed {formed - cut:.2f} s after the cut"
    hosts.heal("v")
    healed = time.time()
    time.sleep(TTL + RESOLUTION + 1.0)  # V's delayed requests land and it looks again: the window observed
    assert [e for e in a.events + b.events if e["t"] > healed and e["event"] in ("round", "error")] == []
    assert all(r["version"] == ra["version"] and r["world_size"] == 2 for r in v.rounds()), v.events
    record_property("summary", f"round of 2 {formed - cut:.2f} s after the cut (bound {BOUND:.1f} s)")


@pytest.mark.parametrize("scheme", ["redis"])
def test_a_spare_cut_off_disturbs_nobody_and_replaces_a_member_after_the_heal(scheme, hosts, make,
                                                                              record_property) -> None:
    """A full round of 2 (A, B) and V waiting as a spare: V's host is cut; the round stays as it is (nobody
    re-rendezvouses) past the TTL; healed, V still waits, and when A leaves it takes A's place with B."""
    a, b = make("a", 2), make("b", 2)
    started = a.send("round")
    b.send("round")
    ra, _ = _pair_round(a, b, started, 30)
    v = make("v", 2)
    v.send("round")
    spare = v.wait_for("progress", 30)
    while spare.get("phase") != "spare":
        spare = v.wait_for("progress", 30, after=spare["t"])
    hosts.cut("v")
    cut = time.time()
    time.sleep(TTL + RESOLUTION + 1.0)  # past the TTL: a spare's lapse would have shown by now
    hosts.heal("v")
    assert [e for e in a.events + b.events if e["t"] > cut] == [] and v.rounds() == [], (a.events, v.events)
    left = a.send("exit")
    b.send("round")
    rb, rv = b.wait_for("round", BOUND + 10, left), v.wait_for("round", BOUND + 10, left)
    assert (rb["world_size"], rv["world_size"], rb["version"]) == (2, 2, rv["version"]) and \
        rb["version"] > ra["version"], (rb, rv)
    replaced = max(rb["t"], rv["t"]) - left
    record_property("summary", f"the full round unchanged; the spare replaced a member {replaced:.2f} s after it left")
