"""The benchmark's smoke mode still runs end to end (so ``benchmarks/`` never rots).

Runs ``python -m benchmarks.run --smoke`` (N = 8 on every backend, the c10d
baseline, one re-rendezvous, Store throughput with one client) against real
servers it starts itself, and checks that results exist and that every agent
got a correct rank. No timing assertions: the numbers depend on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RDZV_TARGETS = ("memory", "file", "redis", "etcd-v2", "etcd-v3")

pytestmark = [pytest.mark.slow, pytest.mark.benchmark, pytest.mark.launchers, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, f"smoke run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out / "benchmarks.json") as f:
        results = json.load(f)
    results["_out"] = str(out)
    return results


def test_every_backend_and_the_c10d_baseline_gave_correct_ranks(smoke: dict) -> None:
    cells = {(c["target"], c["n"]): c for c in smoke["latency"]}
    for target in (*RDZV_TARGETS, "torch:c10d"):
        cell = cells[(target, 8)]
        assert cell["status"] == "ok", (target, cell)
        assert cell["reps"], target
        for rep in cell["reps"]:
            assert rep["ranks_ok"] is True, (target, rep["problem"])
            assert rep["n_agents"] == rep["finished"] == 8
            assert rep["latency_s"] is not None


def test_requests_were_counted_for_every_rdzv_backend(smoke: dict) -> None:
    for cell in smoke["latency"]:
        if cell["target"] not in RDZV_TARGETS:
            continue
        counts = cell["reps"][0]["counts_per_agent"]
        assert counts["round"]["ops"]["take_ticket"] >= 2  # a join ticket and a confirmation per agent
        assert counts["round"]["writes"] > 0 and counts["round"]["reads"] > 0
    servers = {c["target"]: c["reps"][0]["server_requests_per_agent"] for c in smoke["latency"]}
    for target in ("redis", "etcd-v2", "etcd-v3"):
        assert servers[target]["total"] > 0, target


def test_survivors_of_a_killed_agent_got_new_ranks(smoke: dict) -> None:
    cells = {c["target"]: c for c in smoke["rerendezvous"]}
    assert set(cells) == set(RDZV_TARGETS)
    for target, cell in cells.items():
        assert cell["status"] == "ok", (target, cell)
        for rep in cell["reps"]:
            assert rep["ranks_ok"] is True, (target, rep["problem"])
            assert rep["n_agents"] == 7  # the survivors of 8


def test_store_throughput_was_measured_for_every_store(smoke: dict) -> None:
    stores = smoke["throughput"]["results"]
    assert set(stores) == {*RDZV_TARGETS, "tcpstore"}
    for store, rows in stores.items():
        assert "error" not in rows, (store, rows)
        row = rows["1"]
        assert row["errors"] == [], (store, row["errors"])
        for op in ("set", "get", "add"):
            assert row[op] > 0, (store, op)


def test_outputs_record_the_command_and_load(smoke: dict) -> None:
    assert smoke["command"].startswith("python -m benchmarks.run --smoke")
    assert len(smoke["machine"]["loadavg_start"]) == 3
    assert os.path.getsize(os.path.join(smoke["_out"], "results.md")) > 0
    pytest.importorskip("matplotlib")
    assert os.path.getsize(os.path.join(smoke["_out"], "benchmarks.png")) > 0


def test_steady_scenario_judges_a_held_round(tmp_path) -> None:
    """``--steady``: 4 memory agents hold one round 3 s; nothing lapsed, and the verdict says so (~6 s)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--steady", "3", "--steady-n", "4", "--targets", "memory",
         "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"steady run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(tmp_path / "benchmarks.json") as f:
        cell = json.load(f)["steady"][0]
    assert cell["status"] == "ok", cell
    assert cell["alive_keys_at_start"] == cell["alive_keys_min"] == 4
    assert cell["monitor_checks"] >= 1 and cell["refreshes"] >= 4  # every key refreshed at least once in 3 s
    assert 0 < cell["refresh_gap_max_s"] < cell["keep_alive_ttl"]


def test_elasticity_benchmark_smoke_recovers_from_a_kill_and_seats_the_spare(tmp_path) -> None:
    """``python -m benchmarks.elastic --smoke``: 3 real rdzv-run nodes over file://, a kill and the spare event
    (about 30 s). Outcomes only: every job started and recovered, the members did not restart for the spare."""
    out = tmp_path / "elastic.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.elastic", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    record = json.loads(out.read_text())
    events = {r["event"]: r for r in record["results"]}
    assert set(events) == {"kill", "spare"}
    assert all(r["status"] == "ok" and r["recovery_s"] is not None for r in events.values()), events
    assert events["spare"]["member_restarts"] == 0 and events["spare"]["spare_steps_in_hold"] == 0
    verdicts = {v["what"] for v in record["summary"]["verdicts"]}
    assert "lc1: spare rdzv-run:file: 0 member restarts while waiting" in verdicts
    assert events["kill"]["phases"]["rendezvous"] is not None and events["kill"]["milestones"]["step"] is not None


def test_elasticity_report_marks_a_baseline_that_never_recovered() -> None:
    from benchmarks import elastic_report

    record = {"config": {"limit_s": 90.0, "targets": ["rdzv-run:redis", "torchrun:c10d"], "events": ["freeze"],
                         "settings": {"defaults": None}, "reps": 3},
              "results": [{"target": "rdzv-run:redis", "event": "freeze", "setting": "defaults", "recovery_s": v}
                          for v in (6.0, 7.0, 9.0)]
              + [{"target": "torchrun:c10d", "event": "freeze", "setting": "defaults", "recovery_s": v}
                 for v in (None, None, 64.0)]}
    summary = elastic_report.summarize(record)
    ours = next(c for c in summary["cells"] if c["target"] == "rdzv-run:redis")
    theirs = next(c for c in summary["cells"] if c["target"] == "torchrun:c10d")
    assert (ours["median_s"], theirs["median_s"], theirs["recovered"]) == (7.0, None, 1)
    assert ours["x_c10d"] == ">12.9"
    verdicts = {v["what"]: v["met"] for v in summary["verdicts"]}
    assert verdicts == {"defaults: freeze rdzv-run:redis <= 6.5 s": False,
                        "defaults: freeze rdzv-run:redis >= 10x faster than torchrun:c10d": True}


def test_lemon_benchmark_smoke_the_ledger_seats_the_spare_and_the_lemon_stops_starting(tmp_path) -> None:
    """``python -m benchmarks.lemon --smoke``: 3 real rdzv-run nodes and a spare over file://, one a lemon, 60 s
    with the ledger (cooldown 30 s) and 60 s without (about 2.5 min). Outcomes only: with the ledger the job trains
    at world size 3 with the spare and the lemon started at most twice before its quarantine ended; without it the
    lemon started more often; no process of either arm is left."""
    import psutil

    out = tmp_path / "lemon.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lemon", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    arms = {r["arm"]: r for r in json.loads(out.read_text())["results"]}
    ledger, plain = arms["ledger"], arms["no-ledger"]
    assert ledger["first_world3_s"] is not None and ledger["spare_trained"] and ledger["training_s"] > 0, ledger
    assert ledger["quarantines"] >= 1 and ledger["lemon_starts_before_cooldown_end"] <= 2, ledger
    assert plain["lemon_starts"] > ledger["lemon_starts_before_cooldown_end"], (plain, ledger)
    tags = {r["tag"] for r in arms.values()}
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("LEMON_BENCH_TAG") in tags:
                left.append(p.pid)
        except psutil.Error:
            continue
    assert not left, f"processes of the benchmark still running: {left}"
