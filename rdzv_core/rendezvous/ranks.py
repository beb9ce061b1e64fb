"""Group ranks of a round from its members' keep-alive records: the rank policies (``docs/ranks.md``).

A pure function of the members' data, so it can be checked without a backend:
:func:`group_ranks` takes the members in slot order (slot = join ticket - 1, the ``rank_R``
of their keep-alive keys) and returns each slot's group rank. Policies:

* ``join``: slot order (the origin's: ranks follow join order).
* ``stable``: the members of the latest previous round any member was in keep their relative
  order (so rank 0 stays rank 0 while it lives); the others follow, by their place in the
  scheduler's allocation (``node_order``: Slurm's ``SLURM_NODEID``; those without one after), then
  host name in natural order, then slot.
* ``topology``: by the declared labels (keys in the order the members declare them, values in
  natural order), then allocation place, then host name in natural order, then the ``stable`` order.

Rank requests (``node_rank``) then take the ranks they ask for; two asking for one rank: the
earlier in the policy's order gets it; a request ``>= world size`` is not honoured.

The round's I/O for them: :func:`store_ranks` (the member completing the round) and :func:`load_rank`
(every member, once the round is final).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import RendezvousStateError
from ..kv import KVBackend
from ..url import DEFAULT_RANK_POLICY as DEFAULT_POLICY
from ..url import RANK_POLICIES as POLICIES
from .record import RANK_PREFIX, RunKeys, encode_json, member_record, rank_of

__all__ = ["POLICIES", "DEFAULT_POLICY", "Member", "group_ranks", "natural_key", "member_fields", "store_ranks",
           "load_rank"]

_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[tuple[Any, ...], str]:
    """Sort key comparing runs of digits as numbers: ``node7`` < ``node66`` < ``Node100``.

    Text runs compare case-folded, digit runs by value; equal so far (``node007``, ``Node7``,
    ``node7``), the text as written decides. (natsort's ``natsorted`` with ``ns.IGNORECASE``, in a few
    lines; not worth a dependency of ``rdzv_core``.)
    """
    parts = _DIGITS.split(text)  # text at even indices, digits at odd: element types align position by position
    return tuple(int(p) if i % 2 else p.casefold() for i, p in enumerate(parts)), text


@dataclass(frozen=True)
class Member:
    """What one confirmed member declared in its keep-alive record.

    Attributes:
        slot: its slot (join ticket - 1).
        host: its host name (``--local-addr`` if given, else the host name).
        prev: ``(version, round id, group rank)`` of the last round it was a member of, or ``None``.
        labels: ``((key, value), ...)`` in the order declared.
        want: the group rank it asks for (``node_rank``), or ``None``.
        order: its place in the scheduler's allocation (``node_order``), or ``None``.
    """

    slot: int
    host: str = ""
    prev: tuple[int, str, int] | None = None
    labels: tuple[tuple[str, str], ...] = ()
    want: int | None = None
    order: int | None = None

    @classmethod
    def from_record(cls, slot: int, record: Mapping[str, Any]) -> "Member":
        """The member of ``slot`` from its keep-alive record (:func:`member_fields`); fields of the
        wrong shape count as not declared (the result depends on the record only)."""
        host = record.get("host")
        prev = record.get("prev")
        if not (isinstance(prev, list) and len(prev) == 3 and _is_int(prev[0]) and isinstance(prev[1], str)
                and _is_int(prev[2])):
            prev = None
        labels = record.get("labels")
        pairs = tuple((k, v) for k, v in (p for p in labels if isinstance(p, list) and len(p) == 2)
                      if isinstance(k, str) and isinstance(v, str)) if isinstance(labels, list) else ()
        want, order = record.get("want"), record.get("order")
        return cls(slot, host if isinstance(host, str) else "",
                   None if prev is None else (prev[0], prev[1], prev[2]), pairs, want if _is_int(want) else None,
                   order if _is_int(order) else None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def member_fields(prev: tuple[int, str, int] | None, labels: Sequence[tuple[str, str]],
                  want: int | None, order: int | None = None) -> dict[str, Any]:
    """The fields a member adds to its keep-alive record for :meth:`Member.from_record` (absent ones left out)."""
    out: dict[str, Any] = {}
    if order is not None:
        out["order"] = order
    if prev is not None:
        out["prev"] = list(prev)
    if labels:
        out["labels"] = [list(p) for p in labels]
    if want is not None:
        out["want"] = want
    return out


def group_ranks(policy: str, members: Sequence[Member]) -> list[int]:
    """Each slot's group rank under ``policy``: ``result[slot]``.

    Args:
        policy: one of :data:`POLICIES`.
        members: one per slot ``0 .. len - 1`` (any order).

    Raises:
        ValueError: an unknown policy, or ``members`` do not hold each slot once.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown rank policy {policy!r}; choose one of {', '.join(POLICIES)}")
    by_slot = sorted(members, key=lambda m: m.slot)
    if [m.slot for m in by_slot] != list(range(len(by_slot))):
        raise ValueError(f"members must hold slots 0..{len(by_slot) - 1} once each, got {[m.slot for m in by_slot]}")
    if policy == "join":
        order = by_slot
    else:
        order = _stable(by_slot)
        if policy == "topology":
            order = _topology(order)
        order = _requested(order)
    ranks = [0] * len(order)
    for rank, member in enumerate(order):
        ranks[member.slot] = rank
    return ranks


