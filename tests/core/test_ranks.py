"""The rank policies without a backend (``rdzv_core.rendezvous.ranks``), their query keys and environment.

Properties (hypothesis): a permutation of ``0 .. n-1`` for any members; the order does not depend
on the join order (the slots) where the members' data tell them apart; ``stable`` keeps the previous
round's members in their old order, rank 0 first; ``topology`` is contiguous per label, values and host
names in natural order. The scenarios over real backends are in ``conformance_tests/test_ranks.py``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv_core import ConfigError, InvalidURLError, RendezvousParams
from rdzv_core.labels import LABELS_ENV, environment_labels, environment_order
from rdzv_core.plugins import parse_backend_url
from rdzv_core.rendezvous.ranks import Member, group_ranks, natural_key

PREV = (7, "abc")  # the previous round of these members: (version, round id)


def _ranks_by_host(policy: str, members: list[Member]) -> dict[str, int]:
    ranks = group_ranks(policy, members)
    return {m.host: ranks[m.slot] for m in members}


def _reslotted(members: list[Member], rng: random.Random) -> list[Member]:
    """The same members in another join order (new slots)."""
    slots = list(range(len(members)))
    rng.shuffle(slots)
    return [Member(s, m.host, m.prev, m.labels, m.want, m.order) for s, m in zip(slots, members, strict=True)]


def test_natural_order_of_host_names() -> None:
    names = ["node66", "node7", "Node100", "node8", "rack2-node10", "rack10-node1", "rack2-node9", "node07"]
    assert sorted(names, key=natural_key) == ["node07", "node7", "node8", "node66", "Node100", "rack2-node9",
                                              "rack2-node10", "rack10-node1"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=30, unique=True))
def test_natural_order_is_numeric_order_of_the_numbers(numbers: list[int]) -> None:
    assert sorted((f"node{n}" for n in numbers), key=natural_key) == [f"node{n}" for n in sorted(numbers)]


#: A member of a round: host index, previous rank (None: a newcomer), rack, rank request.
_MEMBER = st.tuples(st.integers(0, 5), st.none() | st.integers(0, 40), st.none() | st.integers(0, 4))


@settings(max_examples=150, deadline=None)
@given(st.lists(_MEMBER, min_size=1, max_size=24), st.sampled_from(["join", "stable", "topology"]),
       st.booleans(), st.randoms(use_true_random=False))
def test_ranks_are_a_permutation_and_ignore_the_join_order(spec, policy: str, requests: bool,
                                                           rng: random.Random) -> None:
    """Distinct hosts, distinct previous ranks: every permutation of the join order gives each host the same
    rank (but under ``join``, which is join order by definition)."""
    members, used = [], set()
    for slot, (rack, prev, want) in enumerate(spec):
        prev_rank = prev if prev is not None and prev not in used else None
        used.add(prev_rank)
        members.append(Member(slot, f"host{slot}", None if prev_rank is None else (*PREV, prev_rank),
                              (("rack", f"r{rack}"),), want if requests else None))
    ranks = group_ranks(policy, members)
    assert sorted(ranks) == list(range(len(members)))
    if policy != "join":
        for _ in range(3):
            assert _ranks_by_host(policy, _reslotted(members, rng)) == _ranks_by_host(policy, members)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=20, unique=True), st.integers(0, 10),
       st.randoms(use_true_random=False))
def test_stable_keeps_the_survivors_order_and_puts_newcomers_after(prev_ranks: list[int], newcomers: int,
                                                                   rng: random.Random) -> None:
    """Survivors (any subset of the old ranks: gaps are lost members) keep their relative order from rank 0;
    newcomers -- members of no round, or of an older one -- follow, by host name."""
    survivors = [Member(0, f"s{r}", (*PREV, r)) for r in prev_ranks]
    fresh = [Member(0, f"new{i}", None if i % 2 else (PREV[0] - 1, "old", i)) for i in range(newcomers)]
    members = _reslotted(survivors + fresh, rng)
    got = _ranks_by_host("stable", members)
    assert [got[f"s{r}"] for r in sorted(prev_ranks)] == list(range(len(prev_ranks)))
    assert sorted((got[f"new{i}"] for i in range(newcomers))) == list(range(len(prev_ranks), len(members)))
    assert [h for h, _ in sorted(got.items(), key=lambda kv: kv[1])][len(prev_ranks):] == \
        sorted((f"new{i}" for i in range(newcomers)), key=natural_key)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(0, 99)), min_size=1, max_size=24),
       st.randoms(use_true_random=False))
def test_topology_is_contiguous_per_label_in_natural_order(spec, rng: random.Random) -> None:
    """Racks then switches (the declared key order), each value in natural order; within one (rack, switch) the
    hosts in natural order."""
    members = [Member(slot, f"node{host}", None, (("rack", f"r{rack}"), ("switch", f"s{switch}")))
               for slot, (rack, switch, host) in enumerate(spec)]
    reslotted = _reslotted(members, rng)
    ranks = group_ranks("topology", reslotted)
    by_rank = sorted(reslotted, key=lambda m: ranks[m.slot])
    keys = [(int(m.labels[0][1][1:]), int(m.labels[1][1][1:]), int(m.host[4:])) for m in by_rank]
    assert [k[:2] for k in keys] == sorted(k[:2] for k in keys)  # contiguous per rack, per switch, natural order
    for a, b in zip(keys, keys[1:], strict=False):
        if a[:2] == b[:2]:
            assert a[2] <= b[2]  # hosts in natural order within a label group


def test_topology_orders_keys_as_declared_and_puts_undeclared_last() -> None:
    members = [Member(0, "a", None, (("switch", "s1"), ("rack", "r2"))), Member(1, "b", None, (("rack", "r1"),)),
               Member(2, "c", None, (("switch", "s1"), ("rack", "r1"))), Member(3, "d", None, ())]
    # keys: switch (first declared, by slot), then rack; b and d have no switch: after those with one
    assert _ranks_by_host("topology", members) == {"c": 0, "a": 1, "b": 2, "d": 3}


def test_topology_keeps_the_stable_order_on_one_host() -> None:
    """Agents of one host (same labels, same name): survivors in their old order, then newcomers."""
    members = [Member(0, "h", None), Member(1, "h", (*PREV, 1)), Member(2, "h", (*PREV, 0))]
    assert group_ranks("topology", members) == [2, 1, 0]


def test_newcomers_follow_the_schedulers_node_order_before_host_names() -> None:
    """Nodes of one allocation (Slurm's SLURM_NODEID) take ranks in its order whatever their join order and
    names; survivors still keep theirs; nodes without a position follow by host name."""
    first = [Member(0, "h", order=2), Member(1, "h", order=0), Member(2, "h", order=1)]
    assert group_ranks("stable", first) == [2, 0, 1]
    assert group_ranks("topology", first) == [2, 0, 1]
    assert group_ranks("join", first) == [0, 1, 2]
    named = [Member(0, "n1", order=1), Member(1, "n9", order=0), Member(2, "n0"), Member(3, "n5", (*PREV, 0), order=3)]
    assert _ranks_by_host("stable", named) == {"n5": 0, "n9": 1, "n1": 2, "n0": 3}


def test_rank_requests_win_where_they_do_not_conflict() -> None:
    """Requests are placed first; two for one rank: the member earlier in the policy's order gets it (here the
    survivor of old rank 0); a request >= the world size is not honoured; the others keep the policy's order."""
    members = [Member(0, "n1", (*PREV, 0), want=2), Member(1, "n2", (*PREV, 1), want=2),
               Member(2, "n3", (*PREV, 2)), Member(3, "n4", None, want=9)]
    assert _ranks_by_host("stable", members) == {"n1": 2, "n2": 0, "n3": 1, "n4": 3}
    assert group_ranks("join", members) == [0, 1, 2, 3]  # join: tickets only


