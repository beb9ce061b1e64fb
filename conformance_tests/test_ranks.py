"""Rank policies over every backend (marker ``rendezvous``): group ranks across rounds (``docs/ranks.md``).

Agents are threads with their own clients, as in :mod:`conformance_tests.test_rendezvous`; the join
order of each round is forced (each agent joins only after the previous one took its ticket), so a
rank that follows join order shows it. Assertions are on the ranks each agent's ``next_round`` returned.
"""

from __future__ import annotations

from typing import Any

import pytest

from .agents import TTL, Agent
from .waiting import eventually

pytestmark = pytest.mark.rendezvous


def _round_in_order(order: list[Agent]) -> dict[int, int]:
    """Start ``order``'s agents one after another, each once the previous one holds its ticket in the round
    now forming; return ``{index in order: group rank}`` once all are members of one round."""
    for i, agent in enumerate(order):
        agent.start()
        if i < len(order) - 1:  # the last ticket freezes the round
            eventually(lambda: _joined(order[0]) >= i + 1, 20 * TTL, f"agent {i} to take its ticket")
    results = [a.wait(20 * TTL) for a in order]
    assert len({r.version for r in results}) == 1 and {r.world_size for r in results} == {len(order)}, results
    assert sorted(r.rank for r in results) == list(range(len(order))), results
    return {i: r.rank for i, r in enumerate(results)}


def _joined(agent: Agent) -> int:
    state: dict[str, Any] = agent.rdzv.describe()
    return int(state.get("joined", 0)) if state.get("status") == "joinable" else 0


def test_ranks_stay_put_over_rounds_when_the_join_order_reverses(agents) -> None:  # noqa: F811
    """The issue's observation: three nodes, four rounds, unchanged membership, and each round the last rank
    joins first (as the node whose worker failed does). Default policy (stable): every node keeps its group
    rank. (In join order, the node of rank 2 became rank 0 in every round: A 2->0->..., B 0->2->1->2, ...)"""
    group = agents(3, min_nodes=3, max_nodes=3)
    first = _round_in_order(group)
    by_rank = sorted(range(3), key=lambda i: first[i])
    for _ in range(3):
        order = [group[i] for i in reversed(by_rank)]  # rank 2 first, rank 0 last
        ranks = _round_in_order(order)
        got = {group.index(order[i]): rank for i, rank in ranks.items()}
        assert got == first, f"ranks moved: first round {first}, now {got}"
    slots = {a.rdzv.current.slot: a.rdzv.current.rank for a in group if a.rdzv.current is not None}
    assert group[0].rdzv.describe()["group_ranks"] == [slots[s] for s in range(3)]  # what `rdzv status` reads


def test_join_policy_keeps_the_origins_join_order(agents) -> None:  # noqa: F811
    """``rank_policy=join``: ranks follow the tickets, as torchelastic's EtcdRendezvous gives them."""
    group = agents(3, min_nodes=3, max_nodes=3, rank_policy="join")
    assert _round_in_order(group) == {0: 0, 1: 1, 2: 2}
    assert _round_in_order(list(reversed(group))) == {0: 0, 1: 1, 2: 2}


def test_topology_orders_by_labels_then_host_in_natural_order(agents) -> None:  # noqa: F811
    """``rank_policy=topology``: contiguous per rack (values in natural order: r9 before r10), hosts in natural
    order within a rack (node7 before node66), whatever the join order."""
    declared = [("node66", "rack=r10"), ("node7", "rack=r10"), ("node8", "rack=r9"), ("node9", "rack=r9")]
    group = [agents(1, min_nodes=4, max_nodes=4, rank_policy="topology", node_labels=labels)[0]
             for _, labels in declared]
    for agent, (host, _) in zip(group, declared, strict=True):
        agent.rdzv.host = host
    ranks = _round_in_order(group)
    assert [ranks[i] for i in range(4)] == [3, 2, 0, 1]  # node8, node9 (r9), node7, node66 (r10)


def test_a_first_round_follows_the_allocations_node_order_not_the_join_order(agents) -> None:  # noqa: F811
    """Nodes of one allocation on hosts of one name (``node_order``: Slurm's ``SLURM_NODEID``) joining in
    reverse order take group ranks in the allocation's order (in join order node 2 would be rank 0)."""
    group = [agents(1, min_nodes=3, max_nodes=3, node_order=i)[0] for i in range(3)]
    ranks = _round_in_order(list(reversed(group)))
    assert [ranks[2 - i] for i in range(3)] == [0, 1, 2]
