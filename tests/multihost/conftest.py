"""Fixtures of the membership scenarios (``test_membership.py``, ``test_node_health.py``): a backend of each
kind and a :class:`~tests.support.membership_jobs.Job` of real launchers on it, killed at teardown."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.agent_workers.harness import kill_run
from tests.support.membership_jobs import TORCHRUN_BACKEND, Backend, Job


@pytest.fixture(params=list(TORCHRUN_BACKEND))
def backend(request, tmp_path) -> Backend:
    scheme = request.param
    if scheme == "file":
        return Backend(scheme, str(tmp_path / "rdzv-store"))
    server = request.getfixturevalue("rdzv_server_redis" if scheme == "redis" else "rdzv_server_etcd")
    return Backend(scheme, server.address)


@pytest.fixture
def job(backend, tmp_path) -> Iterator[Job]:
    j = Job(backend, str(tmp_path))
    yield j
    kill_run(list(j.nodes.values()), [j.run_id])
    j.close()
