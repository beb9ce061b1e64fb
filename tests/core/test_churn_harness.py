"""The conformance suite's churn (:mod:`conformance_tests.churn`) always gives its checks something to check.

Its history checker proves nothing about a churn in which no round re-formed; on a loaded host the first
round can take longer than the churn's actions, and every kill can hit a spare. These run the churn on
``memory://`` with the first round's formation slower than the churn's duration would allow.
"""

from __future__ import annotations

from rdzv_core import open_backend

from conformance_tests.churn import run_churn


def test_a_churn_whose_first_round_forms_late_still_re_forms_a_round() -> None:
    # max_nodes above the agents: the first round waits out its last call (5 s), longer than the 4 s churn
    result = run_churn(lambda: open_backend("memory://churn-harness/"), seed=7, agents=4,
                       duration=4.0, min_nodes=2, max_nodes=8, last_call_timeout=5.0, keep_alive_ttl=1.0,
                       tick=(1.0, 1.0), p_kill=1.0, p_leave=0.0)
    assert not result.errors
    assert result.kills >= 1
    assert result.rounds >= 2, f"only {result.rounds} round(s) formed"
    assert not result.history.violations()
