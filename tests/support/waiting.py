"""The tests' one polling helper: :func:`eventually` (``condition``, ``timeout``, ``what``[, ``detail``]) returns
the condition's first truthy value or fails saying what it waited for and how long. It is the conformance
suite's own (:mod:`conformance_tests.waiting`, shipped without ``tests/``), so both poll alike.

Helpers that mean something else keep their own loops: ``fault_agents.AgentProcess.wait_for`` and
``test_multihost_rendezvous``'s ``wait_for`` wait for an event in a stream after a mark; the conformance
suite's ``_eventually`` retries an operation while the backend is unavailable; ``test_rendezvous``'s ``_until``
re-checks on every change under a prefix (a watch, not a poll)."""

from __future__ import annotations

from conformance_tests.waiting import eventually

__all__ = ["eventually"]