def _placed(m: Member) -> tuple[int, int]:
    """Sort key of a member's allocation place: those with one first, in its order."""
    return (0, m.order) if m.order is not None else (1, 0)


def _stable(members: Sequence[Member]) -> list[Member]:
    """Survivors of the latest previous round in their old order, then the others by allocation place,
    host, slot."""
    rounds = [m.prev[:2] for m in members if m.prev is not None]
    latest = max(rounds) if rounds else None
    survivors = sorted((m for m in members if m.prev is not None and m.prev[:2] == latest),
                       key=lambda m: (m.prev[2] if m.prev else 0, m.slot))
    chosen = {m.slot for m in survivors}
    others = sorted((m for m in members if m.slot not in chosen),
                    key=lambda m: (_placed(m), natural_key(m.host), m.slot))
    return survivors + others


def _topology(stable: Sequence[Member]) -> list[Member]:
    """``stable`` re-ordered by labels (keys in order of first declaration, by slot), then allocation place,
    then host."""
    keys: list[str] = []
    for member in sorted(stable, key=lambda m: m.slot):
        keys.extend(k for k, _ in member.labels if k not in keys)
    position = {m.slot: i for i, m in enumerate(stable)}

    def key(m: Member) -> tuple[Any, ...]:
        declared = dict(m.labels)  # a key declared twice: its last value
        values = tuple((0, natural_key(declared[k])) if k in declared else (1, ()) for k in keys)
        return values, _placed(m), natural_key(m.host), position[m.slot]

    return sorted(stable, key=key)


def _requested(order: Sequence[Member]) -> list[Member]:
    """``order`` with each honoured rank request at its rank (the earlier in ``order`` wins a conflict)."""
    world = len(order)
    placed: dict[int, Member] = {}
    for m in order:
        if m.want is not None and m.want < world and m.want not in placed:
            placed[m.want] = m
    placed_slots = {m.slot for m in placed.values()}
    rest = iter(m for m in order if m.slot not in placed_slots)
    return [placed[r] if r in placed else next(rest) for r in range(world)]


def store_ranks(kv: KVBackend, keys: RunKeys, version: int, rid: str | None, world: int,
                policy: str) -> list[int] | None:
    """Compute every slot's group rank under ``policy`` from round ``(version, rid)``'s keep-alive
    records (one list) and put them at ``v_V.ID/ranks`` (one put); ``None`` (nothing put) if a slot
    ``0 .. world-1`` has no key."""
    alive = {rank_of(e.key): member_record(e) for e in kv.list(keys.alive_dir(version, rid))[0]}
    records = [alive.get(f"{RANK_PREFIX}{slot}") for slot in range(world)]
    if any(r is None for r in records):
        return None
    ranks = group_ranks(policy, [Member.from_record(slot, r or {}) for slot, r in enumerate(records)])
    kv.put(keys.ranks(version, rid), encode_json({"policy": policy, "ranks": ranks}))
    return ranks


def load_rank(kv: KVBackend, keys: RunKeys, version: int, rid: str | None, slot: int, world: int) -> int:
    """The group rank of ``slot`` from ``v_V.ID/ranks`` (a final record that names a policy has it).

    Raises:
        RendezvousStateError: the key is missing or is not a permutation of ``0 .. world-1``.
    """
    key = keys.ranks(version, rid)
    entry = kv.get(key)
    ranks = member_record(entry).get("ranks") if entry is not None else None
    if not isinstance(ranks, list) or sorted(r for r in ranks if isinstance(r, int)) != list(range(world)):
        shown = "absent" if entry is None else repr(entry.value[:60])
        raise RendezvousStateError(f"round {version}: the group ranks at {key!r} are missing or corrupt ({shown}); "
                                   "reset the run's state", key)
    rank: int = ranks[slot]
    return rank
