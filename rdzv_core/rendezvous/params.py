"""The rendezvous' value types: its parameters, a completed round, a waiting node's progress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["RendezvousParams", "RoundResult", "Progress", "MIN_KEEP_ALIVE_TTL"]

MIN_KEEP_ALIVE_TTL = 0.1  #: seconds


@dataclass(frozen=True)
class RendezvousParams:
    """Rendezvous parameters (URL query keys of the same names).

    ===================  =========  ===================================================
    parameter            default    meaning
    ===================  =========  ===================================================
    min_nodes            (needed)   nodes needed for a round to be valid (int >= 1)
    max_nodes            min_nodes  nodes admitted at most (int >= min_nodes)
    timeout              600.0      overall seconds for one ``next_round`` call
    last_call_timeout    30.0       seconds the min-th node waits for more nodes
    keep_alive_ttl       5.0        TTL (s) of keep-alive keys and of transient
                                    round records; refreshed every TTL/3
    prefix               torchelastic/p2p   key prefix in the backend
    ===================  =========  ===================================================

    Raises:
        ConfigError: a value is out of range (names the field and value).
    """

    min_nodes: int
    max_nodes: int | None = None
    timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_ttl: float = 5.0
    prefix: str = "torchelastic/p2p"

    @classmethod
    def from_query(cls, query: Mapping[str, Any]) -> "RendezvousParams":
        """The parameters a URL's parsed query gives (``RendezvousURL.params``, canonical
        key names); other keys are ignored, ``min_nodes`` is 1 when absent.

        Raises:
            ConfigError: a value is out of range (names the field and value).
        """
        fields = ("min_nodes", "max_nodes", "timeout", "last_call_timeout", "keep_alive_ttl", "prefix")
        return cls(**{"min_nodes": 1, **{k: query[k] for k in fields if k in query}})

    def __post_init__(self) -> None:
        if self.max_nodes is None:
            object.__setattr__(self, "max_nodes", self.min_nodes)
        for name in ("min_nodes", "max_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "must be an int >= 1")
        if self.min_nodes > self.limit:
            raise ConfigError("min_nodes", self.min_nodes, f"greater than max_nodes={self.max_nodes}")
        for name in ("timeout", "last_call_timeout", "keep_alive_ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e7:
                raise ConfigError(name, value, "must be a number of seconds > 0 and <= 1e7")
        if self.keep_alive_ttl < MIN_KEEP_ALIVE_TTL:
            raise ConfigError("keep_alive_ttl", self.keep_alive_ttl,
                              f"must be >= {MIN_KEEP_ALIVE_TTL} s (it is refreshed every TTL/3 over the network)")

    @property
    def limit(self) -> int:
        """``max_nodes`` as an int (it is never ``None`` once constructed)."""
        return self.max_nodes if self.max_nodes is not None else self.min_nodes


@dataclass(frozen=True)
class RoundResult:
    """A completed round: ``version`` (int), this node's ``rank`` and the ``world_size``.

    ``round_id`` (str) is the random id the round record got at setup: with the
    version it identifies the round even if a run's keys were lost and the version
    counter started again.
    """

    version: int
    rank: int
    world_size: int
    round_id: str = ""


@dataclass(frozen=True)
class Progress:
    """What a waiting node sees, for progress output.

    Attributes:
        phase: ``"joining"``, ``"last-call"``, ``"confirming"``, ``"waiting"`` (late node),
            ``"spare"`` or ``"setup"``.
        version: the round version (0 if unknown).
        joined: nodes that joined the round so far (or 0 if unknown).
        min_nodes, max_nodes: the parameters.
        remaining: seconds left of the overall timeout.
    """

    phase: str
    version: int
    joined: int
    min_nodes: int
    max_nodes: int
    remaining: float
