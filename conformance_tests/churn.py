"""A seeded churn of rendezvous agents recorded into a :class:`~conformance_tests.history.History`.

Each agent is a thread with its own backend client: it calls ``next_round``, then, as an elastic agent's
monitor loop does, polls ``num_nodes_waiting()`` every ``poll`` s (uniform in the range) and re-joins when it
is >= 1. A controller thread of the caller acts every ``tick`` s (uniform in the range): kills an agent
(closes its client; a member in half of the kills), has a member leave for good (``leave()``), and lets new
agents arrive to keep about ``agents`` alive. Actions and pacing are drawn from ``random.Random(seed)``;
thread timing is not deterministic, so a seed reproduces the actions' sequence, not the interleaving.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from rdzv_core import KVBackend, Rendezvous, RendezvousParams

from .history import History

__all__ = ["ChurnAgent", "ChurnResult", "run_churn"]


class ChurnAgent:
    """One node of a churn: ``name``, its own client ``kv`` and :class:`Rendezvous`, and its thread."""

    def __init__(self, name: str, kv: KVBackend, run_id: str, params: RendezvousParams, history: History,
                 rng: random.Random, poll: tuple[float, float], admitted: threading.Event) -> None:
        self.name, self.kv, self.history, self.rng, self.poll = name, kv, history, rng, poll
        self.admitted = admitted  # set at any agent's first admission (shared)
        self.rdzv = Rendezvous(kv, run_id, params)
        self.member = False  # between next_round's return and the next ask or leave
        self.killed = False
        self.stopping = threading.Event()
        self.leave_now = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"churn-{name}", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.history.asked(self.name)
                result = self.rdzv.next_round()
                self.history.admitted(self.name, result)
                self.member = True
                self.admitted.set()
                while not self.stopping.is_set():
                    if self.leave_now.wait(self.rng.uniform(*self.poll)):
                        self.member = False
                        self.history.left(self.name)
                        self.rdzv.leave()
                        return
                    if self.rdzv.num_nodes_waiting() >= 1:
                        break
                self.member = False
        except BaseException as exc:  # a killed or stopped agent's client is closed: expected; else reported
            if not (self.killed or self.stopping.is_set()):
                self.error = exc

    def kill(self) -> None:
        """Die: recorded, then the client is closed (its keep-alive keys lapse)."""
        self.killed = True
        self.history.killed(self.name)
        self.kv.close()


@dataclass
class ChurnResult:
    """What a churn did: its ``seed``, the ``history``, the agents made, action counts, agents' errors."""

    seed: int
    history: History
    agents: list[ChurnAgent]
    kills: int = 0
    leaves: int = 0
    arrivals: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        """Rounds seen (at least one member's ``next_round`` returned)."""
        return len(self.history.rounds())

    @property
    def admissions(self) -> int:
        """``next_round`` calls that returned."""
        return sum(e.kind == "admitted" for e in self.history.events)


def run_churn(clients: Callable[[], KVBackend], seed: int, *, agents: int = 12, duration: float = 12.0,
              min_nodes: int = 2, max_nodes: int = 4, last_call_timeout: float = 0.5, keep_alive_ttl: float = 2.0,
              poll: tuple[float, float] = (0.3, 1.5), tick: tuple[float, float] = (0.4, 1.0),
              p_kill: float = 0.25, p_leave: float = 0.2, run_prefix: str = "churn") -> ChurnResult:
    """Run a churn of about ``agents`` agents for ``duration`` s on clients from ``clients()`` (one each);
    ``p_kill``/``p_leave``: chance per tick of a kill / of a member leaving for good. The ``duration`` counts
    from the first round (a loaded host may take seconds to form it), and the first kill hits a member, so a
    churn always makes a round re-form (were every kill to hit a spare, nothing would be checked). Ends every agent
    (closes its client) and joins its thread before returning; the history is stopped first. The caller
    checks ``result.history`` and ``result.errors`` (an agent's unexpected exception, with its name).

    Raises:
        KVError: opening a client failed.
    """
    rng = random.Random(seed)
    run_id = f"{run_prefix}{uuid.uuid4().hex[:10]}"
    params = RendezvousParams(min_nodes=min_nodes, max_nodes=max_nodes, last_call_timeout=last_call_timeout,
                              keep_alive_ttl=keep_alive_ttl, timeout=10 * duration + 60)
    history = History(keep_alive_ttl, min_nodes, max_nodes)
    result = ChurnResult(seed, history, [])
    first_round = threading.Event()

    def arrive() -> None:
        agent = ChurnAgent(f"n{len(result.agents)}", clients(), run_id, params, history,
                           random.Random(rng.random()), poll, first_round)
        result.agents.append(agent)
        agent.thread.start()

    try:
        for _ in range(agents):
            arrive()
        first_round.wait(params.timeout)  # not formed by then: the agents' RendezvousTimeoutError says so
        member_lost = False
        end = time.monotonic() + duration
        while time.monotonic() < end:
            time.sleep(min(rng.uniform(*tick), max(0.0, end - time.monotonic())))  # the churn's own pacing
            alive = [a for a in result.agents if not a.killed and a.thread.is_alive()]
            draw = rng.random()
            members = [a for a in alive if a.member and not a.leave_now.is_set()]
            if alive and draw < p_kill:  # the first and then half of the kills hit a member (most agents are spares)
                hit_member = members and (rng.random() < 0.5 or not member_lost)
                rng.choice(members if hit_member else alive).kill()
                member_lost = member_lost or bool(hit_member)
                result.kills += 1
            elif draw < p_kill + p_leave:
                if members:
                    rng.choice(members).leave_now.set()
                    member_lost = True
                    result.leaves += 1
            alive = [a for a in result.agents if not a.killed and a.thread.is_alive() and not a.leave_now.is_set()]
            if len(alive) < agents and rng.random() < 0.7:
                arrive()
                result.arrivals += 1
    finally:
        history.stop()
        for agent in result.agents:
            agent.stopping.set()
            agent.kv.close()
        for agent in result.agents:
            agent.thread.join(30)
            if agent.thread.is_alive():
                result.errors.append(f"{agent.name}: thread still running 30 s after its client was closed")
            elif agent.error is not None:
                result.errors.append(f"{agent.name}: {type(agent.error).__name__}: {agent.error}")
    return result
