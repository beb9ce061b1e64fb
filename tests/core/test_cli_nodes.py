"""``rdzv nodes`` (the node ledger: states, reasons, ``--forgive``) and ``rdzv status``'s ``kept_out``, in-process."""

from __future__ import annotations

import json
import time
import uuid
from typing import Iterator

import pytest

from rdzv_core import Rendezvous, RendezvousParams, open_backend
from rdzv_core.kv import KVBackend
from rdzv_core.rendezvous import RunKeys
from rdzv_core.rendezvous.ledger import NodeLedger, QuarantinePolicy
# Imported at collection, not inside a test (see tests/core/test_cli.py: pytest's rewriting and 3.11's shared AST).
from rdzv_admin.cli import main

QUARANTINED, UNHEALTHY, HEALTHY = "gpu-07", "gpu-09", "gpu-01"
CHECK_REASON = "GPU 3: 12 uncorrectable ECC errors"


@pytest.fixture(params=["file", "memory"])
def base(request: pytest.FixtureRequest, tmp_path) -> str:
    """A backend URL without a run id: a directory of ``tmp_path``, or a fresh in-process keyspace."""
    return f"file://{tmp_path}/" if request.param == "file" else f"memory://nodes-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def kv(base: str) -> Iterator[KVBackend]:
    backend = open_backend(base)
    yield backend
    backend.close()


def _ledger(kv: KVBackend, run_id: str = "job", prefix: str | None = None, incarnation: int = 0) -> NodeLedger:
    """A ledger with one quarantined node (two offences, ``after=2``), one unhealthy (its check fails) and one
    healthy (one offence)."""
    keys = RunKeys(RendezvousParams(min_nodes=1).prefix if prefix is None else prefix, run_id, incarnation)
    ledger = NodeLedger(kv, keys, QuarantinePolicy(after=2))
    ledger.offend(QUARANTINED, "failed", "exit code 1: CUDA error: an illegal memory access")
    ledger.offend(QUARANTINED, "failed", "exit code 1: NCCL watchdog timeout")
    ledger.note_check(UNHEALTHY, CHECK_REASON)
    ledger.offend(HEALTHY, "network", "link to gpu-02 at 3 Gbit/s")
    return ledger


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _states(out: str) -> dict[str, str]:
    return {row["node"]: row["state"] for row in json.loads(out)}


def test_nodes_shows_each_nodes_state_and_why(base: str, kv: KVBackend, capsys) -> None:
    _ledger(kv)
    code, out, err = _run(capsys, "nodes", base + "job")
    assert code == 0 and err == ""
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0].startswith("gpu-")}
    assert set(rows) == {QUARANTINED, UNHEALTHY, HEALTHY}, out
    assert "quarantined" in rows[QUARANTINED] and "NCCL watchdog timeout" in rows[QUARANTINED]  # the last offence
    assert "unhealthy" in rows[UNHEALTHY] and CHECK_REASON in rows[UNHEALTHY]
    assert "healthy" in rows[HEALTHY] and "quarantined" not in rows[HEALTHY]


def test_nodes_json_has_every_entry_and_its_state(base: str, kv: KVBackend, capsys) -> None:
    _ledger(kv)
    code, out, _ = _run(capsys, "nodes", base + "job", "--json")
    assert code == 0
    assert _states(out) == {QUARANTINED: "quarantined", UNHEALTHY: "unhealthy", HEALTHY: "healthy"}
    rows = {row["node"]: row for row in json.loads(out)}
    assert rows[QUARANTINED]["quarantines"] == 1 and rows[QUARANTINED]["until"] > time.time()
    assert [o["kind"] for o in rows[QUARANTINED]["offences"]] == ["failed", "failed"]
    assert rows[UNHEALTHY]["check"] == CHECK_REASON and "until" not in rows[UNHEALTHY]
    assert len(rows[HEALTHY]["offences"]) == 1


def test_forgive_ends_the_quarantine_and_clears_the_offences(base: str, kv: KVBackend, capsys) -> None:
    ledger = _ledger(kv)
    before = ledger.read(QUARANTINED)
    code, _, err = _run(capsys, "nodes", base + "job", "--forgive", QUARANTINED)  # no terminal, no --yes: refuses
    assert code == 1 and QUARANTINED in err
    assert ledger.read(QUARANTINED) == before
    code, _, err = _run(capsys, "nodes", base + "job", "--forgive", QUARANTINED, "--yes")
    assert code == 0, err
    after = ledger.read(QUARANTINED)
    assert (after.offences, after.quarantined(), after.state()) == ((), False, "healthy")
    code, out, _ = _run(capsys, "nodes", base + "job", "--json")
    assert code == 0
    rows = {row["node"]: row for row in json.loads(out)}
    assert (rows[QUARANTINED]["state"], rows[QUARANTINED]["offences"]) == ("healthy", [])
    assert rows[UNHEALTHY]["state"] == "unhealthy"  # the others untouched


