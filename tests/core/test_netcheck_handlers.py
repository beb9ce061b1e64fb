"""The network check run by the handler (``RdzvHandler.next_rendezvous``): four handlers in threads over
``file://``, listening on loopback; a node made slow through the module's test seam (``netcheck._throttle``)."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest

pytest.importorskip("torch.distributed.elastic.rendezvous")

from rdzv_core import create_handler  # noqa: E402
from rdzv_core.torch_api import netcheck  # noqa: E402


def _url(base: str, run_id: str, **q: object) -> str:
    query = {"min_nodes": 2, "max_nodes": 4, "keep_alive_ttl": 1, "last_call_timeout": 10, "timeout": 60,
             "network_check": 1, "network_check_mib": 0.25, "network_check_timeout": 20, **q}
    return f"{base}{run_id}?" + "&".join(f"{k}={v}" for k, v in query.items())


def _run(handlers: list, outcome: dict, name: str) -> threading.Thread:
    def run() -> None:
        try:
            outcome[name] = handlers[int(name[1:])].next_rendezvous()
        except BaseException as exc:  # asserted by the test
            outcome[name] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _handlers(url: str) -> list:
    return [create_handler(url, local_addr="127.0.0.1", node_name=f"n{i}") for i in range(4)]


def _three_and_one_without(tmp_path, **q: object) -> list:
    """n0-n2 with the check (``q`` in their URLs and n3's), n3 with ``network_check=0``: one fresh run."""
    run_id, base = f"nc{uuid.uuid4().hex[:8]}", f"file://{tmp_path}/"
    without = {k: v for k, v in q.items() if not k.startswith("network_check")}
    return [*_handlers(_url(base, run_id, **q))[:3],
            create_handler(_url(base, run_id, **without, network_check=0), local_addr="127.0.0.1", node_name="n3")]


def test_a_round_of_healthy_links_passes_the_check(tmp_path, caplog) -> None:
    url = _url(f"file://{tmp_path}/", f"nc{uuid.uuid4().hex[:8]}")
    handlers = _handlers(url)
    outcome: dict = {}
    caplog.set_level(logging.INFO, logger="rdzv_core.torch_api.netcheck")
    threads = [_run(handlers, outcome, f"n{i}") for i in range(4)]
    for t in threads:
        t.join(60)
    infos = [outcome.get(f"n{i}") for i in range(4)]
    assert all(getattr(i, "world_size", None) == 4 for i in infos), infos
    lines = [r.getMessage() for r in caplog.records if "network check of round" in r.getMessage()]
    assert len(lines) == 4 and all(" n=4, " in line for line in lines), lines
    assert all(not h.rendezvous.ledger.read(f"n{i}").offences for i, h in enumerate(handlers))
    for h in handlers:
        h.shutdown()


def test_a_node_with_a_trickling_listener_is_left_out_and_quarantined(tmp_path, monkeypatch) -> None:
    """n3 receives at 64 KiB/s (the others at loopback speed): its two receiving links are slow, so it is the
    outlier; it records a network offence (quarantined at once) and waits at the gate; the other three form a
    round of 3 and check it again (it passes)."""
    monkeypatch.setattr(netcheck, "_throttle", lambda role, node: 64 * 1024 if (role, node) == ("recv", "n3")
                        else None)
    url = _url(f"file://{tmp_path}/", f"nc{uuid.uuid4().hex[:8]}")
    handlers = _handlers(url)
    outcome: dict = {}
    threads = {f"n{i}": _run(handlers, outcome, f"n{i}") for i in range(4)}
    for name in ("n0", "n1", "n2"):
        threads[name].join(90)
    infos = [outcome.get(name) for name in ("n0", "n1", "n2")]
    assert all(getattr(i, "world_size", None) == 3 for i in infos), infos
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert "n3" not in outcome  # still kept out at the gate
    entry = handlers[0].rendezvous.ledger.read("n3")
    assert entry.quarantined() and [o.kind for o in entry.offences] == ["network"], entry
    assert all(not handlers[0].rendezvous.ledger.read(f"n{i}").offences for i in range(3))
    handlers[0].set_closed()
    threads["n3"].join(30)
    assert "kept out" in str(outcome.get("n3")) or "closed" in str(outcome.get("n3")), outcome.get("n3")
    for h in handlers:
        h.shutdown()


def test_a_slow_node_is_kept_when_the_round_cannot_go_on_without_it(tmp_path, monkeypatch, caplog) -> None:
    """min_nodes=3 of three: n2's sends trickle, but leaving it out would leave two: nobody is left out (a
    WARNING names it) and nobody is charged."""
    monkeypatch.setattr(netcheck, "_throttle", lambda role, node: 64 * 1024 if (role, node) == ("send", "n2")
                        else None)
    url = _url(f"file://{tmp_path}/", f"nc{uuid.uuid4().hex[:8]}", min_nodes=3, max_nodes=3)
    handlers = _handlers(url)[:3]
    outcome: dict = {}
    caplog.set_level(logging.WARNING, logger="rdzv_core.torch_api.netcheck")
    threads = [_run(handlers, outcome, f"n{i}") for i in range(3)]
    for t in threads:
        t.join(60)
    assert all(getattr(outcome.get(f"n{i}"), "world_size", None) == 3 for i in range(3)), outcome
    kept = [r.getMessage() for r in caplog.records if "kept in (min_nodes=3)" in r.getMessage()]
    assert len(kept) == 3 and all("slow node n2" in line for line in kept), kept
    assert all(not handlers[0].rendezvous.ledger.read(f"n{i}").offences for i in range(3))
    for h in handlers:
        h.shutdown()


def test_a_node_without_the_check_is_not_judged(tmp_path, caplog) -> None:
    """n3 runs without network_check: it publishes no address, the others' links with it are not measured, and
    nobody is left out (a WARNING says that it took no part)."""
    handlers = _three_and_one_without(tmp_path, network_check_timeout=3)
    outcome: dict = {}
    caplog.set_level(logging.WARNING, logger="rdzv_core.torch_api.netcheck")
    threads = [_run(handlers, outcome, f"n{i}") for i in range(4)]
    for t in threads:
        t.join(60)
    assert all(getattr(outcome.get(f"n{i}"), "world_size", None) == 4 for i in range(4)), outcome
    absent = [r.getMessage() for r in caplog.records if "published no address" in r.getMessage()]
    assert len(absent) == 3, absent
    assert all(not handlers[0].rendezvous.ledger.read(f"n{i}").offences for i in range(4))
    for h in handlers:
        h.shutdown()


def test_nobody_is_left_out_while_a_member_takes_no_part(tmp_path) -> None:
    """n3 runs without network_check and joins last (the highest rank: the ring successor of a checking node, as
    a late node on another host): the links that depended on it are not all measured, so nobody is judged --
    every node stays in the one round (none re-forms, so none is stranded in it) and nobody is charged."""
    handlers = _three_and_one_without(tmp_path, network_check_timeout=8, rank_policy="join")
    outcome: dict = {}
    threads = [_run(handlers, outcome, f"n{i}") for i in range(3)]
    observer = handlers[0].rendezvous
    deadline = threading.Event()
    for _ in range(600):  # the three have joined (bounded: 60 s)
        if observer.describe().get("joined") == 3:
            break
        deadline.wait(0.1)
    threads.append(_run(handlers, outcome, "n3"))
    for t in threads:
        t.join(90)
    infos = [outcome.get(f"n{i}") for i in range(4)]
    assert all(getattr(i, "world_size", None) == 4 for i in infos), infos
    assert infos[3].rank == 3 and len({handlers[i].round_version() for i in range(4)}) == 1
    assert all(not handlers[0].rendezvous.ledger.read(f"n{i}").offences for i in range(4))
    for h in handlers:
        h.shutdown()
