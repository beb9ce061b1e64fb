"""What ``rdzv-run`` tells a person: rendezvous progress, agent steps, the exit summary.

Everything goes to one text stream (stderr by default), one line per event,
each starting with ``rdzv-run:``. Progress callbacks are duck-typed: any object
(or mapping) with some of ``phase``, ``version``, ``joined``, ``min_nodes``,
``max_nodes``, ``remaining`` is shown (``rdzv_core.rendezvous.Progress`` has
them all); repeated identical progress is printed at most every
:data:`PROGRESS_REPEAT` seconds.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable

from ..api import WorkerFailure, describe_exit
from .error_files import root_cause_text
from ..simple import AgentEvent

__all__ = ["Reporter", "Summary", "PROGRESS_REPEAT"]

#: Seconds between two prints of unchanged rendezvous progress.
PROGRESS_REPEAT = 10.0


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


@dataclass
class Summary:
    """The facts of the one-screen exit summary.

    Attributes:
        outcome: ``"SUCCEEDED"``, or what went wrong (one line).
        exit_code: the launcher's exit status.
        run_id: the run id; url: the redacted rendezvous URL.
        restarts_used, max_restarts, membership_restarts: restart counters.
        group_rank, group_world_size, world_size: the last round (``None`` if none).
        workers: global rank -> (local rank, exit status or None, stopped by the agent).
        failures: the failed workers, earliest first.
        log_dir: where the logs are.
        error: what ended the launcher when it failed (``None`` otherwise).
        entry_point: the workers' entry point as torch names it (the root cause's title).
    """

    outcome: str
    exit_code: int
    run_id: str = ""
    url: str = ""
    restarts_used: int = 0
    max_restarts: int = 0
    membership_restarts: int = 0
    group_rank: int | None = None
    group_world_size: int | None = None
    world_size: int | None = None
    workers: dict[int, tuple[int, int | None, bool]] = field(default_factory=dict)
    failures: list[WorkerFailure] = field(default_factory=list)
    log_dir: str | None = None
    error: BaseException | None = None
    entry_point: str = "workers"

    def render(self) -> str:
        """The summary as text (about 25 lines, and the failures in torch's ChildFailedError format)."""
        rule = "=" * 64
        lines = [rule, "rdzv-run summary", f"  outcome:  {self.outcome} (exit code {self.exit_code})"]
        if self.run_id:
            lines.append(f"  run:      {self.run_id}  {self.url}")
        if self.group_rank is not None:
            lines.append(f"  node:     group rank {self.group_rank} of {self.group_world_size} nodes, "
                         f"world size {self.world_size} (the last round this node was in)")
        lines.append(f"  restarts: {self.restarts_used} of {self.max_restarts} used on failures, "
                     f"{self.membership_restarts} for membership changes")
        shown = sorted(self.workers.items())[:8]
        if shown:
            lines.append("  workers:  the last ones started on this node")
        for rank, (local_rank, code, stopped) in shown:
            status = describe_exit(code) + (" (stopped by the agent)" if stopped and code != 0 else "")
            lines.append(f"{'':11} rank {rank} (local {local_rank}): {status}")
        if len(self.workers) > len(shown):
            lines.append(f"            ... and {len(self.workers) - len(shown)} more")
        if self.failures:
            first = self.failures[0]
            lines.append(f"  error:    rank {first.global_rank} (local {first.local_rank}) "
                         f"{describe_exit(first.exit_code)} first; the failures (torch's format):")
            lines += [f"    {ln}" for ln in root_cause_text(self.failures, self.entry_point, 3).splitlines()]
            if first.log_path:
                lines.append(f"            full stderr: {first.log_path}")
        if self.log_dir:
            lines.append(f"  logs:     {self.log_dir}")
        lines.append(rule)
        return "\n".join(lines)


class Reporter:
    """Prints progress and agent events for a person.

    Args:
        stream: text stream, or a callable returning it at write time (default: ``sys.stderr``).
        clock: monotonic clock (seconds), for rate-limiting repeated progress.
    """

    def __init__(
        self, stream: IO[str] | Callable[[], IO[str]] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stream = stream
        self._clock = clock
        self._last_progress: tuple[Any, ...] | None = None
        self._last_progress_at = -float("inf")

    def say(self, text: str) -> None:
        """Print one line prefixed with ``rdzv-run:``."""
        stream = self._stream() if callable(self._stream) else (self._stream or sys.stderr)
        stream.write(f"rdzv-run: {text}\n")
        stream.flush()

    def waiting(self, run_id: str, min_nodes: Any, max_nodes: Any, timeout: Any, attempt: int,
                incarnation: int | None = None) -> None:
        """Announce that the node is about to wait for a rendezvous round (``incarnation``: the run's, ``None``
        when the handler has none, e.g. torch's static rendezvous; docs/schedulers.md)."""
        nodes = f"{min_nodes if min_nodes is not None else '?'}:{max_nodes if max_nodes is not None else '?'}"
        limit = f"{float(timeout):g} s" if timeout is not None else "the backend's default"
        which = "" if incarnation is None else f", incarnation {incarnation}"
        self.say(f"waiting for rendezvous (run {run_id!r}{which}, nodes {nodes}, timeout {limit}, attempt {attempt})")

    def progress(self, progress: Any) -> None:
        """Progress callback for the handler (see the module docstring)."""
        phase, version, joined = _field(progress, "phase"), _field(progress, "version"), _field(progress, "joined")
        lo, hi, remaining = _field(progress, "min_nodes"), _field(progress, "max_nodes"), _field(progress, "remaining")
        key = (phase, version, joined, lo, hi)
        now = self._clock()
        if key == self._last_progress and now - self._last_progress_at < PROGRESS_REPEAT:
            return
        self._last_progress, self._last_progress_at = key, now
        if phase == "spare":  # the round is full: waiting for a member's place, not for a round
            self.say(f"rendezvous: round {version} is full ({joined} of max {hi} nodes): waiting as a spare")
            return
        parts = [f"round {version}" if version else "round ?"]
        if phase:
            parts.append(str(phase))
        if joined is not None:
            lo_text, hi_text = (lo if lo is not None else "?"), (hi if hi is not None else "?")
            parts.append(f"{joined} joined of min {lo_text} / max {hi_text}")
        if remaining is not None:
            parts.append(f"{max(0.0, float(remaining)):.0f} s left")
        self.say("rendezvous: " + ", ".join(parts))

    def event(self, event: AgentEvent) -> None:
        """Listener for :class:`~rdzv_agent.simple.AgentEvent` (except ``rendezvous``)."""
        d = event.data
        if event.kind == "rendezvous_done":
            self.say(
                f"round formed: node rank {d['group_rank']} of {d['group_world_size']}, world size "
                f"{d['world_size']}, global ranks {d['global_ranks']}, master {d['master_addr']}:{d['master_port']}"
            )
        elif event.kind == "restarting":
            reason = {
                "failed": f"workers failed; {d['remaining_restarts']} restart(s) left after this one",
                "membership": f"membership change: num_nodes_waiting={d.get('nodes_waiting')} (nodes waiting to join, "
                              "or this node's round is gone)",
                "port_in_use": "the master port was taken; choosing another",
                "no_master": "group rank 0 published no master endpoint; forming a new round",
            }.get(d["reason"], d["reason"])
            self.say(f"restarting the worker group: {reason}")
            for exc in list(d.get("failures", {}).values())[:3]:
                self.say(f"  {exc}")
        elif event.kind == "attributed":  # the node ledger's verdict (docs/node-health.md)
            if d.get("first") and d.get("quarantined"):
                until = time.strftime("%H:%M:%S", time.localtime(float(d.get("until") or 0)))
                self.say(f"this node ({d.get('node')}) is quarantined until {until}: {d.get('why')}")
            elif d.get("culprit") and not d.get("first"):
                self.say(f"node {d['culprit']}'s workers failed first: this failure is charged to it")
        elif event.kind == "failed":
            self.say("worker group failed; " + ("no restarts left" if d.get("restart", True) else "not restartable"))
        elif event.kind == "exit_barrier":
            self.say(f"all local workers finished; waiting up to {d['timeout']:g} s for the other nodes of the "
                     "round to finish (exit barrier)")
        elif event.kind == "succeeded":
            barrier = {
                "complete": "; every node of the round is done",
                "left": "; the other nodes re-form without this one (the run stays open for them)",
                "timeout": "; the other nodes did not finish within --exit-barrier-timeout (the run stays open)",
                "unreachable": "; the rendezvous backend did not answer within --exit-barrier-timeout (the run "
                               "stays open)",
                "closed": "; another node ended the job meanwhile (the run is closed)",
            }.get(str(d.get("exit_barrier")), "")
            self.say(f"all local workers finished successfully{barrier}")