def test_forgiving_an_unhealthy_node_leaves_its_failing_check(base: str, kv: KVBackend, capsys) -> None:
    """Forgiving clears offences and quarantine; a check that fails keeps the node out until it passes."""
    ledger = _ledger(kv)
    code, out, _ = _run(capsys, "nodes", base + "job", "--forgive", UNHEALTHY, "--yes", "--json")
    assert code == 0
    shown = json.loads(out)
    assert (shown["node"], shown["state"], shown["offences"]) == (UNHEALTHY, "unhealthy", [])
    assert ledger.read(UNHEALTHY).check == CHECK_REASON


def test_forgiving_a_node_not_in_the_ledger_exits_2_and_writes_nothing(base: str, kv: KVBackend, capsys) -> None:
    ledger = _ledger(kv)

    def stored() -> list[tuple[str, int, bytes]]:
        return [(e.key, e.revision, e.value) for e in kv.list(ledger.keys.tree)[0]]

    before = stored()
    code, out, err = _run(capsys, "nodes", base + "job", "--forgive", "gpu-99", "--yes")
    assert code == 2 and out == ""
    assert "gpu-99" in err and len(err.strip().splitlines()) == 1
    assert stored() == before and kv.get(ledger.key("gpu-99")) is None


def test_status_lists_the_nodes_kept_out_without_changing_the_verdict(base: str, kv: KVBackend, capsys) -> None:
    member = Rendezvous(kv, "job", RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    member.next_round()
    try:
        _ledger(kv)
        code, out, _ = _run(capsys, "status", base + "job", "--json")
        assert code == 0
        status = json.loads(out)
        assert status["verdict"] == "healthy"
        kept = {row["node"]: row for row in status["kept_out"]}
        assert set(kept) == {QUARANTINED, UNHEALTHY}  # the healthy node is not listed
        assert kept[QUARANTINED]["state"] == "quarantined" and kept[QUARANTINED]["until"] > time.time()
        assert kept[UNHEALTHY]["state"] == "unhealthy" and CHECK_REASON in kept[UNHEALTHY]["why"]
        code, out, _ = _run(capsys, "status", base + "job")
        assert code == 0 and QUARANTINED in out and UNHEALTHY in out and HEALTHY not in out
    finally:
        member.leave()


def test_status_of_a_run_without_a_ledger_keeps_no_node_out(base: str, kv: KVBackend, capsys) -> None:
    member = Rendezvous(kv, "job", RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    member.next_round()
    try:
        code, out, _ = _run(capsys, "status", base + "job", "--json")
        assert code == 0 and json.loads(out)["kept_out"] == []
    finally:
        member.leave()


def test_nodes_reads_the_urls_prefix_and_incarnation(base: str, kv: KVBackend, capsys, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    _ledger(kv, prefix="elsewhere", incarnation=1)
    code, out, _ = _run(capsys, "nodes", base + "job?prefix=elsewhere&incarnation=1", "--json")
    assert code == 0 and _states(out)[QUARANTINED] == "quarantined"
    code, out, _ = _run(capsys, "nodes", base + "job", "--json")  # the default prefix, incarnation 0: nothing
    assert code == 0 and json.loads(out) == []
    code, out, _ = _run(capsys, "nodes", base + "job?prefix=elsewhere", "--json")  # incarnation 0 of that prefix
    assert code == 0 and json.loads(out) == []
    code, _, err = _run(capsys, "nodes", base + "job?prefix=elsewhere", "--forgive", QUARANTINED, "--yes")
    assert code == 2 and QUARANTINED in err  # not in incarnation 0's ledger


def test_a_run_url_points_to_the_shared_ledger_and_the_prefix_scope_lists_it(tmp_path, capsys) -> None:
    base = f"file://{tmp_path}/rdzv/"
    with open_backend(base) as kv:
        NodeLedger(kv, RunKeys("torchelastic/p2p", "job1"), QuarantinePolicy(after=1), scope="prefix").offend(
            "lemon", "failed", "exit 3")
    assert main(["nodes", f"{base}job2"]) == 0
    assert "ledger_scope=prefix" in capsys.readouterr().err
    assert main(["nodes", f"{base}job2?ledger_scope=prefix", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["node"], r["state"]) for r in rows] == [("lemon", "quarantined")]
