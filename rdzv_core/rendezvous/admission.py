"""Admission order: who takes a ticket in a round that follows a final one, and when.

A round that re-forms after a final round (the *previous* round) admits first that round's members that
re-join it (*incumbents*), then the nodes that waited for a place (late nodes, spares, newcomers), in the
order they began to wait (the *queue*). A node that was not a member of the previous round takes a ticket
only when doing so cannot push anyone ahead of it out of the round::

    joined + incumbents expected + queued nodes ahead of it expected + 1 <= max_nodes

or once it has waited ``keep_alive_ttl`` (the bound: a survivor keeps its place that long). The last-call
owner of such a round does not freeze it while nodes are expected and places are free, within the same
bound. Who is expected (:meth:`Admission.look`), counted from ``since`` (when the looking node began to
join):

* an incumbent, while its keep-alive key in the previous round is present, not finished, and not marked
  as having taken a ticket in this round: for ``keep_alive_ttl`` once it is marked re-joining (its process
  saw the round end, or its agent called ``next_round``); while unmarked, for ``keep_alive_ttl / 3`` by a
  node deciding whether to take its ticket (a live member marks itself well within that; a dead member's
  key, alive until its TTL, is not waited for longer), and for :func:`unmarked_grace` (at most
  :data:`UNMARKED_GRACE_MAX` s) by the owner of a last call freezing at once (wrongly left out, a live member
  costs a grow, not its place: the places it needs were left free);
* a queued node, until it took a ticket in this round, for ``keep_alive_ttl``.

The previous round is the last final round the node saw, or ``ROOT/admission/last`` (written when a round
becomes final). Rule and reasons: ``docs/design.md``, "Admission order".
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from ..errors import BackendClosedError, BackendUnavailableError
from .keepalive import KeepAlive
from ..kv import KVBackend
from .record import REJOINED, REJOINING, RunKeys, encode_json, member_record, round_segment

__all__ = ["Admission", "Expected", "UNMARKED_GRACE_MAX", "unmarked_grace", "write_last_final"]

log = logging.getLogger("rdzv_core.rendezvous")

#: Seconds an incumbent whose key is not marked re-joining is expected for, at most: its round watch marks
#: it as soon as it sees the round end, so a key still unmarked after that is most likely a dead member's.
UNMARKED_GRACE_MAX = 0.5


def unmarked_grace(ttl: float) -> float:
    """Seconds an unmarked incumbent is expected for: ``ttl / 3``, at most :data:`UNMARKED_GRACE_MAX`."""
    return min(ttl / 3, UNMARKED_GRACE_MAX)


@dataclass(frozen=True)
class Expected:
    """One look at a joinable round: ``joined`` tickets; ``incumbents`` and queued nodes (``queued``; of them
    ``ahead`` before the looking node) expected but not joined yet; ``until``: ``time.monotonic()`` when the
    first of them stops being expected unless it joins (``inf``: none is expected)."""

    joined: int
    incumbents: int
    ahead: int
    queued: int
    until: float = float("inf")

    def room_for_me(self, limit: int) -> bool:
        """Whether a ticket taken now leaves a place for everyone expected ahead of the looking node."""
        return self.joined + self.incumbents + self.ahead + 1 <= limit

    def awaited(self, limit: int) -> int:
        """Expected nodes that would still find a free place among ``limit`` (the last call waits for them)."""
        return min(self.incumbents + self.queued, max(0, limit - self.joined))


def write_last_final(kv: KVBackend, keys: RunKeys, version: int, rid: str | None) -> None:
    """Record round ``(version, rid)`` as the run's last final round (``ROOT/admission/last``).

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
    """
    kv.put(keys.last_final, encode_json({"version": version, "id": rid}))


class Admission:
    """One node's place in the admission order of one run (see the module).

    Args:
        kv: the backend; keys: the run's keys; node_id: this node's id; ttl: ``keep_alive_ttl`` (s).

    Attributes:
        previous: ``(version, round id)`` of the previous round, or ``None`` (no final round known).
        since: ``time.monotonic()`` when this node began to join (its first join attempt), or ``None``.
        position: this node's place in the queue (int >= 1), or ``None`` (not queued).
    """

    def __init__(self, kv: KVBackend, keys: RunKeys, node_id: str, ttl: float) -> None:
        self.kv, self.keys, self.node_id, self.ttl = kv, keys, node_id, ttl
        self.previous: tuple[int, str | None] | None = None
        self.since: float | None = None
        self.position: int | None = None
        self._value: dict[str, Any] = {}
        self._keepalive: KeepAlive | None = None

    def saw_final(self, version: int, rid: str | None) -> None:
        """This node saw round ``(version, rid)`` final (it waited on it as a late node or spare)."""
        if self.previous is None or version > self.previous[0]:
            self.previous = (version, rid)

    def arrive(self, last_round: tuple[int, str, int] | None) -> None:
        """``next_round`` begins: learn the previous round (``ROOT/admission/last``, and ``last_round``, the
        ``(version, round id, rank)`` of this node's last round) and, if this node was not a member of it,
        take a place in the queue at once, so that a round re-forming meanwhile expects it.

        Raises:
            BackendUnavailableError, BackendClosedError: from ``kv``.
            RendezvousStateError: the queue counter is corrupt.
        """
        if last_round is not None:
            self.saw_final(last_round[0], last_round[1] or None)
        entry = self.kv.get(self.keys.last_final)
        if entry is not None:
            try:
                data = json.loads(entry.value.decode("utf-8"))
                self.saw_final(int(data["version"]), data.get("id") or None)
            except (UnicodeDecodeError, ValueError, TypeError, KeyError):
                log.warning("run=%s: ignoring a malformed %s: %r", self.keys.run_id, self.keys.last_final,
                            entry.value[:80])
        if self._newcomer(last_round):
            self.enqueue()

    def _newcomer(self, last_round: tuple[int, str, int] | None) -> bool:
        """Whether this node (last round ``last_round``) was not a member of the previous round or a later one."""
        return self.previous is not None and (last_round is None or last_round[0] < self.previous[0])

    def begin(self, version: int, last_round: tuple[int, str, int] | None) -> bool:
        """This node is about to take a ticket in round ``version``: whether it must wait for its place (a round
        after the previous one, and this node not a member of that or a later one). Marks ``since`` (when this
        node began to join: the bound counts from it) unless set since this node last waited for a round to end.

        Raises:
            BackendUnavailableError, BackendClosedError: from ``kv``.
            RendezvousStateError: the queue counter is corrupt.
        """
        if self.since is None:
            self.since = time.monotonic()
        if self.previous is None or self.previous[0] >= version or not self._newcomer(last_round):
            return False
        self.enqueue()
        return True

    def waited(self) -> None:
        """This node waited for a round to end (as a late node or spare): the bound counts afresh."""
        self.since = None

    def enqueue(self) -> None:
        """Take a place at the end of the queue (once per ``next_round``): the key first, then the position,
        so that a node that looks in between counts this one as ahead of it (no position yet).

        Raises:
            BackendUnavailableError, BackendClosedError: from ``kv``.
            RendezvousStateError: the queue counter is corrupt.
        """
        if self._keepalive is not None:
            return
        key = self.keys.queued(self.node_id)
        self._value = {"node": self.node_id, "since": round(time.time(), 3)}
        self.kv.put(key, encode_json(self._value), ttl=self.ttl)
        self.position = self.kv.take_ticket(self.keys.queue_counter)
        self._write({"q": self.position})
        self._keepalive = KeepAlive(self.kv, key, self.ttl, value=encode_json(self._value),
                                    name=f"rdzv-keepalive-{self.keys.run_id}-queue")

    def entered(self, version: int, rid: str | None) -> None:
        """This queued node took a ticket in round ``(version, rid)``: the nodes behind it may follow.

        Raises:
            BackendUnavailableError, BackendClosedError: from ``kv``.
        """
        if self._keepalive is not None:
            self._write({"in": round_segment(version, rid)})

    def _write(self, changes: dict[str, Any]) -> None:
        self._value.update(changes)
        value = encode_json(self._value)
        if self._keepalive is not None:
            self._keepalive.value = value
        self.kv.put(self.keys.queued(self.node_id), value, ttl=self.ttl)

    def end(self) -> None:
        """``next_round`` ended: leave the queue (a backend error is logged: the key lapses) and forget."""
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None:
            keepalive.stop()
            try:
                self.kv.delete(self.keys.queued(self.node_id))
            except (BackendUnavailableError, BackendClosedError) as exc:
                log.warning("run=%s: could not leave the admission queue (its key lapses): %s", self.keys.run_id,
                            exc)
        self.since, self.position, self._value = None, None, {}

    def look(self, version: int, rid: str | None, since: float, unmarked: float) -> tuple[Expected, int]:
        """Who is expected in round ``(version, rid)``, counted from ``since`` (see the module; an unmarked
        incumbent for ``unmarked`` s), and the keyspace revision to watch from.

        Raises:
            BackendUnavailableError, BackendClosedError: from ``kv``.
            CorruptEntryError: the round's join counter is corrupt.
        """
        segment = round_segment(version, rid)
        revisions: list[int] = []
        incumbents = 0
        until = float("inf")
        now = time.monotonic()
        previous = self.previous
        if previous is not None:
            entries, revision = self.kv.list(self.keys.alive_dir(*previous))
            revisions.append(revision)
            for entry in entries:
                member = member_record(entry)
                if "finished" in member or "corrupt" in member or member.get(REJOINED) == segment:
                    continue
                expires = since + (self.ttl if REJOINING in member else unmarked)
                if now < expires:
                    incumbents += 1
                    until = min(until, expires)
        ahead = queued = 0
        if now < since + self.ttl:
            entries, revision = self.kv.list(self.keys.queue_dir)
            revisions.append(revision)
            mine = self.keys.queued(self.node_id)
            for entry in entries:
                member = member_record(entry)
                if entry.key == mine or "corrupt" in member or member.get("in") == segment:
                    continue
                queued += 1
                until = min(until, since + self.ttl)
                position = member.get("q")
                ahead += not isinstance(position, int) or (self.position is not None and position < self.position)
        joined = self.kv.tickets(self.keys.joined(version, rid))
        if not revisions:  # nothing to wait for: the revision of the join counter's directory
            revisions.append(self.kv.list(self.keys.round_dir(version, rid))[1])
        return Expected(joined, incumbents, ahead, queued, until), min(revisions)
