"""The run's configuration, on every backend (marker ``rendezvous``): the first node of a run records the
settings every node must share; a node with other values is refused before it joins anything.

Agents are threads, each with its own backend client. Assertions are on the refusal's fields, the round
record (revision, status), the counts ``rdzv status`` shows, and the rounds that form afterwards.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import pytest

from rdzv_core import (
    KVBackend,
    RendezvousClosedError,
    RendezvousParams,
    RendezvousStateError,
    RunConfigMismatchError,
)
from rdzv_core.rendezvous.runconfig import check_run_config

from .agents import Agent, crew_of, round_of
from .waiting import eventually

pytestmark = pytest.mark.rendezvous

TTL = 1.0  # keep-alive TTL (s)
#: The run's settings in these tests: 2 to 3 nodes.
RUN = {"min_nodes": 2, "max_nodes": 3, "last_call_timeout": 0.5, "keep_alive_ttl": TTL, "rank_policy": "stable",
       "timeout": 30.0}
#: Seconds within which a refused node must hear so (one read of the run's state; a loaded host).
REFUSED_WITHIN = 5.0


@pytest.fixture
def nodes(kv_factory: Callable[[], KVBackend]) -> Iterator[Callable[..., list[Agent]]]:
    """``nodes(n, **params)`` -> n nodes of one fresh run (``RUN`` with ``params``), not started; every
    node leaves its round at the end (an unfinished one has its client closed first)."""
    with crew_of(kv_factory, "cfg", RUN, leave=True) as make:
        yield make


def _refused(node: Agent) -> RunConfigMismatchError:
    """``node``'s ``next_round`` refusal, which must come within :data:`REFUSED_WITHIN` s."""
    t0 = time.monotonic()
    with pytest.raises(RunConfigMismatchError) as info:
        node.start().wait(REFUSED_WITHIN)
    assert time.monotonic() - t0 < REFUSED_WITHIN
    return info.value


@pytest.mark.parametrize("field, value", [("max_nodes", 2), ("min_nodes", 1), ("last_call_timeout", 2.5),
                                          ("keep_alive_ttl", 2 * TTL), ("rank_policy", "join"),
                                          ("closed_run_ttl", 60.0)])
def test_a_node_with_another_setting_is_refused_and_the_round_is_untouched(nodes, kv, field: str,
                                                                            value: Any) -> None:
    members = [n.start() for n in nodes(2)]
    first = round_of(members, 30)
    keys = members[0].rdzv.keys
    before = kv.get(keys.round_record)
    assert before is not None

    refusal = _refused(nodes(1, **{field: value})[0])
    run_value = RendezvousParams(**RUN).closed_run_ttl if field == "closed_run_ttl" else RUN[field]
    assert (refusal.field, refusal.value, refusal.run_value) == (field, value, run_value)
    assert refusal.run_id == members[0].rdzv.run_id
    assert f"{field}=" in str(refusal) and "differs from the run's" in str(refusal)
    assert isinstance(refusal, ValueError)  # a ConfigError: rdzv-run exits 2

    after = kv.get(keys.round_record)
    assert after is not None and after.revision == before.revision  # not even a compare-and-swap
    state = members[0].rdzv.describe()
    assert (state["status"], state["version"], state["joined"], state["waiting"]) == ("final", first[0].version, 2, 0)
    assert [m.rdzv.num_nodes_waiting() for m in members] == [0, 0]

    late = nodes(1)[0].start()  # a third node with the run's settings: the round grows
    eventually(lambda: members[0].rdzv.num_nodes_waiting() == 1, 20, "the matching node counted as waiting")
    grown = round_of([m.start() for m in members] + [late], 30)
    assert grown[0].version > first[0].version


@pytest.mark.parametrize("first_nnodes, second_nnodes", [((2, 3), (2, 2)), ((2, 2), (2, 3))],
                         ids=["elastic-first", "fixed-first"])
