"""Node health under real launchers: pre-flight checks (``rdzv-run --node-check``, plain torchrun with
``PET_NODE_CHECK``) and restart budgets over time (``--restart-window``).

Assertions are on outcomes: which node's workers started, exit codes, the ledger's entry, start counts.
"""

from __future__ import annotations

import pytest

from rdzv_agent.restart_budget import RestartBudget, peer_loss
from rdzv_core import open_backend
from rdzv_core.rendezvous.ledger import NodeLedger, QuarantinePolicy
from rdzv_core.rendezvous.record import RunKeys
from tests.support.agent_workers.harness import WORKER
from tests.support.launch_runs import new_run, records, run_is_closed
from tests.support.waiting import eventually

pytestmark = pytest.mark.launchers  # starts launchers (tests/conftest.py)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lifetime_budget_counts_every_restart_and_a_window_forgets_old_ones() -> None:
    clock = _Clock()
    life, window = RestartBudget(2, clock=clock), RestartBudget(2, window=60.0, clock=clock)
    for budget in (life, window):
        budget.spend()
        budget.spend()
    assert (life.remaining, window.remaining) == (0, 0)
    clock.now += 61
    assert (life.remaining, window.remaining) == (0, 2)
    assert (life.spent, window.spent) == (2, 2)


def test_restarts_charged_to_a_node_left_out_are_given_back() -> None:
    budget = RestartBudget(3)
    budget.spend("lemon")
    budget.spend(None)
    budget.spend("lemon")
    assert budget.remaining == 0
    assert budget.refund(lambda name: name == "other") == 0
    assert budget.refund(lambda name: name == "lemon") == 2
    assert budget.remaining == 2 and budget.spent == 3


@pytest.mark.parametrize("error, lost", [
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1", True),
    ("torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error", True),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", False),
    ("ValueError: boom", False),
])
def test_a_lost_peer_is_told_by_the_workers_error(error: str, lost: bool) -> None:
    assert peer_loss(error) is lost


