"""Training progress in the backend: one key per member of a round, written by its agent, read by ``rdzv status``.

Key ``ROOT/v_V.ID/progress/rank_R`` (``R``: the node's group rank), written with a TTL by
the node's agent at most every few seconds (one write per node, all its workers in it);
the value is JSON::

    {"rank": R, "host": HOST, "node": NODE_ID, "published": UNIX_S, "hang_timeout": S or null,
     "workers": {"GLOBAL_RANK": [STEP, UNIX_S_OF_LAST_PROGRESS], ...}}

Only workers that reported progress are listed; a node none of whose workers reported
writes nothing. Times are the node's wall clock. See ``docs/operations.md`` ("Progress
and hangs").
"""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Mapping

from ..kv import Entry, KVBackend
from .params import RoundResult
from .record import RANK_PREFIX, RunKeys, encode_json, rank_of

__all__ = ["NodeProgress", "progress_dir", "progress_key", "publish", "read", "decode"]


def progress_dir(keys: RunKeys, version: int, rid: str | None) -> str:
    """``ROOT/v_V.RID/progress/``: the round's progress keys."""
    return keys.of_round(version, rid, "progress") + "/"


def progress_key(keys: RunKeys, version: int, rid: str | None, rank: int) -> str:
    """``ROOT/v_V.RID/progress/rank_R``: the progress key of group rank ``rank``."""
    return keys.of_round(version, rid, "progress", f"{RANK_PREFIX}{rank}")


@dataclass(frozen=True)
class NodeProgress:
    """One node's published progress.

    Attributes:
        rank: the node's group rank in the round.
        host, node: its host name and rendezvous node id.
        published: when its agent wrote the key (Unix seconds, the node's clock).
        hang_timeout: the agent's ``--hang-timeout`` (seconds) or ``None`` (off).
        workers: global rank -> ``(last step, Unix seconds of its last report)``.
    """

    rank: int
    host: str
    node: str
    published: float
    hang_timeout: float | None = None
    workers: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def slowest(self) -> int | None:
        """The global rank with the lowest step (the oldest report breaks ties), ``None`` without workers."""
        if not self.workers:
            return None
        return min(self.workers, key=lambda r: (self.workers[r][0], self.workers[r][1], r))

    @property
    def step(self) -> int | None:
        """The lowest step of the node's workers (the node is as far as its slowest worker)."""
        return None if self.slowest is None else self.workers[self.slowest][0]

    @property
    def last(self) -> float | None:
        """The oldest last-report time of the node's workers (Unix seconds)."""
        return min((t for _, t in self.workers.values()), default=None)

    def encode(self) -> bytes:
        return encode_json({"rank": self.rank, "host": self.host, "node": self.node, "published": self.published,
                            "hang_timeout": self.hang_timeout,
                            "workers": {str(r): [s, t] for r, (s, t) in sorted(self.workers.items())}})


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def decode(entry: Entry) -> NodeProgress | None:
    """The record in ``entry``, or ``None`` if it is not one this module wrote (``rdzv status`` skips it)."""
    try:
        data = json.loads(entry.value.decode("utf-8"))
        workers = {int(r): (int(v[0]), float(v[1])) for r, v in data["workers"].items()
                   if isinstance(v, list) and len(v) == 2 and _number(v[0]) and _number(v[1])}
        hang = data.get("hang_timeout")
        rank = data["rank"]
        if not isinstance(rank, int) or f"{RANK_PREFIX}{rank}" != rank_of(entry.key) or not _number(data["published"]):
            return None
        return NodeProgress(rank, str(data.get("host", "")), str(data.get("node", "")), float(data["published"]),
                            float(hang) if _number(hang) else None, workers)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def publish(kv: KVBackend, keys: RunKeys, current: RoundResult, node_id: str,
            workers: Mapping[int, tuple[int, float]], ttl: float, hang_timeout: float | None = None) -> NodeProgress:
    """Write this node's progress in round ``current`` (one ``put`` with ``ttl`` seconds); return the record.

    Raises:
        the backend's errors (``BackendUnavailableError``, ...).
    """
    record = NodeProgress(current.rank, socket.gethostname(), node_id, round(time.time(), 3), hang_timeout,
                          {int(r): (int(s), round(float(t), 3)) for r, (s, t) in workers.items()})
    kv.put(progress_key(keys, current.version, current.round_id or None, current.rank), record.encode(), ttl=ttl)
    return record


def read(kv: KVBackend, keys: RunKeys, version: int, rid: str | None) -> list[NodeProgress]:
    """The progress records of round ``(version, rid)`` (one ``list``), by group rank; malformed ones skipped."""
    entries, _ = kv.list(progress_dir(keys, version, rid))
    found = (decode(e) for e in entries)
    return sorted((p for p in found if p is not None), key=lambda p: p.rank)
