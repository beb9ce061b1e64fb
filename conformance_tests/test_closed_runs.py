"""Closed runs expire (``closed_run_ttl``): a server that runs many short jobs stays bounded, on every backend.

Each job is one handler (``min_nodes=max_nodes=1``): a round, a write to the round's Store, ``shutdown()``
(which closes the run). Keys are counted through the protocol under a prefix of the test's own, so other
tests' keys on a shared server do not count.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from rdzv_core import KVBackend, create_handler

from .jobs import job_url, run_job

JOBS = 200
CLOSED_RUN_TTL = 2.0
#: Seconds the count may take to return to its baseline after the last job (backends' expiry delays, a loaded host).
PATIENCE = 30.0


def _job_url(base_url: str, prefix: str, run_id: str, **extra: str) -> str:
    return job_url(base_url, prefix, run_id, **{"closed_run_ttl": str(CLOSED_RUN_TTL), **extra})


def _run_job(url: str) -> int:
    return int(run_job(url).rank)


def _count(kv: KVBackend, prefix: str) -> int:
    return len(kv.list(prefix + "/")[0])


@pytest.mark.timeout(600)
def test_many_closed_runs_leave_no_keys_behind(rdzv_base_url: str, kv_factory: Callable[[], KVBackend]) -> None:
    kv = kv_factory()
    prefix = f"closed-runs/t{uuid.uuid4().hex}"
    baseline = _count(kv, prefix)
    for n in range(JOBS):
        assert _run_job(_job_url(rdzv_base_url, prefix, f"job-{n}")) == 0
    left = _count(kv, prefix)
    assert left > baseline, "the last jobs' keys must still be there (else the count proves nothing)"
    deadline = time.monotonic() + CLOSED_RUN_TTL + PATIENCE
    while (left := _count(kv, prefix)) != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == baseline, f"{left} keys of {JOBS} closed runs left {PATIENCE} s after their TTL"
    # the closed mark expired with the rest: the run id starts a fresh run
    assert _run_job(_job_url(rdzv_base_url, prefix, "job-0")) == 0


def test_closed_run_ttl_none_keeps_the_run(rdzv_base_url: str, kv_factory: Callable[[], KVBackend]) -> None:
    kv = kv_factory()
    prefix = f"closed-runs/t{uuid.uuid4().hex}"
    _run_job(_job_url(rdzv_base_url, prefix, "kept", closed_run_ttl="none"))
    closed = f"{prefix}/run_kept/state/closed"
    assert kv.get(closed) is not None
    try:
        assert kv.ttl_remaining(closed) is None
    except NotImplementedError:  # the backend cannot tell a TTL: the key is still there after the job
        pass


def test_a_job_refused_by_a_closed_run_leaves_the_run_as_it_was(rdzv_base_url: str,
                                                                 kv_factory: Callable[[], KVBackend]) -> None:
    """A job started again under a closed run's id is refused and, ending as launchers do (``shutdown()``), writes
    nothing: every key of the closed run keeps its value, and the closed run's expiry does not move."""
    kv = kv_factory()
    prefix = f"closed-runs/t{uuid.uuid4().hex}"
    url = _job_url(rdzv_base_url, prefix, "done", closed_run_ttl="600")
    _run_job(url)
    closed = f"{prefix}/run_done/state/closed"
    before = {e.key: e.value for e in kv.list(prefix + "/")[0]}
    try:
        expiry_before = time.monotonic() + (kv.ttl_remaining(closed) or 0.0)
    except NotImplementedError:  # the backend cannot tell a TTL: the values and keys below still must not change
        expiry_before = None
    assert closed in before
    for _ in range(2):  # a retried job, twice
        late = create_handler(url, local_addr="127.0.0.1")
        with pytest.raises(RendezvousClosedError):
            late.next_rendezvous()
        late.shutdown()
    assert {e.key: e.value for e in kv.list(prefix + "/")[0]} == before
    if expiry_before is not None:
        remaining = kv.ttl_remaining(closed)
        assert remaining is not None and time.monotonic() + remaining <= expiry_before + 1.0, (remaining, expiry_before)
