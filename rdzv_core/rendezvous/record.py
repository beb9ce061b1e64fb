"""The round record, the keep-alive record and the run's key map: encoded and decoded here only.

Keys, under ``ROOT = PREFIX/run_RUN_ID`` (:class:`RunKeys`; incarnation N > 0 of the run:
``ROOT = PREFIX/run_RUN_ID%incN``, a segment no run id's root can be, see :func:`run_segment`)::

    ROOT/state/round            JSON round record (the only key compare-and-swapped)
    ROOT/state/closed           present once the run is closed: {"closed": UNIX_TIME}, TTL closed_run_ttl
    ROOT/state/config           the run's configuration (RunConfig), created by the run's first node
    ROOT/counter/version        round version counter
    ROOT/counter/queue          the admission queue's positions (tickets)
    ROOT/admission/last         the last round that became final: {"version": V, "id": ID}
    ROOT/admission/queue/NODE   a node waiting for a place (TTL): its position and the round it joined
    ROOT/v_V.ID/joined          join tickets of round V (ticket t -> slot t-1; the group rank with rank_policy=join)
    ROOT/v_V.ID/confirmed       confirmations of round V (tickets)
    ROOT/v_V.ID/waiting         late nodes counted while V is final (tickets)
    ROOT/v_V.ID/alive/rank_R    keep-alive key of slot R (TTL; no TTL and "finished" once it finished;
                                "rejoining" once the member re-joins the run, "rejoined" the round it took a ticket in)
    ROOT/v_V.ID/ranks           group rank of each slot, when the round's rank policy is not join
    ROOT/v_V.ID/extra/KEY       extra data of round V
    ROOT/v_V.ID/progress/rank_R progress of the node of rank R (TTL; see rdzv_core.rendezvous.progress_keys)
    ROOT/v_V.ID/failures/NAME   node NAME's workers failed in round V (see rdzv_core.rendezvous.ledger)
    ROOT/nodes/NAME             node NAME's ledger entry (see rdzv_core.rendezvous.ledger)
    ROOT/store/v_V.ID/...       the c10d Store of round V (see rdzv_core.torch_api.store)

``ID`` is the round record's random id (:func:`round_segment`). The three per-round counts are
ticket keys (``KVBackend.take_ticket``/``tickets``): one write per node, no compare-and-swap race.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import ConfigError, InvalidURLError, RendezvousStateError
from ..kv import Entry, escape_segment, join_key
from ..url import DEFAULT_REFORM, RANK_POLICIES, REFORM_RULES, validate_run_id

__all__ = ["Status", "RoundRecord", "RunConfig", "RUN_SETTINGS", "RunKeys", "round_segment", "member_record",
           "run_segment", "parse_run_segment", "RUN_SEGMENT", "INCARNATION_MARK",
           "missing_ranks", "encode_json", "MAX_STATE_BYTES", "REJOINING", "REJOINED"]

#: Bytes a round record may have at most (a larger one is corrupt).
MAX_STATE_BYTES = 4096
#: A round id as written in a record (``uuid4().hex[:16]``) and read back: it becomes part of a key segment.
_ROUND_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The first characters of a run's root segment: ``run_RUN_ID``.
RUN_SEGMENT = "run_"
#: What separates the run id from an incarnation N > 0 in the root segment (``run_RUN_ID%incN``): ``%`` is a key
#: character (:mod:`rdzv_core.keys`) that no run id holds (:func:`rdzv_core.url.validate_run_id`), so an
#: incarnation's root is never another run's, and never below its incarnation 0's root ``run_RUN_ID/``.
INCARNATION_MARK = "%inc"
_INCARNATION = re.compile(r"(0|[1-9][0-9]{0,6})")
#: The last segment of a keep-alive key: ``rank_R``.
RANK_PREFIX = "rank_"


class Status(str, enum.Enum):
    """A round's status; ``CLOSED`` is the run's own key (``state/closed``), never a stored record's."""

    SETUP = "setup"
    JOINABLE = "joinable"
    FROZEN = "frozen"
    FINAL = "final"
    CLOSED = "closed"


