"""Fixtures of the launcher-level tests: ``node_url`` (a fresh run's URL on the backend under test) and
``procs`` (launchers started by a test, killed at teardown)."""

from __future__ import annotations

import pytest

from tests.support.agent_workers.harness import Launcher, kill_run
from tests.support.launch_runs import FAST


@pytest.fixture
def node_url(rdzv_base_url, rdzv_url):
    """``node_url(run_id, **query)`` -> URL of a fresh run on the backend under test."""
    if rdzv_base_url.startswith("memory://"):
        pytest.skip("memory:// is in-process; launchers are separate processes")

    def build(run_id: str, **query: str) -> str:
        return rdzv_url(run_id=run_id, **{**FAST, **query})

    return build


@pytest.fixture
def procs(tmp_path):
    """Start launchers with ``procs.start(argv, name, **kw)``; all killed at teardown."""

    class Procs:
        launchers: list[Launcher] = []
        run_ids: list[str] = []

        def start(self, argv, name, **kw):
            launcher = Launcher(argv, str(tmp_path), name, **kw)
            self.launchers.append(launcher)
            return launcher

    p = Procs()
    p.launchers, p.run_ids = [], []
    yield p
    kill_run(p.launchers, p.run_ids)
