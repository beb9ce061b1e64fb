"""How many failure restarts an agent may still make: ``--max-restarts``, over the job's life or per window.

torchrun counts ``--max-restarts`` over the job's life: a week-long job is ended by its fourth unrelated
failure. With ``--restart-window S`` a restart counts for ``S`` seconds only: at most ``max_restarts`` within
any ``S``-second span, so failures far apart never end the job and a crash loop still ends after
``max_restarts`` restarts.

A restart is *charged* to a node: this node's (its workers failed first in the round, or nobody knows who
did), or another's (the run's node ledger says that node failed first: ``docs/node-health.md``). A charge to
another node is given back once that node is quarantined and the run goes on without it: a job whose only
faulty node is quarantined keeps its full budget.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .api import WorkerFailure
from .elastic import elastic_handler
from .supervision.hang_watch import WorkerHang

if TYPE_CHECKING:
    from .api import WorkerSpec

__all__ = ["RestartBudget", "Charge", "ATTRIBUTION_MARGIN", "PEER_LOSS", "peer_loss"]

log = logging.getLogger(__name__)

#: Seconds added to a monitor interval while a failed node waits for earlier failure reports of its round
#: (a peer's agent sees its own workers' exit within a monitor interval, then writes its report).
ATTRIBUTION_MARGIN = 0.3
#: What a worker's error says when it failed because a peer of its collective was lost (gloo, NCCL, c10d):
#: such a failure is reported as the peer's, never as this node's own.
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
             "NCCL communicator was aborted", "ncclRemoteError", "DistNetworkError", "Socket Timeout",
             "Timed out waiting", "Connection refused", "collective operation timeout")


#: Exit statuses of a worker stopped by a signal -- the agent's, a scheduler's (a pod deleted, a job cancelled), an
#: operator's: killed by SIGTERM, SIGKILL, SIGINT or SIGHUP, or exiting with 128 + that signal from its handler. Not
#: the node's own failure: never reported to the ledger.
STOP_CODES = frozenset(code for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP)
                       for code in (-int(sig), 128 + int(sig)))


def peer_loss(error: str) -> bool:
    """Whether a worker's error text says a peer of its collective was lost (:data:`PEER_LOSS`)."""
    return any(mark in error for mark in PEER_LOSS)


@dataclass(frozen=True)
class Charge:
    """One failure restart: ``at`` (monotonic seconds) and ``culprit`` (the node whose workers failed first,
    ``None``: this node or unknown)."""

    at: float
    culprit: str | None = None


class RestartBudget:
    """The failure restarts left (see the module).

    Args:
        max_restarts: restarts allowed (int >= 0), over the job's life or per ``window``.
        window: seconds a restart counts for (``None``: for ever, torchrun's rule).
        clock: monotonic seconds (tests pass their own).
        on_verdict: called with the handler's verdict on each failure it attributed (``report_failure``'s dict).
    """

    def __init__(self, max_restarts: int, window: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_verdict: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.max_restarts, self.window, self._clock, self._on_verdict = max_restarts, window, clock, on_verdict
        self._charges: list[Charge] = []
        self.spent = 0  #: failure restarts made so far, whatever they were charged to (TORCHELASTIC_RESTART_COUNT)
        self.culprit: str | None = None  #: the node the last failure was attributed to, when not this one

    def _counted(self) -> list[Charge]:
        if self.window is None:
            return self._charges
        since = self._clock() - self.window
        self._charges = [c for c in self._charges if c.at > since]
        return self._charges

    @property
    def remaining(self) -> int:
        """Restarts still allowed now (int >= 0)."""
        return max(0, self.max_restarts - len(self._counted()))

    def spend(self, culprit: str | None = None) -> None:
        """Charge one restart (to ``culprit``, the node that failed first; ``None``: this node or unknown)."""
        self._charges.append(Charge(self._clock(), culprit))
        self.spent += 1

    def refund(self, excluded: Callable[[str], bool]) -> int:
        """Give back the charges whose culprit ``excluded(name)`` says is out of the run (quarantined, and the
        run goes on without it); return how many."""
        culprits = {c.culprit for c in self._charges if c.culprit is not None}
        gone = {name for name in culprits if excluded(name)}
        before = len(self._charges)
        self._charges = [c for c in self._charges if c.culprit not in gone]
        return before - len(self._charges)

    def attribute(self, spec: "WorkerSpec", failures: dict[int, Exception]) -> str | None:
        """Report this node's failed workers to the handler's node ledger (rdzv's handlers: ``report_failure``)
        and set :attr:`culprit`: the node whose workers failed first, when it is another one (``None``: this node,
        or unknown). Workers whose error says a peer was lost (:func:`peer_loss`) are reported as such: never the
        culprit. Hangs are not reported: every node of a hung collective stops progressing at once, so who hung
        first cannot be told by time, and neither are workers stopped by a signal (:data:`STOP_CODES`: the agent's,
        a scheduler's, an operator's)."""
        self.culprit = None
        elastic = elastic_handler(spec.rdzv_handler)
        exits = [exc for exc in failures.values() if isinstance(exc, WorkerFailure) and not isinstance(exc, WorkerHang)
                 and exc.timestamp is not None and exc.exit_code not in STOP_CODES]
        if elastic is None or not exits:
            return None
        own = [exc for exc in exits if not peer_loss(exc.error)]  # the workers that failed of their own
        first = min(own or exits, key=lambda exc: exc.timestamp or 0.0)
        verdict = elastic.report_failure(first.timestamp or 0.0, first.describe(),
                                         spec.monitor_interval + ATTRIBUTION_MARGIN, not own)
        if verdict is not None and self._on_verdict is not None:
            self._on_verdict(verdict)
        if verdict is not None and not verdict["first"]:
            self.culprit = str(verdict["culprit"])
            log.info("[%s] node %s's workers failed first: this node's failure restart is charged to it", spec.role,
                     self.culprit)
        return self.culprit

    def allows(self, spec: "WorkerSpec", failures: dict[int, Exception], restart: bool) -> bool:
        """Whether the failed group (``failures``; ``restart``: whether it may be restarted at all) is restarted:
        the failure is attributed first (:meth:`attribute`); a budget spent is refilled with the restarts charged
        to nodes quarantined and left out since (the handler's ``node_excluded``)."""
        self.attribute(spec, failures)
        if not restart:
            return False
        if self.remaining == 0:
            elastic = elastic_handler(spec.rdzv_handler)
            if elastic is not None and self.refund(elastic.node_excluded):
                log.info("[%s] restarts charged to quarantined nodes given back: %d/%d left", spec.role,
                         self.remaining, self.max_restarts)
        return self.remaining > 0