_STORED = {s.value: s for s in (Status.SETUP, Status.JOINABLE, Status.FROZEN, Status.FINAL)}


def encode_json(data: dict[str, Any]) -> bytes:
    """``data`` as the JSON bytes every record is stored as (sorted keys, UTF-8)."""
    return json.dumps(data, sort_keys=True).encode("utf-8")


@dataclass(frozen=True)
class RoundRecord:
    """The round record ``ROOT/state/round`` (or the closed mark, as ``Status.CLOSED``).

    Attributes:
        status: :class:`Status`.
        version: the round version (int >= 1; 0 for a setup record and the closed mark).
        id: the round's random id (``None`` for a record without one).
        participants: the members of a frozen or final round (int >= 1), else ``None``.
        last_call: the node id of the last-call owner of a joinable round, else ``None``.
        ranks: in a final round, the rank policy whose group ranks ``v_V.ID/ranks`` holds; ``None``:
            group rank = slot (join order).
    """

    status: Status
    version: int = 0
    id: str | None = None
    participants: int | None = None
    last_call: str | None = None
    ranks: str | None = None

    def is_round(self, version: int, rid: str | None) -> bool:
        """Whether this is the round ``(version, rid)`` (``rid`` ``None``: a record without id)."""
        return self.version == version and self.id == rid

    def replace(self, **changes: Any) -> "RoundRecord":
        """A copy with ``changes`` (field name -> value)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The record as stored: a JSON object, keys sorted, fields that are ``None`` or 0 left out."""
        out = {"id": self.id, "last_call": self.last_call, "participants": self.participants,
               "status": self.status.value, "version": self.version, "ranks": self.ranks}
        return {name: value for name, value in out.items() if value is not None and value != 0}

    def encode(self) -> bytes:
        """The stored bytes (:func:`encode_json` of :meth:`as_dict`)."""
        return encode_json(self.as_dict())

    @classmethod
    def decode(cls, entry: Entry) -> "RoundRecord":
        """Parse and check the round record in ``entry``.

        Raises:
            RendezvousStateError: too large, not JSON, no valid ``status``, a bad ``version``,
                ``id`` or (frozen, final) ``participants``; names ``entry.key``.
        """
        key = entry.key
        state = _load_json(entry, "round record")
        if not isinstance(state, dict) or state.get("status") not in _STORED:
            raise RendezvousStateError(f"round record at {key!r} has no valid 'status': {state!r:.120}", key)
        status = _STORED[state["status"]]
        version = 0 if status is Status.SETUP else _int_field(state, "version", key)
        rid = state.get("id")
        if rid is not None and not (isinstance(rid, str) and _ROUND_ID.fullmatch(rid)):
            raise RendezvousStateError(f"round record at {key!r}: 'id' must be 1-64 letters, digits, '_' or '-' "
                                       f"(it names the round's keys), got {rid!r:.80}", key)
        if status in (Status.FROZEN, Status.FINAL):
            participants: int | None = _int_field(state, "participants", key)
        else:
            raw = state.get("participants")
            participants = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
        last_call = state.get("last_call")
        ranks = state.get("ranks")
        if ranks is not None and ranks not in RANK_POLICIES:
            raise RendezvousStateError(f"round record at {key!r}: 'ranks' must be a rank policy, got {ranks!r:.80}",
                                       key)
        return cls(status, version, rid, participants, None if last_call is None else str(last_call), ranks)


