"""The rendezvous' value types: its parameters, a completed round, a waiting node's progress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError
from ..url import (DEFAULT_RANK_POLICY, DEFAULT_REFORM, LEDGER_SCOPES, RANK_POLICIES, REFORM_RULES, node_name,
                   parse_node_labels)
from .ledger import QuarantinePolicy

__all__ = ["RendezvousParams", "RoundResult", "Progress", "MIN_KEEP_ALIVE_TTL", "DEFAULT_CLOSED_RUN_TTL"]

MIN_KEEP_ALIVE_TTL = 0.1  #: seconds
#: Seconds a closed run's keys are kept by default: 2 h, as torchelastic's etcd rendezvous kept a run's directory.
DEFAULT_CLOSED_RUN_TTL = 7200.0


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
    closed_run_ttl       7200.0     seconds every key of a closed run is kept after
                                    the close (``None`` or 0: kept until deleted)
    prefix               torchelastic/p2p   key prefix in the backend
    rank_policy          stable     how group ranks are given: join, stable, topology
                                    (``docs/ranks.md``)
    node_rank            None       the group rank this node asks for (int >= 0)
    node_labels          ""         this node's labels ``KEY=VALUE[,...]`` (topology)
    node_order           None       this node's place in the scheduler's allocation
                                    (int >= 0; newcomers take ranks in its order)
    reform               fast       a round after a final one: ``fast`` freezes it once
                                    nobody else is expected, ``last_call`` waits out
                                    the last call (``docs/design.md``, "Re-forming")
    incarnation          0          which incarnation of the run (int >= 0): 0 is the
                                    run itself, N > 0 keeps its keys under a root of
                                    its own (``docs/design.md``, "Incarnations")
    node_name            None       this node's name in the run's ledger (``None``: the
                                    host name; the handler reads the scheduler's)
    quarantine_after     2          offences within ``quarantine_window`` that
                                    quarantine a node (0: never; ``docs/node-health.md``)
    quarantine_window    3600.0     seconds an offence counts for
    quarantine_cooldown  600.0      seconds of a first quarantine (doubles each time)
    ledger_scope         run        where the node ledger lives: ``run`` (its own keys)
                                    or ``prefix`` (shared by every run under the prefix)
    ===================  =========  ===================================================

    Raises:
        ConfigError: a value is out of range (names the field and value).
    """

    min_nodes: int
    max_nodes: int | None = None
    timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_ttl: float = 5.0
    closed_run_ttl: float | None = DEFAULT_CLOSED_RUN_TTL
    prefix: str = "torchelastic/p2p"
    rank_policy: str = DEFAULT_RANK_POLICY
    node_rank: int | None = None
    node_labels: str = ""
    node_order: int | None = None
    reform: str = DEFAULT_REFORM
    incarnation: int = 0
    node_name: str | None = None
    quarantine_after: int = 2
    quarantine_window: float = 3600.0
    quarantine_cooldown: float = 600.0
    ledger_scope: str = "run"

    @classmethod
    def from_query(cls, query: Mapping[str, Any]) -> "RendezvousParams":
        """The parameters a URL's parsed query gives (``RendezvousURL.params``, canonical
        key names); other keys are ignored, ``min_nodes`` is 1 when absent.

        Raises:
            ConfigError: a value is out of range (names the field and value).
        """
        fields = ("min_nodes", "max_nodes", "timeout", "last_call_timeout", "keep_alive_ttl", "prefix", "rank_policy",
                  "node_rank", "node_labels", "node_order", "closed_run_ttl", "reform", "incarnation", "node_name",
                  "quarantine_after", "quarantine_window", "quarantine_cooldown", "ledger_scope")
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
        ttl = self.closed_run_ttl
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= 1e7):
            raise ConfigError("closed_run_ttl", ttl, "must be a number of seconds >= 0 and <= 1e7, or None (0 or None: "
                              "a closed run's keys are kept until deleted)")
        if ttl == 0:
            object.__setattr__(self, "closed_run_ttl", None)
        if self.keep_alive_ttl < MIN_KEEP_ALIVE_TTL:
            raise ConfigError("keep_alive_ttl", self.keep_alive_ttl,
                              f"must be >= {MIN_KEEP_ALIVE_TTL} s (it is refreshed every TTL/3 over the network)")
        if self.rank_policy not in RANK_POLICIES:
            raise ConfigError("rank_policy", self.rank_policy, f"must be one of {', '.join(RANK_POLICIES)}")
        if self.reform not in REFORM_RULES:
            raise ConfigError("reform", self.reform, f"must be one of {', '.join(REFORM_RULES)}")
        rank = self.node_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ConfigError("node_rank", rank, "must be an int >= 0 (the group rank this node asks for)")
        if rank is not None and self.rank_policy == "join":
            raise ConfigError("node_rank", rank, "rank_policy=join gives ranks in join order only; a rank request "
                              "needs rank_policy=stable or topology")
        order = self.node_order
        if order is not None and (isinstance(order, bool) or not isinstance(order, int) or order < 0):
            raise ConfigError("node_order", order, "must be an int >= 0 (this node's place in the scheduler's "
                              "allocation, e.g. SLURM_NODEID)")
        inc = self.incarnation
        if isinstance(inc, bool) or not isinstance(inc, int) or inc < 0:
            raise ConfigError("incarnation", inc, "must be an int >= 0 (0: the run itself; N > 0: its N-th restart "
                              "under a scheduler)")
        if self.node_name is not None:
            node_name("node_name", self.node_name)
        QuarantinePolicy(self.quarantine_after, self.quarantine_window, self.quarantine_cooldown)  # checks them
        if self.ledger_scope not in LEDGER_SCOPES:
            raise ConfigError("ledger_scope", self.ledger_scope, f"must be one of {', '.join(LEDGER_SCOPES)}")
        if not isinstance(self.node_labels, str):
            raise ConfigError("node_labels", self.node_labels, "must be text KEY=VALUE[,KEY=VALUE...]")
        parse_node_labels("node_labels", self.node_labels)

    @property
    def limit(self) -> int:
        """``max_nodes`` as an int (it is never ``None`` once constructed)."""
        return self.max_nodes if self.max_nodes is not None else self.min_nodes

    @property
    def quarantine(self) -> QuarantinePolicy:
        """The :class:`~rdzv_core.rendezvous.ledger.QuarantinePolicy` these parameters give."""
        return QuarantinePolicy(self.quarantine_after, self.quarantine_window, self.quarantine_cooldown)

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        """``node_labels`` as ``((key, value), ...)`` in the order declared."""
        return parse_node_labels("node_labels", self.node_labels)


@dataclass(frozen=True)
class RoundResult:
    """A completed round: ``version`` (int), this node's group ``rank`` and the ``world_size``.

    ``round_id`` (str) is the random id the round record got at setup: with the
    version it identifies the round even if a run's keys were lost and the version
    counter started again. ``slot`` (int) is this node's join ticket - 1, the ``R`` of its
    keep-alive key ``alive/rank_R`` (``None``: equal to ``rank``).
    """

    version: int
    rank: int
    world_size: int
    round_id: str = ""
    slot: int | None = None

    @property
    def key_slot(self) -> int:
        """The slot of this node's keep-alive key."""
        return self.rank if self.slot is None else self.slot


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