def _script(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return str(path)


def _starts(path) -> list[int]:
    return [int(n) for n in path.read_text().split()] if path.exists() else []


def test_failures_further_apart_than_the_window_never_end_the_job(procs, tmp_path) -> None:
    """``--max-restarts 3 --restart-window 2``: the worker fails 4 times, each 2.5 s after its start (so no two
    failures fall within one window), then succeeds: the job exits 0 after 5 starts. torchrun's lifetime count
    would have ended it at the fourth failure."""
    starts = tmp_path / "starts"
    worker = _script(tmp_path, "w.sh", f'echo "$TORCHELASTIC_RESTART_COUNT" >> {starts}\n'
                                       '[ "$TORCHELASTIC_RESTART_COUNT" -ge 4 ] && exit 0\nsleep 2.5\nexit 1\n')
    launcher = procs.start(["--standalone", "--max-restarts", "3", "--restart-window", "2", "--monitor-interval",
                            "0.1", "--no-python", worker], "node")
    assert launcher.wait(180) == 0, launcher.tail()
    assert _starts(starts) == [0, 1, 2, 3, 4]


def test_a_crash_loop_still_ends_after_max_restarts_within_the_window(procs, tmp_path) -> None:
    starts = tmp_path / "starts"
    worker = _script(tmp_path, "w.sh", f'echo "$TORCHELASTIC_RESTART_COUNT" >> {starts}\nexit 1\n')
    launcher = procs.start(["--standalone", "--max-restarts", "3", "--restart-window", "600", "--monitor-interval",
                            "0.1", "--no-python", worker], "node")
    assert launcher.wait(180) == 1, launcher.tail()
    assert _starts(starts) == [0, 1, 2, 3]


def _file_url(tmp_path, run_id: str) -> str:
    return (f"file://{tmp_path}/rdzv/{run_id}?min_nodes=1&max_nodes=2&last_call_timeout=0.5&keep_alive_ttl=2"
            f"&timeout=60")


@pytest.mark.agent_scenario  # over file:// and redis:// (tests/conftest.py)
@pytest.mark.parametrize("launcher", ["rdzv-run", "torchrun"])
def test_a_node_whose_check_fails_never_starts_workers_and_the_others_train(launcher, node_url, rdzv_base_url, procs,
                                                                             tmp_path) -> None:
    """``--nnodes 1:2``: node C's check fails (its last line is the reason): C never starts a worker and is shown
    unhealthy in the ledger; A trains alone and finishes; C ends non-zero once the run is closed."""
    scheme, _, endpoint = rdzv_base_url.partition("://")
    if launcher == "torchrun" and scheme != "file":
        pytest.skip("torchrun: the rdzv-file handler is enough (the check runs in the handler, the same everywhere)")
    run_id = new_run(procs)
    url = node_url(run_id, min_nodes="1", max_nodes="2")
    check = _script(tmp_path, "check.sh", "echo checking GPUs\necho GPU 3 missing\nexit 1\n")
    done = tmp_path / "done"
    out_a, out_c = str(tmp_path / "out-a"), str(tmp_path / "out-c")
    worker = [WORKER, "--wait-for", str(done)]
    if launcher == "rdzv-run":
        c = procs.start(["--rdzv", url, "--node-check", check, "--monitor-interval", "0.1", *worker, "--out", out_c],
                        "C")
    else:
        c = procs.start(["--nnodes", "1:2", "--rdzv-backend", "rdzv-file", "--rdzv-endpoint", endpoint.split("?")[0],
                         "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=0.5,keep_alive_ttl=2,join_timeout=60",
                         "--monitor-interval", "0.1", *worker, "--out", out_c], "C",
                        env={"PET_NODE_CHECK": check}, module="torch.distributed.run")
    kv = open_backend(rdzv_base_url)
    try:
        ledger = NodeLedger(kv, RunKeys("torchelastic/p2p", run_id), QuarantinePolicy())
        eventually(lambda: ledger.read("C").check, 120, "C's failing check in the ledger", c.tail)
        assert "GPU 3 missing" in ledger.read("C").check and ledger.read("C").state() == "unhealthy"
        a = procs.start(["--rdzv", url, "--monitor-interval", "0.1", *worker, "--out", out_a], "A")
        eventually(lambda: records(out_a), 120, "A's worker to start", a.tail)
        assert records(out_a)[0]["env"]["WORLD_SIZE"] == "1"
        done.touch()
        assert a.wait(60) == 0, a.tail()
        assert run_is_closed(url)
        assert c.wait(60) not in (0, None), c.tail()
        assert records(out_c) == [], "the node whose check failed started a worker"
    finally:
        kv.close()


def test_a_node_told_to_exit_on_a_failed_check_exits_at_once_and_leaves_the_run_open(procs, tmp_path) -> None:
    url = _file_url(tmp_path, new_run(procs))
    check = _script(tmp_path, "check.sh", "echo disk /ckpt: 10 MiB free\nexit 1\n")
    c = procs.start(["--rdzv", url, "--node-check", check, "--node-check-action", "exit", "--no-python", "true"], "C")
    assert c.wait(120) == 1, c.tail()
    assert "10 MiB free" in c.stderr()
    assert not run_is_closed(url)


def test_a_check_that_hangs_fails_within_its_timeout(procs, tmp_path) -> None:
    url = _file_url(tmp_path, new_run(procs))
    check = _script(tmp_path, "check.sh", "sleep 600\n")
    c = procs.start(["--rdzv", url, "--node-check", check, "--node-check-timeout", "1", "--node-check-action", "exit",
                     "--no-python", "true"], "C")
    assert c.wait(120) == 1, c.tail()
    assert "timed out" in c.stderr()


def test_the_ledgers_verdicts_are_counted_in_the_metrics() -> None:
    from rdzv_agent.reporting.prometheus_metrics import AgentMetrics
    from rdzv_agent.simple import AgentEvent

    metrics = AgentMetrics()
    for verdict in ({"first": True, "culprit": "me", "quarantined": True, "until": 1234.5},
                    {"first": False, "culprit": "lemon", "quarantined": False, "until": None},
                    {"first": False, "culprit": None, "quarantined": False, "until": None}):
        metrics.on_event(AgentEvent("attributed", "default", verdict))
    sample = metrics.registry.get_sample_value
    assert [sample("rdzv_failures_attributed_total", {"to": to}) for to in ("self", "other", "nobody")] == [1, 1, 1]
    assert sample("rdzv_node_quarantined_until_timestamp_seconds") == 0.0  # the last verdict: not quarantined
    metrics.on_event(AgentEvent("attributed", "default", {"first": True, "culprit": "me", "quarantined": True,
                                                           "until": 99.0}))
    assert sample("rdzv_node_quarantined_until_timestamp_seconds") == 99.0


def test_a_worker_stopped_by_a_signal_is_never_reported_to_the_ledger() -> None:
    """A pod deleted or a job cancelled stops the workers with SIGTERM (killed, or exiting 143 from a handler):
    not the node's own failure, so nothing is reported; a worker's own exit status is."""
    from rdzv_agent.api import WorkerFailure, WorkerSpec

    reports: list[tuple[float, str, bool]] = []

    class Handler:  # the ElasticHandler protocol, recording what is reported
        endpoints, params = (), None

        def round_version(self) -> int | None:
            return 1

        def publish_progress(self, *args: object, **kwargs: object) -> bool:
            return True

        def release(self, finished: bool = False) -> None:
            return None

        def report_failure(self, at: float, detail: str, settle: float, peer: bool = False) -> dict:
            reports.append((at, detail, peer))
            return {"culprit": "me", "first": True, "node": "me", "quarantined": False, "until": None, "why": ""}

        def node_excluded(self, name: str) -> bool:
            return False

    spec = WorkerSpec("default", 1, "prog", (), Handler(), max_restarts=1, monitor_interval=0.1)
    budget = RestartBudget(1)
    for code in (-15, 143, -9, 137, 130):
        budget.attribute(spec, {0: WorkerFailure(0, 0, code, "", timestamp=1.0)})
    assert reports == []
    budget.attribute(spec, {0: WorkerFailure(0, 0, 3, "ValueError: boom", timestamp=2.0)})
    assert [(at, peer) for at, _, peer in reports] == [(2.0, False)]
