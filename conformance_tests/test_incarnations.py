"""Incarnations of a run (``docs/design.md``, "Incarnations"), on every backend: a restarted job's incarnation is a
run of its own in the backend. A closed incarnation does not close the next one, their keys never mix, and
incarnation 0 is the run exactly as it was before incarnations existed.

Each job is one handler (``min_nodes=max_nodes=1``): a round, a write to the round's Store, ``shutdown()`` (which
closes the run). Keys are listed through the protocol under a prefix of the test's own.
"""

from __future__ import annotations

import uuid
from typing import Callable

import pytest

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from rdzv_core import KVBackend, create_handler
from rdzv_core.rendezvous import RunKeys

from .jobs import job_url, run_job


def _url(base_url: str, prefix: str, run_id: str, **extra: str) -> str:
    return job_url(base_url, prefix, run_id, timeout="30", **extra)


def _job(url: str) -> int:
    """One finished job on ``url``: its round's world size (the run is closed afterwards)."""
    return int(run_job(url).world_size)


def _closed(url: str) -> bool:
    handler = create_handler(url)
    try:
        return bool(handler.is_closed())
    finally:
        handler.release()


def _keys(kv: KVBackend, tree: str) -> list[str]:
    return [e.key for e in kv.list(tree)[0]]


@pytest.fixture
def prefix() -> str:
    return f"incarnations/t{uuid.uuid4().hex[:12]}"


def test_a_closed_incarnation_does_not_close_the_next(rdzv_base_url: str, prefix: str) -> None:
    first, second = (_url(rdzv_base_url, prefix, "job", incarnation=str(n)) for n in (0, 1))
    assert _job(first) == 1
    assert _closed(first)
    late = create_handler(first, local_addr="127.0.0.1")
    try:
        with pytest.raises(RendezvousClosedError):  # incarnation 0 itself stays closed
            late.next_rendezvous()
    finally:
        late.release()
    assert not _closed(second)
    assert _job(second) == 1  # the restarted job forms its round
    assert _closed(second) and _closed(first)
    assert _job(_url(rdzv_base_url, prefix, "job", incarnation="2")) == 1


def test_two_incarnations_keep_their_keys_apart(rdzv_base_url: str, prefix: str,
                                                kv_factory: Callable[[], KVBackend]) -> None:
    kv = kv_factory()
    zero, one = RunKeys(prefix, "job"), RunKeys(prefix, "job", 1)
    handler = create_handler(_url(rdzv_base_url, prefix, "job", incarnation="1"), local_addr="127.0.0.1")
    try:
        handler.next_rendezvous().store.set("k", b"v")
        assert _keys(kv, zero.tree) == []  # nothing of incarnation 1 under incarnation 0's root
        ones = _keys(kv, one.tree)
        assert one.round_record in ones and one.config in ones
        assert all(k.startswith(one.tree) for k in _keys(kv, prefix + "/"))
    finally:
        handler.shutdown()
    assert kv.get(one.closed) is not None and kv.get(zero.closed) is None  # closing 1 closed only 1
    assert _job(_url(rdzv_base_url, prefix, "job")) == 1
    assert kv.get(zero.closed) is not None
    assert not any(k.startswith(one.tree) for k in _keys(kv, zero.tree))


def test_incarnation_zero_is_the_run_itself(rdzv_base_url: str, prefix: str,
                                            kv_factory: Callable[[], KVBackend]) -> None:
    kv = kv_factory()
    assert _job(_url(rdzv_base_url, prefix, "job", incarnation="0")) == 1
    assert kv.get(f"{prefix}/run_job/state/closed") is not None  # the keys every earlier version used
    assert _closed(_url(rdzv_base_url, prefix, "job"))


def test_a_closed_runs_error_names_an_incarnation_not_used_yet(rdzv_base_url: str, prefix: str) -> None:
    for n in (0, 1):
        assert _job(_url(rdzv_base_url, prefix, "job", incarnation=str(n))) == 1
    late = create_handler(_url(rdzv_base_url, prefix, "job"), local_addr="127.0.0.1")
    try:
        with pytest.raises(RendezvousClosedError) as refused:
            late.next_rendezvous()
    finally:
        late.release()
    assert str(refused.value).endswith("incarnation=2")  # 1 is closed too
    assert _job(_url(rdzv_base_url, prefix, "job", incarnation="2")) == 1
