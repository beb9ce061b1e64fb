"""Admission order under churn, on every backend (marker ``rendezvous``).

About 12 agents (threads, each on its own client) re-join, leave for good, die and arrive at random for
about 12 s (:func:`conformance_tests.churn.run_churn`); the :class:`~conformance_tests.history.History` then
checks ranks, that no alive survivor re-joining was displaced by a non-member, and that nodes waiting for a
place were admitted in arrival order (predicates: :mod:`conformance_tests.history`). The seed is drawn per
run and printed in a failure's message; ``RDZV_CHURN_SEED`` fixes it.
"""

from __future__ import annotations

import os
import random
from typing import Callable

import pytest

from rdzv_core import KVBackend

from .churn import run_churn

pytestmark = pytest.mark.rendezvous


def test_admission_order_under_churn(kv_factory: Callable[[], KVBackend]) -> None:
    seed = int(os.environ.get("RDZV_CHURN_SEED") or random.SystemRandom().randrange(2**32))
    result = run_churn(kv_factory, seed, agents=12, duration=12.0)
    assert not result.errors, f"seed {seed}: agents failed: {result.errors}"
    # a run in which no round re-formed would check nothing
    assert result.rounds >= 2, f"seed {seed}: only {result.rounds} round(s) formed"
    violations = result.history.violations()
    assert not violations, (f"seed {seed} (RDZV_CHURN_SEED={seed} reruns its actions): "
                            f"{len(violations)} violation(s):\n" + "\n\n".join(violations))
