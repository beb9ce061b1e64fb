"""One-node jobs for the conformance tests of whole runs (closed runs, incarnations): a job is one handler with
``min_nodes=max_nodes=1`` that forms its round, writes to the round's Store and ends with ``shutdown()``, which
closes the run."""

from __future__ import annotations

from typing import Any

from rdzv_core import create_handler

__all__ = ["job_url", "run_job"]


def job_url(base_url: str, prefix: str, run_id: str, **query: str) -> str:
    """The URL of run ``run_id`` under key prefix ``prefix`` on the backend of ``base_url`` (a ``--rdzv-url``), for
    one-node jobs with a short last call; ``query`` adds or replaces query keys."""
    base, _, fixed = base_url.partition("?")
    params = {"min_nodes": "1", "max_nodes": "1", "last_call_timeout": "0.1", "prefix": prefix, **query}
    return f"{base}{run_id}?" + "&".join([fixed] * bool(fixed) + [f"{k}={v}" for k, v in params.items()])


def run_job(url: str) -> Any:
    """One job on ``url``: its round's ``RendezvousInfo`` (rank, world size, store); the run is closed afterwards.

    Raises:
        AssertionError: ``shutdown()`` did not close the run.
        torch's RendezvousClosedError: the run was closed already.
    """
    handler = create_handler(url, local_addr="127.0.0.1")
    info = handler.next_rendezvous()
    info.store.set("result", b"done")
    assert handler.shutdown() is True
    return info