def test_mixed_nnodes_the_second_is_refused_before_it_joins(nodes, first_nnodes, second_nnodes) -> None:
    """A node with ``--nnodes 2:3`` and one with ``2:2`` in one run (in either order): the second to arrive
    is refused, naming ``max_nodes`` and both values, before it takes a ticket; a third node with the first's
    settings then forms the round with the first. Before, the two formed a round silently, and the third
    node made the ``2:2`` one fail with a corrupt-state error that closed the run for all three."""
    (low, high), (low2, high2) = first_nnodes, second_nnodes
    waiting = nodes(1, min_nodes=low, max_nodes=high)[0].start()
    eventually(lambda: waiting.rdzv.describe().get("joined") == 1, 20, "the first node joined")

    refusal = _refused(nodes(1, min_nodes=low2, max_nodes=high2)[0])
    assert (refusal.field, refusal.value, refusal.run_value) == ("max_nodes", high2, high)
    assert waiting.rdzv.describe().get("joined") == 1  # the refused node took no ticket
    assert not waiting.done.is_set()

    third = nodes(1, min_nodes=low, max_nodes=high)[0].start()
    round_of([waiting, third], 30)
    assert not waiting.rdzv.is_closed()


def test_a_closed_run_is_reported_closed_and_its_configuration_expires_with_it(nodes, kv) -> None:
    """A node with other settings at a closed run hears that the run is closed (the more useful answer);
    the configuration expires with the closed run's keys, and then a job with other settings starts afresh."""
    members = [n.start() for n in nodes(2, closed_run_ttl=2.0)]
    round_of(members, 30)
    keys = members[0].rdzv.keys
    assert kv.get(keys.config) is not None
    members[0].rdzv.set_closed()
    with pytest.raises(RendezvousClosedError):
        nodes(1, max_nodes=2, closed_run_ttl=2.0)[0].start().wait(REFUSED_WITHIN)
    for m in members:
        m.rdzv.leave()
    gone = (keys.closed, keys.config, keys.round_record)  # each expires on its own (etcd v2: whole seconds)
    eventually(lambda: all(kv.get(k) is None for k in gone), 60, "the closed run expired")
    fresh = nodes(1, min_nodes=1, max_nodes=1, last_call_timeout=0.1)[0].start()
    assert fresh.wait(30).world_size == 1


def test_a_run_without_a_configuration_gets_the_next_nodes(nodes, kv) -> None:
    """A run created by a version without the configuration key (or whose key was lost): the next node
    records its settings, joins, and a node with other settings is refused from then on."""
    members = [n.start() for n in nodes(2)]
    round_of(members, 30)
    keys = members[0].rdzv.keys
    entry = kv.get(keys.config)
    assert entry is not None
    kv.compare_and_delete(keys.config, entry.revision)  # as a run of an older version has none

    late = nodes(1)[0].start()
    eventually(lambda: members[0].rdzv.num_nodes_waiting() == 1, 20, "the late node counted as waiting")
    assert kv.get(keys.config) is not None  # recorded again, by the late node
    round_of([m.start() for m in members] + [late], 30)
    assert _refused(nodes(1, last_call_timeout=9.0)[0]).field == "last_call_timeout"


def test_a_configuration_recorded_as_the_run_closes_does_not_outlive_it(nodes, kv) -> None:
    """The first node's read finds the run open, then the run closes (its keys get their TTL), then the node
    creates the configuration: the node deletes it again, so no key of the run lacks the closed run's TTL."""
    closer, newcomer = nodes(1)[0], nodes(1)[0]
    keys = newcomer.rdzv.keys
    create = newcomer.kv.create

    def create_after_the_close(key: str, value: bytes, ttl: float | None = None) -> Any:
        if key == keys.config:
            closer.rdzv.set_closed()
        return create(key, value, ttl)

    newcomer.kv.create = create_after_the_close  # type: ignore[method-assign]
    assert check_run_config(newcomer.kv, keys, newcomer.rdzv.params) == (None, False)
    assert kv.get(keys.config) is None
    assert kv.get(keys.closed) is not None


@pytest.mark.parametrize("garbage", [b"not json", b"[1]", b'{"min_nodes": 3, "max_nodes": 2}',
                                     b'{"min_nodes": 1, "max_nodes": 2, "last_call_timeout": "x"}'])
def test_a_corrupt_configuration_is_a_state_error_naming_its_key(nodes, kv, garbage: bytes) -> None:
    node = nodes(1)[0]
    kv.put(node.rdzv.keys.config, garbage)
    with pytest.raises(RendezvousStateError) as info:
        node.start().wait(REFUSED_WITHIN)
    assert info.value.key == node.rdzv.keys.config
