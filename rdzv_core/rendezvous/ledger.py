"""The node ledger: failures attributed to a node, and its quarantine (``docs/node-health.md``).

Keys, under the run's ``ROOT`` (:class:`~rdzv_core.rendezvous.record.RunKeys`)::

    ROOT/nodes/NAME                 the ledger entry of node NAME (JSON, compare-and-swapped): its offences
                                    within the window, how often it was quarantined, until when, why
    ROOT/v_V.ID/failures/NAME       NAME's worker group failed in round V (JSON: when the first worker exited,
                                    whether it failed because a peer was lost)

A failure is *attributed* to the node whose workers failed first in the round (the earliest exit time among
the round's failure reports, read once every report that could be earlier had time to arrive: ``settle``
seconds after this node's own exit time). The others' workers most often fail because of it (a collective
with a dead peer): their reports say so (``peer``) and are never the culprit, so a node that was killed --
it reports nothing -- is blamed on nobody. A node with :attr:`QuarantinePolicy.after` offences within
:attr:`QuarantinePolicy.window` seconds is quarantined for a cooldown that doubles with each quarantine (at
most :data:`MAX_COOLDOWN_FACTOR` times): it does not join a round until then, unless the run cannot go on
without it (fail-open: ``rdzv_core.rendezvous.node``). Every write is an ordinary protocol operation
(``get``, ``create``, ``compare_and_swap``, ``put``, ``list``): no backend-specific code.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..errors import CompareFailedError, ConfigError, KeyExistsError, KeyNotFoundError, RendezvousStateError
from ..kv import Entry, KVBackend, escape_segment, join_key, wait_for_change
from .record import RunKeys, encode_json

__all__ = ["QuarantinePolicy", "Offence", "NodeEntry", "NodeLedger", "FailureVerdict", "MAX_COOLDOWN_FACTOR",
           "OFFENCE_KINDS"]

log = logging.getLogger("rdzv_core.rendezvous")

#: A quarantine's cooldown grows as ``cooldown * 2 ** (n - 1)`` for the n-th quarantine, at most this factor.
MAX_COOLDOWN_FACTOR = 16
#: What an offence may be: the node's workers failed first in a round, its pre-flight check failed, its links
#: were out of bounds in the round's network check.
OFFENCE_KINDS = ("failed", "check", "network")
#: Compare-and-swap attempts of one ledger update before it gives up (a corrupt or contested entry).
_UPDATE_ATTEMPTS = 32
#: Characters of a detail kept in the ledger.
_DETAIL_CHARS = 200


@dataclass(frozen=True)
class QuarantinePolicy:
    """When a node is quarantined (URL keys ``quarantine_after``, ``quarantine_window``, ``quarantine_cooldown``).

    Attributes:
        after: offences within ``window`` that quarantine a node (int >= 0; 0: never quarantined, offences are
            still recorded).
        window: seconds an offence counts for (> 0).
        cooldown: seconds of the first quarantine (> 0); the n-th lasts ``cooldown * 2 ** (n - 1)``, at most
            :data:`MAX_COOLDOWN_FACTOR` times ``cooldown``.

    Raises:
        ConfigError: a value out of range (names the field and value).
    """

    after: int = 2
    window: float = 3600.0
    cooldown: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 0:
            raise ConfigError("quarantine_after", self.after, "must be an int >= 0 (0: never quarantine a node)")
        for name in ("window", "cooldown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e9:
                raise ConfigError(f"quarantine_{name}", value, "must be a number of seconds > 0")

    @property
    def enabled(self) -> bool:
        """Whether nodes are ever quarantined."""
        return self.after > 0

    def cooldown_of(self, quarantines: int) -> float:
        """Seconds the ``quarantines``-th quarantine (int >= 1) lasts."""
        return float(self.cooldown) * min(1 << max(quarantines - 1, 0), MAX_COOLDOWN_FACTOR)


@dataclass(frozen=True)
class Offence:
    """One offence: ``at`` (Unix seconds), ``kind`` (one of :data:`OFFENCE_KINDS`), ``detail`` (one line)."""

    at: float
    kind: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "kind": self.kind, "detail": self.detail}


@dataclass(frozen=True)
class NodeEntry:
    """A node's ledger entry (``ROOT/nodes/NAME``).

    Attributes:
        name: the node's name (``node_name``: the scheduler's node name, else the host name).
        offences: the offences within the policy's window, oldest first.
        quarantines: how often the node was quarantined in this run.
        until: Unix time its quarantine ends (``None``: not quarantined).
        why: one line: why it was quarantined (or why its last check failed).
        check: the reason its pre-flight check fails now (``""``: it passed, or never ran).
        fail_open: Unix time it was admitted while quarantined because the run could not go on without it.
    """

    name: str
    offences: tuple[Offence, ...] = ()
    quarantines: int = 0
    until: float | None = None
    why: str = ""
    check: str = ""
    fail_open: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def quarantined(self, now: float | None = None) -> bool:
        """Whether the node is quarantined at Unix time ``now`` (default: now)."""
        return self.until is not None and (time.time() if now is None else now) < self.until

    def left_out(self, now: float | None = None) -> bool:
        """Whether the node is quarantined and was not admitted fail-open: the run goes on without it."""
        return self.quarantined(now) and self.fail_open is None

    def state(self, now: float | None = None) -> str:
        """``"quarantined"``, ``"unhealthy"`` (its check fails) or ``"healthy"``."""
        if self.quarantined(now):
            return "quarantined"
        return "unhealthy" if self.check else "healthy"

    def as_dict(self) -> dict[str, Any]:
        """The entry as stored (and as ``rdzv nodes --json`` shows it)."""
        out: dict[str, Any] = {**self.extra, "node": self.name, "offences": [o.as_dict() for o in self.offences],
                               "quarantines": self.quarantines}
        for name, value in (("until", self.until), ("why", self.why), ("check", self.check),
                            ("fail_open", self.fail_open)):
            if value:
                out[name] = round(value, 3) if isinstance(value, float) else value
        return out

    @classmethod
    def decode(cls, name: str, entry: Entry | None) -> "NodeEntry":
        """The entry stored at ``entry`` (``None``: none yet). A malformed one reads as empty (logged): the ledger
        guides admission, it must not stop a job."""
        if entry is None:
            return cls(name)
        try:
            data = json.loads(entry.value.decode("utf-8"))
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            offences = tuple(Offence(float(o["at"]), str(o["kind"]), str(o.get("detail", "")))
                             for o in data.get("offences", ()))
            if isinstance(data.get("node"), str):
                name = data["node"]  # the key holds it escaped
            until = data.get("until")
            fail_open = data.get("fail_open")
            known = {"node", "offences", "quarantines", "until", "why", "check", "fail_open"}
            return cls(name, offences, int(data.get("quarantines", 0)), float(until) if until else None,
                       str(data.get("why", "")), str(data.get("check", "")),
                       float(fail_open) if fail_open else None, {k: v for k, v in data.items() if k not in known})
        except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
            log.warning("node ledger: ignoring a malformed entry at %s (%s): %r", entry.key, exc, entry.value[:80])
            return cls(name)


@dataclass(frozen=True)
class FailureVerdict:
    """What :meth:`NodeLedger.attribute` found about a failure of this node's workers.

    Attributes:
        culprit: the name of the node whose workers failed first in the round (this node's own name when it
            did), or ``None`` when no round was known.
        first: whether this node is the culprit.
        entry: this node's ledger entry after the failure was recorded.
    """

    culprit: str | None
    first: bool
    entry: NodeEntry


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _DETAIL_CHARS else line[:_DETAIL_CHARS - 3] + "..."


class NodeLedger:
    """The ledger of one run (see the module).

    Args:
        kv: the backend; keys: the run's keys; policy: the :class:`QuarantinePolicy`.
        clock: Unix time (``time.time``; tests pass their own).
        scope: ``"run"`` (the run's own keys) or ``"prefix"`` (``PREFIX/nodes/``: every run under the key prefix
            shares it; entries get a TTL so it stays bounded).
    """

    def __init__(self, kv: KVBackend, keys: RunKeys, policy: QuarantinePolicy,
                 clock: Callable[[], float] = time.time, scope: str = "run") -> None:
        self.kv, self.keys, self.policy, self.clock, self.scope = kv, keys, policy, clock, scope

    @property
    def directory(self) -> str:
        """``ROOT/nodes/`` (scope ``run``) or ``PREFIX/nodes/`` (scope ``prefix``: shared by every run under the
        prefix): every node's entry."""
        return join_key(self.keys.root if self.scope == "run" else self.keys.prefix, "nodes") + "/"

    def key(self, name: str) -> str:
        """The entry of node ``name`` (escaped as one segment) in :attr:`directory`."""
        return self.directory + escape_segment(name)

    def _ttl(self, entry: "NodeEntry") -> float | None:
        """A shared ledger's entry lives while it matters (its window, its quarantine) and a minute more; a run's
        lives as long as the run's keys."""
        if self.scope == "run":
            return None
        return max(self.policy.window, (entry.until or 0.0) - self.clock()) + 60.0

    def failures_dir(self, version: int, rid: str | None) -> str:
        """``ROOT/v_V.ID/failures/``: the round's failure reports."""
        return self.keys.of_round(version, rid, "failures") + "/"

    # -- reading --------------------------------------------------------------------------------
    def read(self, name: str) -> NodeEntry:
        """Node ``name``'s entry (empty if it has none).

        Raises:
            BackendUnavailableError, BackendClosedError: from the backend.
        """
        return NodeEntry.decode(name, self.kv.get(self.key(name)))

    def entries(self) -> list[NodeEntry]:
        """Every node's entry, by name.

        Raises:
            BackendUnavailableError, BackendClosedError: from the backend.
        """
        out = [NodeEntry.decode(stored.key.rsplit("/", 1)[-1], stored) for stored in self.kv.list(self.directory)[0]]
        return sorted(out, key=lambda e: e.name)

    # -- writing --------------------------------------------------------------------------------
    def update(self, name: str, change: Callable[[NodeEntry], NodeEntry]) -> NodeEntry:
        """Apply ``change`` to node ``name``'s entry by compare-and-swap (created when absent); return the result.

        Raises:
            BackendUnavailableError, BackendClosedError: from the backend.
            RendezvousStateError: the entry changed under every one of many attempts.
        """
        key = self.key(name)
        for _ in range(_UPDATE_ATTEMPTS):
            stored = self.kv.get(key)
            new = change(NodeEntry.decode(name, stored))
            value = encode_json(new.as_dict())
            try:
                if stored is None:
                    self.kv.create(key, value, ttl=self._ttl(new))
                else:
                    self.kv.compare_and_swap(key, value, stored.revision, ttl=self._ttl(new))
                return new
            except (KeyExistsError, CompareFailedError, KeyNotFoundError):
                continue  # someone else wrote it meanwhile: read again
        raise RendezvousStateError(f"node ledger entry {key!r} changed under {_UPDATE_ATTEMPTS} updates in a row", key)

    def offend(self, name: str, kind: str, detail: str, at: float | None = None,
               quarantine_now: bool = False) -> NodeEntry:
        """Record an offence of node ``name`` (``kind`` from :data:`OFFENCE_KINDS`) and quarantine it when it
        reached the policy's count within the window -- or at once with ``quarantine_now`` (the cooldown as
        usual; never while the policy is off: ``quarantine_after=0``).

        Raises:
            ConfigError: ``kind`` is not an offence kind.
            BackendUnavailableError, BackendClosedError, RendezvousStateError: as :meth:`update`.
        """
        if kind not in OFFENCE_KINDS:
            raise ConfigError("kind", kind, f"must be one of {', '.join(OFFENCE_KINDS)}")
        offence = Offence(self.clock() if at is None else at, kind, _one_line(detail))
        return self.update(name, lambda entry: self._offended(entry, offence, quarantine_now))

    def _offended(self, entry: NodeEntry, offence: Offence, quarantine_now: bool = False) -> NodeEntry:
        """``entry`` with ``offence`` added (offences out of the window dropped), quarantined if due (see
        :meth:`offend`)."""
        policy, now = self.policy, self.clock()
        recent = tuple(o for o in entry.offences if o.at > now - policy.window) + (offence,)
        if not policy.enabled or entry.quarantined(now) or (len(recent) < policy.after and not quarantine_now):
            return replace(entry, offences=recent)
        count = entry.quarantines + 1
        until = now + policy.cooldown_of(count)
        kinds = ", ".join(sorted({o.kind for o in recent}))
        why = f"{len(recent)} offences ({kinds}) within {policy.window:g} s; the last: {offence.detail}"
        if len(recent) < policy.after:  # quarantine_now
            why = f"a {offence.kind} offence, quarantined at once: {offence.detail}"
        return replace(entry, offences=recent, quarantines=count, until=until, why=_one_line(why), fail_open=None)

    def forgive(self, name: str) -> NodeEntry:
        """Clear node ``name``'s offences and end its quarantine (``rdzv nodes URL --forgive NAME``).

        Raises:
            BackendUnavailableError, BackendClosedError, RendezvousStateError: as :meth:`update`.
        """
        return self.update(name, lambda e: replace(e, offences=(), until=None, why="", fail_open=None,
                                                   extra={**e.extra, "forgiven": round(self.clock(), 3)}))

    def note_check(self, name: str, reason: str) -> NodeEntry:
        """Record node ``name``'s pre-flight check result (``reason``: why it fails, ``""``: it passed). The first
        failure after a pass is an offence (kind ``check``); the re-checks of a node that keeps failing are not.

        Raises:
            BackendUnavailableError, BackendClosedError, RendezvousStateError: as :meth:`update`.
        """
        reason = _one_line(reason)
        entry = self.read(name)
        if entry.check == reason:
            return entry

        def change(entry: NodeEntry) -> NodeEntry:
            if reason and not entry.check:  # a failing streak begins: one offence
                entry = self._offended(entry, Offence(self.clock(), "check", reason))
            return replace(entry, check=reason)

        return self.update(name, change)

    def mark_fail_open(self, name: str) -> NodeEntry:
        """Record that quarantined node ``name`` was admitted because the run could not go on without it.

        Raises:
            BackendUnavailableError, BackendClosedError, RendezvousStateError: as :meth:`update`.
        """
        return self.update(name, lambda e: replace(e, fail_open=round(self.clock(), 3)))

    # -- failures of a round ------------------------------------------------------------------------
    def attribute(self, name: str, version: int, rid: str | None, at: float, detail: str, settle: float,
                  peer: bool = False) -> FailureVerdict:
        """Report that node ``name``'s workers failed in round ``(version, rid)`` at Unix time ``at`` (its first
        worker's exit), and find who failed first: once the round's reports earlier than ``at`` had ``settle``
        seconds to arrive (at once when one already has), the earliest report's node. If that is ``name``, the
        failure is an offence of ``name`` (``detail``: one line, e.g. the exit code and first error line).

        ``peer``: the workers failed because a peer was lost (a collective's connection closed): such a report
        is never the culprit, and is answered at once with the culprit known so far (``None`` if none).

        Raises:
            BackendUnavailableError, BackendClosedError, RendezvousStateError: from the backend.
        """
        directory = self.failures_dir(version, rid)
        self.kv.put(directory + escape_segment(name), encode_json({"node": name, "at": round(at, 6), "peer": peer,
                                                                     "detail": _one_line(detail)}))
        entries, revision = self.kv.list(directory)
        if peer:
            earliest = _earliest(entries)
            return FailureVerdict(earliest[1] if earliest is not None else None, False, self.read(name))
        while True:  # until a report earlier than this one is in, or reports up to ``at`` had ``settle`` s
            earliest = _earliest(entries)
            if earliest is not None and earliest[1] != name and earliest[0] <= at:
                return FailureVerdict(earliest[1], False, self.read(name))
            remaining = at + settle - self.clock()
            if remaining <= 0 or not wait_for_change(self.kv, directory, revision, time.monotonic() + remaining,
                                                     read_revision=revision):
                break
            entries, revision = self.kv.list(directory)
        # no earlier report came (this node's own is in every listing): it failed first
        return FailureVerdict(name, True, self.offend(name, "failed", detail, at))


def _earliest(entries: list[Entry]) -> tuple[float, str] | None:
    """``(at, node)`` of the earliest failure report among ``entries`` (a listing of a round's reports) that is not
    a peer's loss (ties: the smaller name), or ``None``."""
    best: tuple[float, str] | None = None
    for entry in entries:
        try:
            data = json.loads(entry.value.decode("utf-8"))
            report = (float(data["at"]), str(data["node"]))
        except (UnicodeDecodeError, ValueError, TypeError, KeyError):
            continue  # not a report this module wrote
        if data.get("peer"):
            continue
        if best is None or report < best:
            best = report
    return best