def _load_json(entry: Entry, what: str) -> Any:
    """The JSON value stored in ``entry`` (a ``what``: "round record", ...).

    Raises:
        RendezvousStateError: larger than :data:`MAX_STATE_BYTES`, or not UTF-8 JSON; names ``entry.key``.
    """
    key = entry.key
    if len(entry.value) > MAX_STATE_BYTES:
        raise RendezvousStateError(f"{what} at {key!r} is {len(entry.value)} bytes (> {MAX_STATE_BYTES}); "
                                   "reset the run's state", key)
    try:
        return json.loads(entry.value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise RendezvousStateError(f"{what} at {key!r} is not JSON: {entry.value[:60]!r}", key) from None


def _int_field(state: dict[str, Any], name: str, key: str, minimum: int = 1, what: str = "round record") -> int:
    value = state.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RendezvousStateError(f"{what} at {key!r}: {name!r} must be an int >= {minimum}, got {value!r}", key)
    return value


#: The settings every node of a run must share, in the order a mismatch is reported (``RunConfig``).
RUN_SETTINGS = ("min_nodes", "max_nodes", "last_call_timeout", "keep_alive_ttl", "rank_policy", "closed_run_ttl",
                "reform")


@dataclass(frozen=True)
class RunConfig:
    """The run's configuration ``ROOT/state/config``: the settings every node of the run must share
    (:data:`RUN_SETTINGS`), recorded by the node that created the run (``rdzv_core.rendezvous.runconfig``).

    Attributes:
        min_nodes, max_nodes: node counts (int >= 1, ``min_nodes <= max_nodes``).
        last_call_timeout, keep_alive_ttl: seconds (float > 0).
        rank_policy: ``join``, ``stable`` or ``topology``.
        closed_run_ttl: seconds a closed run's keys are kept (float > 0), ``None``: until deleted.
        reform: ``fast`` or ``last_call`` (``RendezvousParams.reform``).
    """

    min_nodes: int
    max_nodes: int
    last_call_timeout: float
    keep_alive_ttl: float
    rank_policy: str
    closed_run_ttl: float | None
    reform: str = DEFAULT_REFORM

    def as_dict(self) -> dict[str, Any]:
        """The configuration as stored: a JSON object of :data:`RUN_SETTINGS` (``closed_run_ttl`` ``None``
        is ``null``)."""
        return {name: getattr(self, name) for name in RUN_SETTINGS}

    def encode(self) -> bytes:
        """The stored bytes (:func:`encode_json` of :meth:`as_dict`)."""
        return encode_json(self.as_dict())

    def differences(self, run: "RunConfig") -> tuple[tuple[str, Any, Any], ...]:
        """``((field, this value, run's value), ...)`` for every setting of :data:`RUN_SETTINGS` in which
        this configuration (a node's) differs from ``run`` (numbers compare by value: ``5 == 5.0``)."""
        return tuple((name, getattr(self, name), getattr(run, name)) for name in RUN_SETTINGS
                     if getattr(self, name) != getattr(run, name))

    @classmethod
    def decode(cls, entry: Entry) -> "RunConfig":
        """Parse and check the run's configuration in ``entry``; keys other than :data:`RUN_SETTINGS`
        (a newer version's) are ignored.

        Raises:
            RendezvousStateError: too large, not a JSON object, or a setting missing or out of range;
                names ``entry.key``.
        """
        key, what = entry.key, "run configuration"
        state = _load_json(entry, what)
        if not isinstance(state, dict):
            raise RendezvousStateError(f"{what} at {key!r} is not a JSON object: {state!r:.120}", key)
        low, high = _int_field(state, "min_nodes", key, what=what), _int_field(state, "max_nodes", key, what=what)
        if low > high:
            raise RendezvousStateError(f"{what} at {key!r}: min_nodes={low} > max_nodes={high}", key)
        seconds: list[float | None] = []
        for name in ("last_call_timeout", "keep_alive_ttl", "closed_run_ttl"):
            value = state.get(name)
            if value is None and name == "closed_run_ttl":
                seconds.append(None)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e7:
                raise RendezvousStateError(f"{what} at {key!r}: {name!r} must be a number of seconds > 0 and "
                                           f"<= 1e7, got {value!r:.80}", key)
            seconds.append(float(value))
        policy = state.get("rank_policy")
        if policy not in RANK_POLICIES:
            raise RendezvousStateError(f"{what} at {key!r}: 'rank_policy' must be a rank policy, got {policy!r:.80}",
                                       key)
        reform = state.get("reform", DEFAULT_REFORM)
        if reform not in REFORM_RULES:
            raise RendezvousStateError(f"{what} at {key!r}: 'reform' must be one of {', '.join(REFORM_RULES)}, "
                                       f"got {reform!r:.80}", key)
        last_call, ttl = seconds[0], seconds[1]
        assert last_call is not None and ttl is not None  # only closed_run_ttl may be None
        return cls(low, high, last_call, ttl, str(policy), seconds[2], str(reform))


def round_segment(version: int, rid: str | None) -> str:
    """The key segment of round ``(version, rid)``: ``v_V.RID``, or ``v_V`` for a record without id.

    The round's random id in every per-round key (and its Store's prefix) keeps a round from
    reading or writing another's keys, also one of the same version after the backend lost the
    run's keys and the version counter started again.
    """
    return f"v_{version}.{rid}" if rid else f"v_{version}"


def run_segment(run_id: str, incarnation: int = 0) -> str:
    """The root segment of ``run_id``'s incarnation ``incarnation``: ``run_RUN_ID`` for 0 (the keys of every run
    before incarnations existed), ``run_RUN_ID%incN`` for N > 0.

    Raises:
        InvalidURLError: ``run_id`` is not a valid run id.
        ConfigError: ``incarnation`` is not an int >= 0.
    """
    validate_run_id(run_id)
    if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
        raise ConfigError("incarnation", incarnation, "must be an int >= 0")
    return RUN_SEGMENT + run_id + (f"{INCARNATION_MARK}{incarnation}" if incarnation else "")


def parse_run_segment(segment: str) -> tuple[str, int] | None:
    """``(run id, incarnation)`` of a root segment :func:`run_segment` made; ``None`` for any other segment."""
    if not segment.startswith(RUN_SEGMENT):
        return None
    run_id, mark, number = segment[len(RUN_SEGMENT):].partition(INCARNATION_MARK)
    if mark and (not _INCARNATION.fullmatch(number) or number == "0"):
        return None
    try:
        validate_run_id(run_id)
    except InvalidURLError:
        return None
    return run_id, int(number) if mark else 0


@dataclass(frozen=True)
class RunKeys:
    """Every key of one run (see the module docstring), for the state machine, ``rdzv status`` and tests.

    Args:
        prefix: the key prefix (``RendezvousParams.prefix``, e.g. ``"torchelastic/p2p"``).
        run_id: the run id (checked as :func:`rdzv_core.url.validate_run_id` does).
        incarnation: the run's incarnation (int >= 0; ``docs/design.md``, "Incarnations"): the root is
            :func:`run_segment`'s, so two incarnations of a run share no key.

    Raises:
        InvalidURLError: ``run_id`` is not a valid run id.
        ConfigError: ``incarnation`` is not an int >= 0.
    """

    prefix: str
    run_id: str
    incarnation: int = 0
    root: str = dataclasses.field(init=False)  #: ``PREFIX/run_RUN_ID`` (``PREFIX/run_RUN_ID%incN``: incarnation N)
    tree: str = dataclasses.field(init=False)  #: ``ROOT/``: every key of the run
    state_dir: str = dataclasses.field(init=False)  #: ``ROOT/state/``: the round record, closed mark and config
    round_record: str = dataclasses.field(init=False)  #: ``ROOT/state/round``
    closed: str = dataclasses.field(init=False)  #: ``ROOT/state/closed``
    config: str = dataclasses.field(init=False)  #: ``ROOT/state/config``: the run's configuration
    version_counter: str = dataclasses.field(init=False)  #: ``ROOT/counter/version``
    queue_counter: str = dataclasses.field(init=False)  #: ``ROOT/counter/queue``: admission queue positions
    last_final: str = dataclasses.field(init=False)  #: ``ROOT/admission/last``: the last round that became final
    queue_dir: str = dataclasses.field(init=False)  #: ``ROOT/admission/queue/``: nodes waiting for a place

    def __post_init__(self) -> None:
        root = join_key(self.prefix, run_segment(self.run_id, self.incarnation))
        for name, value in (("root", root), ("tree", root + "/"), ("state_dir", root + "/state/"),
                            ("round_record", root + "/state/round"), ("closed", root + "/state/closed"),
                            ("config", root + "/state/config"),
                            ("version_counter", root + "/counter/version"),
                            ("queue_counter", root + "/counter/queue"),
                            ("last_final", root + "/admission/last"), ("queue_dir", root + "/admission/queue/")):
            object.__setattr__(self, name, value)

    def queued(self, node_id: str) -> str:
        """``ROOT/admission/queue/NODE``: the admission queue key of node ``node_id`` (escaped as one segment)."""
        return self.queue_dir + escape_segment(node_id)

    def of_round(self, version: int, rid: str | None, *parts: str) -> str:
        """A key of round ``(version, rid)``: ``ROOT/v_V.RID/PARTS``."""
        return join_key(self.root, round_segment(version, rid), *parts)

    def round_dir(self, version: int, rid: str | None) -> str:
        """``ROOT/v_V.RID/``: every per-round key of the round but its Store's."""
        return self.of_round(version, rid) + "/"

    def joined(self, version: int, rid: str | None) -> str:
        return self.of_round(version, rid, "joined")

    def confirmed(self, version: int, rid: str | None) -> str:
        return self.of_round(version, rid, "confirmed")

    def waiting(self, version: int, rid: str | None) -> str:
        return self.of_round(version, rid, "waiting")

    def ranks(self, version: int, rid: str | None) -> str:
        """``ROOT/v_V.RID/ranks``: the group rank of each slot (``rdzv_core.rendezvous.ranks``)."""
        return self.of_round(version, rid, "ranks")

    def alive_dir(self, version: int, rid: str | None) -> str:
        """``ROOT/v_V.RID/alive/``: the round's keep-alive keys."""
        return self.of_round(version, rid, "alive") + "/"

    def alive(self, version: int, rid: str | None, rank: int) -> str:
        """``ROOT/v_V.RID/alive/rank_R``: the keep-alive key of ``rank``."""
        return self.of_round(version, rid, "alive", f"{RANK_PREFIX}{rank}")

    def extra_dir(self, version: int, rid: str | None) -> str:
        return self.of_round(version, rid, "extra") + "/"

    def extra(self, version: int, rid: str | None, name: str) -> str:
        """The key of extra data ``name`` (any string; escaped as one segment) of the round."""
        return self.of_round(version, rid, "extra", escape_segment(name))

    def store_prefix(self, version: int, rid: str | None) -> str:
        """``ROOT/store/v_V.RID/``: the prefix of the round's c10d Store."""
        return join_key(self.root, "store", round_segment(version, rid)) + "/"


def rank_of(key: str) -> str:
    """The last segment of a keep-alive key (``rank_R`` for one this module wrote)."""
    return key.rsplit("/", 1)[-1]


#: A keep-alive record's mark: its member left the round to re-join the run (UNIX time); the round is over.
REJOINING = "rejoining"
#: A keep-alive record's mark: the round segment (``v_V.ID``) of the round its re-joining member took a ticket in.
REJOINED = "rejoined"


def missing_ranks(entries: Iterable[Entry], world: int) -> list[int]:
    """The ranks ``0 .. world-1`` without a keep-alive key among ``entries`` (a listing of ``alive_dir``);
    a key marked :data:`REJOINING` counts as missing (its member left the round)."""
    present = {rank_of(e.key) for e in entries if REJOINING.encode() not in e.value or
               REJOINING not in member_record(e)}
    return [r for r in range(world) if f"{RANK_PREFIX}{r}" not in present]


def member_record(entry: Entry) -> dict[str, Any]:
    """A keep-alive record as plain data with its ``key``; a malformed one is reported, not raised
    (``{"key": ..., "corrupt": repr of its start}``: ``rdzv status`` shows it)."""
    try:
        member = json.loads(entry.value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        member = None
    if not isinstance(member, dict):
        return {"key": entry.key, "corrupt": repr(entry.value[:60])}
    return {"key": entry.key, **member}
