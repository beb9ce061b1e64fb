"""Library logging: records about a rendezvous carry run id, round version and rank; no handlers installed."""

from __future__ import annotations

import logging
import threading
import uuid

from rdzv_core import Rendezvous, RendezvousParams, open_backend


def test_rendezvous_records_carry_run_id_version_and_rank(caplog) -> None:
    run_id = f"log{uuid.uuid4().hex[:8]}"
    params = RendezvousParams(min_nodes=2, max_nodes=2, keep_alive_ttl=5, timeout=30)
    with open_backend("memory://logging/") as kv, caplog.at_level(logging.DEBUG, logger="rdzv_core"):
        nodes = [Rendezvous(kv, run_id, params) for _ in range(2)]
        results: dict[int, object] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, nodes[i].next_round())) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for node in nodes:
            node.leave()
    assert len(results) == 2
    records = [r for r in caplog.records if r.name == "rdzv_core.rendezvous"]
    assert records
    assert {getattr(r, "rdzv_run_id", None) for r in records} == {run_id}
    complete = [r for r in records if getattr(r, "rdzv_rank", None) is not None]
    # each node's "round complete" record names its own rank and the round's version
    assert sorted(r.rdzv_rank for r in complete) == [0, 1]  # type: ignore[attr-defined]
    assert {r.rdzv_version for r in complete} == {1}  # type: ignore[attr-defined]


def test_the_library_installs_no_logging_handlers() -> None:
    import rdzv_agent  # noqa: F401
    import rdzv_backends  # noqa: F401
    import rdzv_core  # noqa: F401

    for name in ("rdzv_core", "rdzv_backends", "rdzv_agent"):
        assert logging.getLogger(name).handlers == []
