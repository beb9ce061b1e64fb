"""A history checker for rendezvous churn: record what many agents saw, then check the admission order.

:class:`History` records events from many threads (``time.monotonic()`` timestamps, in seconds):
``asked(node)`` (the node called ``next_round``), ``admitted(node, RoundResult)`` (it returned),
``left(node)`` (``leave()`` for good; recorded before the call) and ``killed(node)`` (its client closed;
recorded before the close, so the time is no later than the death). :meth:`History.check` raises
:class:`HistoryViolation` (an ``AssertionError``) listing every violation, each naming nodes, versions
and times (seconds since the first event), with an excerpt of the history around it.

Terms. A *round* is the set of nodes whose ``next_round`` returned the same ``(version, round_id)``;
``first(R)``/``last(R)``: the earliest/latest of those returns (``R`` was final no later than ``first(R)``,
so every ticket of ``R`` was taken before it). A node's *last round* is the last round it was admitted to,
unless it left or was killed since. An ask is a *survivor's* if the node's last round is set, else a
*non-member's*. ``end(V)``: the earliest departure (ask, leave, kill) of a member of ``V`` after its
admission to ``V``: ``V`` cannot have ended earlier. ``ttl`` is ``keep_alive_ttl``.

Predicates (each checks the documented promise and nothing stricter):

1. **Ranks.** Within a round: one ``world_size`` reported by every member, ``min_nodes <= world <= max_nodes``,
   group ranks distinct and in ``0 .. world-1``; every rank reported unless a node was killed while asking
   (a member killed before its ``next_round`` returned is never recorded). A node's rounds have increasing
   versions.
2. **No survivor displaced.** Survivor ``M`` of round ``V`` asked at ``a <= end(V) + rejoin_window``
   (default ``ttl / 3``). Let ``W`` be the first round with a version above ``V``'s. Violation if ``M`` is
   not in ``W``, ``W`` has a member that was not in ``V``, ``M`` was neither killed nor left before
   ``last(W)``, and ``first(W) <= end(V) + ttl``: every ticket of ``W`` was then taken within ``ttl`` of
   the end of ``V`` (the time a survivor keeps its place). If ``W`` holds only members of ``V`` (so it is
   not full of others' newcomers), ``M`` missing it is not a displacement and is not checked.
3. **FIFO among waiting nodes.** A node *waits* from ``w``: its ask time for a non-member's ask; for a
   survivor's ask, if a round with a higher version than its last round formed without it, the later of its
   ask and ``last`` of that round (it is queued once it knows that round final); else it is not checked. It
   waits until its next admission, its kill, or :meth:`History.stop`. Violation if ``Y`` is admitted to ``R``;
   ``X`` is not in ``R``; ``w(X) + order_margin <= w(Y)`` (the margin covers the backend round trips between
   ``next_round`` and taking a place in the queue); both began waiting after the history's first admission
   (before any final round there is no queue); ``X`` was still waiting and not killed at ``last(R)``; and it
   is not excused by the documented bound: ``Y`` waited at least ``ttl`` (``last(R) - w(Y) >= ttl``) and some
   node was killed within ``[w(Y) - ttl - lapse_slack, last(R)]`` (its keys, which ``Y`` waited behind, lapse
   within ``ttl`` of the death; ``lapse_slack`` allows a backend's late expiry).

A round none of whose members returned (all killed at once) is not seen; the predicates are then checked
against the next round seen, which is why every violation message names the rounds it used.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from rdzv_core import RoundResult

__all__ = ["History", "HistoryViolation", "Event"]

RoundKey = tuple[int, str]


class HistoryViolation(AssertionError):
    """:meth:`History.check` found violations; ``violations`` lists their messages."""

    def __init__(self, violations: list[str]) -> None:
        super().__init__(f"{len(violations)} violation(s):\n" + "\n\n".join(violations))
        self.violations = violations


@dataclass(frozen=True)
class Event:
    """One recorded event: ``t`` (monotonic s), ``kind`` (``asked``/``admitted``/``left``/``killed``), ``node``;
    ``result`` for ``admitted``; ``survivor_of`` for ``asked`` (the node's last round, or ``None``)."""

    t: float
    kind: str
    node: str
    result: RoundResult | None = None
    survivor_of: RoundKey | None = None


@dataclass
class _Wait:
    node: str
    start: float  # w
    asked: float
    survivor_of: RoundKey | None
    admitted_to: RoundKey | None = None
    admitted_at: float = float("inf")
    killed_at: float = float("inf")


@dataclass
class _Round:
    key: RoundKey
    members: dict[str, Event] = field(default_factory=dict)

    @property
    def first(self) -> float:
        return min(e.t for e in self.members.values())

    @property
    def last(self) -> float:
        return max(e.t for e in self.members.values())


class History:
    """Thread-safe event log of a churn run and its checker (see the module for the predicates).

    Args:
        keep_alive_ttl: the run's ``keep_alive_ttl`` (s); min_nodes, max_nodes: the run's.
        rejoin_window: a survivor asking within this many s of its round's end is protected (default ttl/3).
        order_margin: s by which a waiting node must precede another for FIFO to be checked.
        lapse_slack: s allowed beyond ``ttl`` for a dead node's keys to lapse.
        clock: the time source (monotonic seconds).
    """

    def __init__(self, keep_alive_ttl: float, min_nodes: int, max_nodes: int, *, rejoin_window: float | None = None,
                 order_margin: float = 0.25, lapse_slack: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.min_nodes, self.max_nodes = keep_alive_ttl, min_nodes, max_nodes
        self.rejoin_window = keep_alive_ttl / 3 if rejoin_window is None else rejoin_window
        self.order_margin, self.lapse_slack, self.clock = order_margin, lapse_slack, clock
        self.events: list[Event] = []
        self.stopped_at: float | None = None
        self._lock = threading.Lock()
        self._last_round: dict[str, RoundKey] = {}

    # -- recording -----------------------------------------------------------------------------------------
    def asked(self, node: str) -> None:
        """``node`` calls ``next_round`` (record it just before the call)."""
        with self._lock:
            self._add(Event(self.clock(), "asked", node, survivor_of=self._last_round.get(node)))

    def admitted(self, node: str, result: RoundResult) -> None:
        """``node``'s ``next_round`` returned ``result``."""
        with self._lock:
            self._add(Event(self.clock(), "admitted", node, result=result))
            self._last_round[node] = (result.version, result.round_id)

    def left(self, node: str) -> None:
        """``node`` leaves the run for good (record it just before ``leave()``)."""
        with self._lock:
            self._add(Event(self.clock(), "left", node))
            self._last_round.pop(node, None)

    def killed(self, node: str) -> None:
        """``node`` dies (record it just before its client is closed)."""
        with self._lock:
            self._add(Event(self.clock(), "killed", node))
            self._last_round.pop(node, None)

    def stop(self) -> None:
        """The run ends: later events are ignored, nodes still waiting wait until now."""
        with self._lock:
            if self.stopped_at is None:
                self.stopped_at = self.clock()

    def _add(self, event: Event) -> None:
        if self.stopped_at is None:
            self.events.append(event)

    # -- reading -------------------------------------------------------------------------------------------
    def rounds(self) -> list[_Round]:
        """The rounds seen, by version."""
        rounds: dict[RoundKey, _Round] = {}
        for e in self.events:
            if e.kind == "admitted" and e.result is not None:
                key = (e.result.version, e.result.round_id)
                rounds.setdefault(key, _Round(key)).members[e.node] = e
        return sorted(rounds.values(), key=lambda r: r.key)

    def _rel(self, t: float) -> str:
        return "never" if t == float("inf") else f"{t - (self.events[0].t if self.events else 0.0):.3f}s"

    def excerpt(self, t0: float, t1: float, nodes: set[str] | None = None, limit: int = 60) -> str:
        """The events in ``[t0, t1]`` (with ``nodes``: their events at any time, and the others' admissions and
        kills in ``[t0, t1]``), one per line, at most ``limit``."""
        lines = []
        for e in self.events:
            inside = t0 <= e.t <= t1
            if (nodes is None and inside) or (nodes is not None and (
                    e.node in nodes or (inside and e.kind in ("admitted", "killed")))):
                what = e.kind
                if e.result is not None:
                    what += f" v{e.result.version} rank {e.result.rank}/{e.result.world_size}"
                if e.kind == "asked":
                    what += f" (survivor of v{e.survivor_of[0]})" if e.survivor_of else " (non-member)"
                lines.append(f"  {self._rel(e.t)} {e.node} {what}")
        more = f"\n  ... {len(lines) - limit} more" if len(lines) > limit else ""
        return "\n".join(lines[:limit]) + more

    # -- checking ------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`HistoryViolation` if any predicate fails (see the module)."""
        violations = self.violations()
        if violations:
            raise HistoryViolation(violations)

    def violations(self) -> list[str]:
        """Every violation's message (empty: the history keeps the promises)."""
        with self._lock:
            rounds = self.rounds()
            return self._ranks(rounds) + self._survivors(rounds) + self._fifo(rounds)

    def _killed_at(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.events:
            if e.kind == "killed":
                out.setdefault(e.node, e.t)
        return out

    def _ranks(self, rounds: list[_Round]) -> list[str]:
        out: list[str] = []
        killed_asking = self._killed_while_asking()
        for r in rounds:
            name = f"round v{r.key[0]} ({r.key[1]})"
            worlds = {e.result.world_size for e in r.members.values() if e.result}
            ranks = sorted(e.result.rank for e in r.members.values() if e.result)
            if len(worlds) != 1:
                out.append(f"{name}: members report world sizes {sorted(worlds)}: "
                           + ", ".join(f"{n}={e.result.world_size if e.result else '?'}" for n, e in r.members.items()))
                continue
            world = worlds.pop()
            if not self.min_nodes <= world <= self.max_nodes:
                out.append(f"{name}: world size {world} outside [{self.min_nodes}, {self.max_nodes}]")
            if len(set(ranks)) != len(ranks) or any(not 0 <= k < world for k in ranks):
                out.append(f"{name}: ranks {ranks} not distinct in 0..{world - 1}: "
                           + ", ".join(f"{n}={e.result.rank if e.result else '?'}" for n, e in r.members.items()))
            missing = world - len(ranks)
            unseen = [n for n, t in killed_asking if t <= r.last + self.ttl + self.lapse_slack]
            if missing > len(unseen):
                out.append(f"{name}: world {world} but only {len(ranks)} members returned ({sorted(r.members)}), "
                           f"and only {len(unseen)} nodes were killed while asking by then")
        seen: dict[str, int] = {}
        for e in self.events:
            if e.kind == "admitted" and e.result is not None:
                if e.result.version <= seen.get(e.node, 0):
                    out.append(f"{e.node}: admitted to v{e.result.version} after v{seen[e.node]}")
                seen[e.node] = e.result.version
        return out

    def _killed_while_asking(self) -> list[tuple[str, float]]:
        asking: dict[str, bool] = {}
        out = []
        for e in self.events:
            if e.kind == "asked":
                asking[e.node] = True
            elif e.kind == "admitted":
                asking[e.node] = False
            elif e.kind == "killed" and asking.get(e.node):
                out.append((e.node, e.t))
        return out

    def _departure_after(self, node: str, t: float) -> float:
        """The first ask, leave or kill of ``node`` at or after ``t`` (inf: none)."""
        for e in self.events:
            if e.node == node and e.t >= t and e.kind in ("asked", "left", "killed"):
                return e.t
        return float("inf")

    def _gone_at(self, node: str, after: float) -> float:
        """When ``node`` was killed or left at or after ``after`` (inf: never)."""
        for e in self.events:
            if e.node == node and e.t >= after and e.kind in ("left", "killed"):
                return e.t
        return float("inf")

    def _survivors(self, rounds: list[_Round]) -> list[str]:
        out: list[str] = []
        by_key = {r.key: r for r in rounds}
        for ask in self.events:
            if ask.kind != "asked" or ask.survivor_of is None or ask.survivor_of not in by_key:
                continue
            v = by_key[ask.survivor_of]
            end = min(self._departure_after(n, e.t) for n, e in v.members.items())
            if ask.t > end + self.rejoin_window:
                continue
            later = [r for r in rounds if r.key[0] > v.key[0]]
            if not later:
                continue
            w = later[0]
            newcomers = sorted(set(w.members) - set(v.members))
            if ask.node in w.members or not newcomers or w.first > end + self.ttl:
                continue
            if self._gone_at(ask.node, ask.t) < w.last:
                continue
            out.append(
                f"survivor displaced: {ask.node}, member of v{v.key[0]} ({sorted(v.members)}), asked to re-join at "
                f"{self._rel(ask.t)} ({ask.t - end:.3f} s after v{v.key[0]} ended at {self._rel(end)}), alive, "
                f"is not in v{w.key[0]} ({sorted(w.members)}, formed {self._rel(w.first)}..{self._rel(w.last)}, "
                f"{w.first - end:.3f} s after the end), which admitted non-member(s) {newcomers}\n"
                + self.excerpt(end - self.ttl, w.last + 0.01, {ask.node} | set(w.members)))
        return out

    def _waits(self, rounds: list[_Round]) -> list[_Wait]:
        """Every waiting interval (see the module)."""
        waits: list[_Wait] = []
        open_: dict[str, _Wait] = {}
        for e in self.events:
            if e.kind == "asked":
                open_[e.node] = _Wait(e.node, e.t, e.t, e.survivor_of)
                waits.append(open_[e.node])
            elif e.kind == "admitted" and e.node in open_ and e.result is not None:
                wait = open_.pop(e.node)
                wait.admitted_to, wait.admitted_at = (e.result.version, e.result.round_id), e.t
            elif e.kind == "killed" and e.node in open_:
                open_.pop(e.node).killed_at = e.t
        for wait in waits:
            if wait.survivor_of is None:
                continue
            missed = [r for r in rounds if r.key[0] > wait.survivor_of[0] and wait.node not in r.members and
                      r.last < wait.admitted_at]
            # queued at its ask if a newer round had formed already, else once the first newer round forms
            wait.start = max(wait.asked, missed[0].last) if missed else float("inf")  # never queued: not checked
        return waits

    def _fifo(self, rounds: list[_Round]) -> list[str]:
        out: list[str] = []
        if not rounds:
            return out
        opened = min(r.first for r in rounds)
        kills = sorted(self._killed_at().values())
        waits = [w for w in self._waits(rounds) if w.start >= opened and w.start != float("inf")]
        by_key = {r.key: r for r in rounds}
        for y in waits:
            if y.admitted_to is None:
                continue
            r = by_key[y.admitted_to]
            for x in waits:
                if x.node in r.members or x.start + self.order_margin > y.start:
                    continue
                if x.admitted_at <= r.last or x.killed_at <= r.last or x.start > r.last:
                    continue
                waited = r.last - y.start
                dead = [k for k in kills if y.start - self.ttl - self.lapse_slack <= k <= r.last]
                if waited >= self.ttl and dead:
                    continue
                out.append(
                    f"FIFO broken: {y.node} (waiting since {self._rel(y.start)}) was admitted to v{r.key[0]} "
                    f"({sorted(r.members)}, formed {self._rel(r.first)}..{self._rel(r.last)}) ahead of {x.node} "
                    f"(alive and waiting since {self._rel(x.start)}, admitted {self._rel(x.admitted_at)}); "
                    f"{y.node} waited {waited:.3f} s, kills in its window: {len(dead)}\n"
                    + self.excerpt(x.start - self.ttl, r.last + 0.01, {x.node, y.node}))
        return out
