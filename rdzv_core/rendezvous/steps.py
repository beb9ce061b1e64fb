"""The state machine's decisions, apart from its I/O: what a node does with the round record it read.

:func:`next_step` is a pure function of the record and the node's own state (as torch's
``_RendezvousJoinOp`` returns an action that ``_DistributedRendezvousOpExecutor`` performs);
:class:`~rdzv_core.rendezvous.machine.RoundMachine` performs the step. The small control types
of one attempt live here too.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from ..backoff import Backoff
from ..errors import RendezvousStateError
from .record import RoundRecord, Status

__all__ = ["Step", "next_step", "Held", "Retry", "DeadlinePassedError", "attempt_backoff", "Stall"]


class Step(enum.Enum):
    """What a node does next with the round record it read."""

    CLOSED = "closed"  #: the run is closed: raise RendezvousClosedError (or a graceful exit, as a spare)
    JOIN = "join"  #: take a ticket in the joinable round (or resume the one held)
    RESUME = "resume"  #: carry on confirming as the member this node was before a backend error
    WAIT_AS_LATE_NODE = "late"  #: the round is final without us: count as waiting, watch its members
    CHECK_FROZEN_STALL = "stall"  #: the round is frozen without us: destroy it if confirmations stalled, wait
    WAIT = "wait"  #: a setup record: wait for it to change


@dataclass(frozen=True)
class Held:
    """The round this node holds a ticket in while ``next_round`` runs: version, round id, ticket
    (rank + 1) and whether it confirmed already."""

    version: int
    rid: str | None
    ticket: int
    confirmed: bool = False

    def is_round(self, version: int, rid: str | None) -> bool:
        return (self.version, self.rid) == (version, rid)


def next_step(record: RoundRecord, held: Held | None, max_nodes: int, key: str) -> Step:
    """The step for ``record`` (read at ``key``) by a node holding ``held`` in a run of ``max_nodes``.

    Raises:
        RendezvousStateError: the record has more participants than ``max_nodes`` (a node of this
            job never admits that many).
    """
    status = record.status
    if status is Status.CLOSED:
        return Step.CLOSED
    if (record.participants or 0) > max_nodes:
        raise RendezvousStateError(
            f"round record at {key!r} has {record.participants} participants, more than "
            f"max_nodes={max_nodes}; reset the run's state", key)
    if status is Status.JOINABLE:
        return Step.JOIN
    if held is not None and status in (Status.FROZEN, Status.FINAL) and record.is_round(held.version, held.rid):
        if held.ticket <= (record.participants or 0) and (status is Status.FROZEN or held.confirmed):
            return Step.RESUME
    if status is Status.FINAL:
        return Step.WAIT_AS_LATE_NODE
    if status is Status.FROZEN:
        return Step.CHECK_FROZEN_STALL
    return Step.WAIT


class Retry(Exception):
    """Start the attempt over (after a backoff if ``delay``).

    ``credit``: seconds the attempt spent waiting as a spare, given back to the overall
    deadline (a spare waits for a place, not for a round to form).
    """

    def __init__(self, reason: str, delay: bool = False, credit: float = 0.0) -> None:
        super().__init__(reason)
        self.delay = delay
        self.credit = credit


class DeadlinePassedError(Retry):
    """The attempt's deadline passed (a :class:`Retry` without delay)."""

    def __init__(self) -> None:
        super().__init__("deadline")


def attempt_backoff() -> Backoff:
    """The pause between two attempts of ``next_round``: 10 ms doubling to 1 s, full jitter
    (:class:`~rdzv_core.backoff.Backoff`)."""
    return Backoff(base=0.01, cap=1.0)


class Stall:
    """How long (monotonic seconds) a round has shown one progress snapshot."""

    def __init__(self) -> None:
        self.snapshot: object = None
        self.since = 0.0

    def same_for(self, snapshot: object) -> float:
        now = time.monotonic()
        if snapshot != self.snapshot:
            self.snapshot, self.since = snapshot, now
        return now - self.since