def test_a_malformed_record_counts_as_undeclared() -> None:
    m = Member.from_record(3, {"host": 5, "prev": [1, "x"], "labels": [["rack"], ["a", 1], ["k", "v"]],
                               "want": True, "order": -1})
    assert m == Member(3, "", None, (("k", "v"),), None, None)
    assert Member.from_record(0, {"host": "h", "prev": [2, "id", 1], "want": 0, "order": 4}) == \
        Member(0, "h", (2, "id", 1), (), 0, 4)


@pytest.mark.parametrize("query, field", [
    ("rank_policy=random", "rank_policy"),
    ("rank_policy=", "rank_policy"),
    ("node_rank=-1", "node_rank"),
    ("node_labels=rack", "node_labels"),
    ("node_labels=rack=r1,rack=r2", "node_labels"),
    ("node_labels=rack=r 1", "node_labels"),
    ("node_order=first", "node_order"),
])
def test_bad_rank_query_values_name_the_key_and_value(query: str, field: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        parse_backend_url(f"memory://k/job?{query}")
    assert info.value.field == field
    assert info.value.value == query.split("=", 1)[1]


def test_rank_query_keys_reach_the_parameters() -> None:
    _, url = parse_backend_url("memory://k/job?rank_policy=topology&node_rank=2&node_labels=rack=r1,switch=s3"
                               "&node_order=5")
    params = RendezvousParams.from_query(url.params)
    assert (params.rank_policy, params.node_rank, params.labels, params.node_order) == (
        "topology", 2, (("rack", "r1"), ("switch", "s3")), 5)
    assert RendezvousParams(min_nodes=1).rank_policy == "stable"
    with pytest.raises(ConfigError, match="rank_policy=join") as info:
        RendezvousParams(min_nodes=1, rank_policy="join", node_rank=0)
    assert info.value.field == "node_rank"


def test_labels_from_the_environment() -> None:
    assert environment_labels({LABELS_ENV: "rack=r1,switch=s3", "SLURM_TOPOLOGY_ADDR": "a.b.n"}) == \
        "rack=r1,switch=s3"
    assert environment_labels({"SLURM_TOPOLOGY_ADDR": "s0.s3.node7",
                               "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}) == "switch1=s0,switch2=s3"
    assert environment_labels({"SLURM_TOPOLOGY_ADDR": "s0.node7", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch"}) == ""
    assert environment_labels({}) == ""
    with pytest.raises(InvalidURLError) as info:
        environment_labels({LABELS_ENV: "rack"})
    assert (info.value.field, info.value.value) == (LABELS_ENV, "rack")


def test_group_ranks_are_stored_once_and_a_corrupt_copy_is_a_state_error() -> None:
    """store_ranks computes from the keep-alive records and refuses a round with a member's key missing;
    load_rank reads them back, and a corrupt copy is a RendezvousStateError naming the key."""
    from rdzv_core import RendezvousStateError, open_backend
    from rdzv_core.rendezvous import RunKeys
    from rdzv_core.rendezvous.ranks import load_rank, store_ranks
    from rdzv_core.rendezvous.record import encode_json

    kv = open_backend("memory://ranks-store/")
    keys = RunKeys("p", "job")
    kv.put(keys.alive(3, "id", 0), encode_json({"rank": 0, "host": "n2", "prev": [2, "x", 1]}))
    assert store_ranks(kv, keys, 3, "id", 2, "stable") is None  # slot 1 has no key: nothing stored
    assert kv.get(keys.ranks(3, "id")) is None
    kv.put(keys.alive(3, "id", 1), encode_json({"rank": 1, "host": "n1", "prev": [2, "x", 0]}))
    assert store_ranks(kv, keys, 3, "id", 2, "stable") == [1, 0]
    assert [load_rank(kv, keys, 3, "id", slot, 2) for slot in (0, 1)] == [1, 0]
    kv.put(keys.ranks(3, "id"), b'{"ranks": [0, 0]}')
    with pytest.raises(RendezvousStateError) as info:
        load_rank(kv, keys, 3, "id", 0, 2)
    assert info.value.key == keys.ranks(3, "id")
    kv.close()


def test_node_order_from_the_schedulers_environment() -> None:
    assert environment_order({"SLURM_NODEID": "2", "JOB_COMPLETION_INDEX": "5"}) == 2
    assert environment_order({"JOB_COMPLETION_INDEX": "5"}) == 5  # a Kubernetes Indexed Job's pod
    assert environment_order({}) is None
    with pytest.raises(InvalidURLError) as info:
        environment_order({"SLURM_NODEID": "n1"})
    assert (info.value.field, info.value.value) == ("SLURM_NODEID", "n1")
