"""``python -m benchmarks.netcheck`` still runs (so the network check's benchmark never rots)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.agent_workers.harness import REPO

pytestmark = [pytest.mark.slow, pytest.mark.benchmark]


def test_netcheck_benchmark_prints_a_row_per_size() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.netcheck", "--nodes", "3", "4", "--mib", "0.5"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["3", "4"], done.stdout
    assert all(float(row[1]) >= 0 and row[-3] == "0" for row in rows), done.stdout  # no outlier on loopback
