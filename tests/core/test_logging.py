"""Library logging: records about a rendezvous carry run id, round version and rank; no handlers installed."""

from __future__ import annotations

import logging
import threading
import uuid

from tests.support.waiting import eventually
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


def test_outage_log_warns_once_per_streak_and_reports_the_recovery() -> None:
    from rdzv_core.outage import OutageLog

    emitted: list[tuple[int, str]] = []
    outage = OutageLog(lambda level, msg, *args: emitted.append((level, msg % args)))
    outage.recovered("fine")  # no streak: nothing
    for i in range(4):
        outage.failed("down %d", i)
    outage.recovered("back on %s", "h")
    outage.failed("down again")
    assert [level for level, _ in emitted] == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.DEBUG,
                                               logging.INFO, logging.WARNING]
    assert emitted[4][1].endswith("4 failed attempt(s)") and outage.failures == 1


def test_a_backend_outage_during_next_round_is_one_warning(rdzv_server_redis, caplog) -> None:
    """Rendezvous retries through a dropped connection several times a second: one WARNING for the outage
    (was one per retry: 23 lines in 8 s in a user's trial), DEBUG for the rest; the round still completes."""
    from conformance_tests.proxy import Mode, TCPProxy

    params = RendezvousParams(min_nodes=1, max_nodes=1, keep_alive_ttl=5, timeout=60)
    run_id = f"outage{uuid.uuid4().hex[:8]}"
    with TCPProxy(rdzv_server_redis.host, rdzv_server_redis.port) as proxy, \
            open_backend(f"redis://{proxy.address}/?operation_timeout=0.3") as kv, \
            caplog.at_level(logging.DEBUG, logger="rdzv_core.rendezvous"):
        node = Rendezvous(kv, run_id, params)
        proxy.set_mode(Mode.DROP)
        result: list[object] = []
        thread = threading.Thread(target=lambda: result.append(node.next_round()))
        thread.start()
        eventually(lambda: len([r for r in caplog.records if r.name == "rdzv_core.rendezvous"
                                and r.levelno in (logging.WARNING, logging.DEBUG)]) >= 5,
                   30, "five failed attempts (nothing else logs meanwhile)")
        proxy.set_mode(Mode.PASS)
        thread.join(30)
        node.leave()
    records = [r for r in caplog.records if r.name == "rdzv_core.rendezvous"]
    assert result and getattr(result[0], "world_size", None) == 1
    assert sum(r.levelno == logging.DEBUG for r in records) >= 4
    assert sum(r.levelno == logging.WARNING for r in records) == 1, [r.getMessage() for r in records]
