"""torch elastic's events, metrics and error files under real ``rdzv-run`` launchers (and torchrun for comparison).

Events are parsed as torch's ``Event``/``RdzvEvent`` JSON; metrics are what a torch
``MetricHandler`` receives; error files are parsed as JSON. The backend is the
conformance plugin's ``--rdzv-url`` (``memory://`` skipped: launchers are processes).
"""

from __future__ import annotations

import json
import textwrap
import time
import uuid

import pytest

from tests.support.agent_workers.harness import Launcher, kill_run
from rdzv_core import create_handler

pytest.importorskip("torch")

from torch.distributed.elastic.events.api import Event, EventSource, NodeState, RdzvEvent  # noqa: E402

pytestmark = [pytest.mark.agent_scenario, pytest.mark.launchers]  # over file:// and redis:// only (tests/conftest.py)


#: rank FAIL_RANK raises (with torch's @record) while TORCHELASTIC_RESTART_COUNT < FAIL_TIMES (KILL=1: SIGKILLs
#: itself instead); the other ranks then sleep until the agent stops them; with no failure left, all exit 0
#: (with WAIT_FOR_EVENT=TEXT: once TEXT is in the launcher's EVENTS_FILE).
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        fail_rank, fail_times = int(os.environ["FAIL_RANK"]), int(os.environ.get("FAIL_TIMES", "99"))
        if rank == fail_rank and restart < fail_times:
            if os.environ.get("KILL") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"{os.environ['MARKER']} rank {rank}")
        if restart < fail_times and fail_rank >= 0:
            time.sleep(30)  # stopped by the agent when the failing rank fails
        wanted, deadline = os.environ.get("WAIT_FOR_EVENT"), time.monotonic() + 60
        while wanted and time.monotonic() < deadline:  # until the launcher recorded that event
            with open(os.environ["EVENTS_FILE"]) as f:
                if wanted in f.read():
                    break
            time.sleep(0.05)
    main()
    """
)

#: ``recmetrics.Recorder``: a torch ``MetricHandler`` appending ``[group, name, value]`` lines to ``METRICS_FILE``.
RECORDER = textwrap.dedent(
    """
    import json, os
    from torch.distributed.elastic import metrics

    class Recorder(metrics.MetricHandler):
        def emit(self, data):
            with open(os.environ["METRICS_FILE"], "a") as f:
                f.write(json.dumps([data.group_name, data.name, data.value]) + "\\n")
    """
)

#: ``python -m telwrap TOOL ARGS``: registers a file handler the torch way (``events.handlers._log_handlers``:
#: as "dynamic_rendezvous" and "jsonfile"), optionally ``metrics.configure(Recorder(), "torchelastic")``, then
#: runs ``rdzv-run`` (``rdzv_agent.launch.launcher.main``) or torchrun (``torch.distributed.run.main``) in-process.
WRAPPER = textwrap.dedent(
    """
    import logging, os, sys
    from torch.distributed.elastic.events import handlers
    from torch.distributed.elastic import metrics
    from recmetrics import Recorder

    handler = logging.FileHandler(os.environ["EVENTS_FILE"])
    handlers._log_handlers["dynamic_rendezvous"] = handler
    handlers._log_handlers["jsonfile"] = handler
    if os.environ.get("CONFIGURE_METRICS") == "1":
        metrics.configure(Recorder(), "torchelastic")
    if sys.argv[1] == "torchrun":
        from torch.distributed.run import main
        main(sys.argv[2:])
    else:
        from rdzv_agent.launch.launcher import main
        sys.exit(main(sys.argv[2:]))
    """
)


@pytest.fixture
def job(tmp_path):
    """``job.start(argv, name, env)``: a launcher (``rdzv-run`` or, with ``tool="torchrun"``, torchrun) through
    :data:`WRAPPER`; ``job.events(name)``, ``job.metrics(name)``; everything killed at teardown."""

    class Job:
        def __init__(self):
            self.launchers, self.run_ids = [], []
            (tmp_path / "script.py").write_text(SCRIPT)
            (tmp_path / "telwrap.py").write_text(WRAPPER)
            (tmp_path / "recmetrics.py").write_text(RECORDER)
            self.marker = f"M{uuid.uuid4().hex[:8]}"

        def run_id(self):
            rid = f"tel{uuid.uuid4().hex[:10]}"
            self.run_ids.append(rid)
            return rid

        def start(self, argv, name, env=None, tool="rdzv-run"):
            full = {"EVENTS_FILE": str(tmp_path / f"{name}.events"), "METRICS_FILE": str(tmp_path / f"{name}.metrics"),
                    "MARKER": self.marker, "FAIL_RANK": "-1", "PYTHONPATH": str(tmp_path), **(env or {})}
            launcher = Launcher([tool, *argv, str(tmp_path / "script.py")], str(tmp_path), name, env=full,
                                module="telwrap")
            self.launchers.append(launcher)
            return launcher

        def lines(self, name, suffix):
            path = tmp_path / f"{name}.{suffix}"
            return path.read_text().splitlines() if path.exists() else []

        def events(self, name):
            return [Event.deserialize(line) for line in self.lines(name, "events") if '"source"' in line]

        def rdzv_events(self, name):
            return [RdzvEvent.deserialize(line) for line in self.lines(name, "events") if '"node_state"' in line]

        def metrics(self, name):
            return [tuple(json.loads(line)) for line in self.lines(name, "metrics")]

    j = Job()
    yield j
    kill_run(j.launchers, j.run_ids)


# ------------------------------------------------------------------------------------------------- events


@pytest.mark.slow
def test_console_events_are_torchs_at_torchs_points(job, node_url):
    """--event-log-handler console: the agent's Events on stderr, torch's names, states, ranks and run id."""
    run_id = job.run_id()
    launcher = job.start(["--rdzv", node_url(run_id), "--nproc-per-node", "2", "--max-restarts", "1",
                          "--monitor-interval", "0.1", "--event-log-handler", "console"], "node",
                         env={"FAIL_RANK": "1", "FAIL_TIMES": "1"})
    assert launcher.wait(120) == 0, launcher.tail()
    evs = [Event.deserialize(ln) for ln in launcher.stderr().splitlines() if ln.startswith('{"name": "torchelastic.')]
    states = [(e.source, e.metadata["state"], e.metadata["global_rank"]) for e in evs]
    agent, worker = EventSource.AGENT, EventSource.WORKER
    one_round = [(agent, "RENDEZVOUS", None), (agent, "ASSIGN_WORKER_RANKS", None),
                 (worker, "START", 0), (worker, "START", 1)]
    assert states == one_round * 2 + [(worker, "SUCCEEDED", 0), (worker, "SUCCEEDED", 1), (agent, "SUCCEEDED", None)]
    assert all(e.name == f"torchelastic.worker.status.{e.metadata['state']}" for e in evs)
    assert {e.metadata["run_id"] for e in evs} == {run_id}
    assert {e.metadata["role"] for e in evs} == {"default"}
    assert all(isinstance(e.metadata["duration_ms"], float) for e in evs if e.metadata["state"] == "RENDEZVOUS")
    starts = [e for e in evs if e.metadata["state"] == "START"]
    assert [e.metadata["agent_restarts"] for e in starts] == [0, 0, 1, 1]
    md = json.loads(starts[-1].metadata["metadata"])
    assert md["local_rank"] == [1] and md["role_world_size"] == [2] and md["group_world_size"] == 1
    assert int(str(starts[-1].metadata["worker_id"])) > 0  # the worker's pid


@pytest.mark.slow
def test_failed_worker_event_carries_its_error_file(job, node_url):
    """No restarts left: the failed worker's FAILED event holds its error file and exit code, the other is
    TERMINATED (stopped by the agent), and the agent's event is SUCCEEDED (torch's launch_agent: run() ended)."""
    job.start(["--rdzv", node_url(job.run_id()), "--nproc-per-node", "2", "--monitor-interval", "0.1",
               "--event-log-handler", "jsonfile"], "node", env={"FAIL_RANK": "1"}).wait(120)
    evs = job.events("node")
    final = {(e.metadata["state"], e.metadata["global_rank"]): e for e in evs[-3:]}
    assert set(final) == {("FAILED", 1), ("TERMINATED", 0), ("SUCCEEDED", None)}
    failed = final[("FAILED", 1)]
    assert json.loads(str(failed.metadata["raw_error"]))["message"]["message"] == f"ValueError: {job.marker} rank 1"
    assert json.loads(str(failed.metadata["metadata"]))["exit_code"] == [1]
    assert final[("SUCCEEDED", None)].source == EventSource.AGENT


def test_unknown_event_log_handler_is_a_usage_error(tmp_path):
    """Only names registered in torch's events.handlers; torchrun fails only at the first event (KeyError)."""
    from rdzv_agent.launch.args import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--event-log-handler", "nosuch", "--standalone", "x.py"])
    assert info.value.code == 2
    assert parse_args(["--event-log-handler", "console", "--standalone", "x.py"]).event_log_handler == "console"


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["rdzv-run", "torchrun"])
def test_rendezvous_events_from_the_handler(job, node_url, rdzv_base_url, tool):
    """A handler registered as torch's "dynamic_rendezvous" gets the rdzv handler's RdzvEvents, under both."""
    run_id = job.run_id()
    url = node_url(run_id)
    if tool == "rdzv-run":
        argv = ["--rdzv", url]
    else:
        scheme = rdzv_base_url.split("://")[0]
        if scheme != "file":
            pytest.skip("torchrun: the rdzv-file handler is enough here (others: tests/torchrun/test_torchrun.py)")
        endpoint = rdzv_base_url.split("://", 1)[1].split("?")[0]
        argv = ["--rdzv-backend", "rdzv-file", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--rdzv-conf", "last_call_timeout=0.5,keep_alive_ttl=2,join_timeout=60"]
    beat = "handler.py:RdzvHandler._keep_alive"
    launcher = job.start([*argv, "--nnodes", "1", "--nproc-per-node", "1", "--monitor-interval", "0.1"], "node",
                         tool=tool, env={"WAIT_FOR_EVENT": beat})
    assert launcher.wait(120) == 0, launcher.tail()
    evs = job.rdzv_events("node")
    seen = [(e.name, e.node_state, e.rank) for e in evs]
    beats = [i for i, e in enumerate(evs) if e.name == beat]
    assert beats and all(evs[i].node_state == NodeState.RUNNING for i in beats), seen
    assert [s for i, s in enumerate(seen) if i not in beats] == [
        ("handler.py:RdzvHandler.next_rendezvous", NodeState.RUNNING, None),
        ("handler.py:RdzvHandler.next_rendezvous", NodeState.RUNNING, 0),
        ("handler.py:RdzvHandler.shutdown", NodeState.SUCCEEDED, None),
    ], seen
    # while a member: from its keep-alive key (written while next_rendezvous confirms, so a beat may come before
    # next_rendezvous returns on a loaded host), until the end
    assert 0 < beats[0] and beats[-1] < len(evs) - 1
    assert {e.run_id for e in evs} == {run_id}
    assert {e.pid for e in evs} == {launcher.pid}
    joined = [e for e in evs if e.name == "handler.py:RdzvHandler.next_rendezvous" and e.rank == 0]
    assert len(joined) == 1 and joined[0].master_endpoint.rsplit(":", 1)[1].isdigit(), seen


# ------------------------------------------------------------------------------------------------- metrics


#: What torch's agent puts (``agent/server/api.py``, ``local_elastic_agent.py``) for a job that fails once.
TORCH_METRICS = {
    "workers.default.remaining_restarts", "workers.default.healthy", "workers.default.failed",
    "workers.default.succeeded", "workers.default.flakiness", "workers.default.run_total",
    "workers.default.run_success_with_retries", "workers.default.run_success_no_retries",
    "workers.default.run_failed_with_retries", "workers.default.run_failed_no_retries",
    *(f"{fn}.{what}" for fn in ("SimpleElasticAgent._rendezvous", "SimpleElasticAgent._assign_worker_ranks",
                                "SimpleElasticAgent._initialize_workers", "SimpleElasticAgent._restart_workers",
                                "SimpleElasticAgent.run", "LocalElasticAgent._start_workers",
                                "LocalElasticAgent._stop_workers", "LocalElasticAgent._monitor_workers")
      for what in ("success", "duration.ms")),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["metrics.configure", "--metrics-handler"])
def test_metrics_handler_sees_torchs_names(job, node_url, how, tmp_path):
    """One failure, one restart, success: the handler gets torch's names and values in group torchelastic
    (and the launcher writes no error file: it succeeded)."""
    flag = ["--metrics-handler", "recmetrics:Recorder"] if how == "--metrics-handler" else []
    error_file = tmp_path / "launcher-error.json"
    env = {"FAIL_RANK": "1", "FAIL_TIMES": "1", "CONFIGURE_METRICS": "1" if how == "metrics.configure" else "0",
           "TORCHELASTIC_ERROR_FILE": str(error_file)}
    launcher = job.start(["--rdzv", node_url(job.run_id()), "--nproc-per-node", "2", "--max-restarts", "1",
                          "--monitor-interval", "0.1", *flag], "node", env=env)
    assert launcher.wait(120) == 0, launcher.tail()
    got = job.metrics("node")
    assert {g for g, _, _ in got} == {"torchelastic"}
    last = {name: value for _, name, value in got}
    assert set(last) == TORCH_METRICS, set(last) ^ TORCH_METRICS
    assert last["workers.default.run_success_with_retries"] == 1 and last["workers.default.run_total"] == 1
    assert last["workers.default.run_success_no_retries"] == last["workers.default.run_failed_with_retries"] == 0
    assert last["workers.default.flakiness"] == 50  # torch: 100 - 100 * (remaining + 1) / (max_restarts + 1)
    remaining = [v for _, n, v in got if n == "workers.default.remaining_restarts"]
    assert remaining[0] == 1 and remaining[-1] == 0
    assert [v for _, n, v in got if n == "SimpleElasticAgent._rendezvous.success"] == [1, 1]
    assert all(isinstance(v, int) and v >= 0 for _, n, v in got if n.endswith(".duration.ms"))
    assert not error_file.exists()


@pytest.mark.slow
def test_metric_names_match_torchrun(job, tmp_path):
    """The same job under torchrun (torch's agent, metrics.configure) and rdzv-run: the same metric names."""
    env = {"FAIL_RANK": "1", "FAIL_TIMES": "1", "CONFIGURE_METRICS": "1"}
    common = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1"]
    ours = job.start(common, "ours", env=env)
    theirs = job.start(common, "theirs", env=env, tool="torchrun")
    assert ours.wait(120) == 0, ours.tail()
    assert theirs.wait(120) == 0, theirs.tail()
    assert {n for _, n, _ in job.metrics("ours")} == {n for _, n, _ in job.metrics("theirs")}


def test_bad_metrics_handler_is_a_usage_error():
    from torch.distributed.elastic import metrics

    from rdzv_agent.launch.args import parse_args

    args = parse_args(["--metrics-handler", "console", "--standalone", "x.py"])
    assert isinstance(args.metrics_handler, metrics.ConsoleMetricHandler)

    for bad in ("nosuchmodule:X", "json:nosuchattr", "json:dumps", "console2"):
        with pytest.raises(SystemExit) as info:
            parse_args(["--metrics-handler", bad, "--standalone", "x.py"])
        assert info.value.code == 2, bad


# ------------------------------------------------------------------------------------------------- error files


def _summary(launcher) -> str:
    err = launcher.stderr()
    return err[err.rindex("rdzv-run summary"):]


def _root_cause(summary: str) -> str:
    return summary[summary.index("Root Cause"):]


@pytest.mark.slow
def test_launcher_error_file_and_summary_name_the_root_cause_like_torchrun(job, tmp_path):
    """A worker fails with @record: the launcher's TORCHELASTIC_ERROR_FILE is torchrun's (the worker's file with
    errorCode) plus the rank; the summary's root cause block names rank, local rank, exit code and the error."""
    files = {name: tmp_path / f"{name}-error.json" for name in ("ours", "theirs")}
    common = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1"]
    ours = job.start(common, "ours", env={"FAIL_RANK": "1", "TORCHELASTIC_ERROR_FILE": str(files["ours"])})
    theirs = job.start(common, "theirs", env={"FAIL_RANK": "1", "TORCHELASTIC_ERROR_FILE": str(files["theirs"])},
                       tool="torchrun")
    before = int(time.time())
    assert ours.wait(120) == 1, ours.tail()
    assert theirs.wait(120) == 1, theirs.tail()
    mine, torchs = (json.loads(files[n].read_text()) for n in ("ours", "theirs"))
    assert mine["message"]["message"] == torchs["message"]["message"] == f"ValueError: {job.marker} rank 1"
    assert mine["message"]["errorCode"] == torchs["message"]["errorCode"] == 1
    assert set(torchs["message"]) <= set(mine["message"])
    assert set(torchs["message"]["extraInfo"]) <= set(mine["message"]["extraInfo"])
    extra = mine["message"]["extraInfo"]
    assert extra["rank"] == 1 and extra["local_rank"] == 1 and extra["hostname"]
    assert extra["py_callstack"].rstrip().endswith(f"ValueError: {job.marker} rank 1")
    assert before - 60 <= int(extra["timestamp"]) <= time.time() + 1
    root = _root_cause(_summary(ours))
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1" in root
    assert f"ValueError: {job.marker} rank 1" in root and "error.json" in root


def test_root_cause_is_the_first_to_exit_not_the_lowest_rank(tmp_path, monkeypatch):
    """Two error files written by torch's ErrorHandler with the same whole-second timestamp; rank 1 exited
    first. torch's ChildFailedError picks rank 0 (ties go to rank order); the summary and the launcher's file
    name rank 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure

    from rdzv_agent.api import WorkerFailure
    from rdzv_agent.reporting.error_files import launcher_error_data, root_cause_text

    files = {}
    for rank in (0, 1):
        files[rank] = tmp_path / f"{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[rank]))
        try:
            raise ValueError(f"rank {rank} failed")
        except ValueError as exc:
            ErrorHandler().record_exception(exc)
        data = json.loads(files[rank].read_text())
        data["message"]["extraInfo"]["timestamp"] = "1700000000"
        files[rank].write_text(json.dumps(data))
    now = time.time()
    failures = [WorkerFailure(1, 1, 1, pid=11, error_file=str(files[1]), timestamp=now),
                WorkerFailure(0, 0, 1, pid=10, error_file=str(files[0]), timestamp=now + 0.3)]
    torchs = ChildFailedError("x", {r: ProcessFailure(r, 10 + r, 1, str(files[r])) for r in (0, 1)})
    assert torchs.get_first_failure()[0] == 0
    text = root_cause_text(failures, "x")
    root = text[text.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root and "ValueError: rank 1 failed" in root
    assert "ValueError: rank 0 failed" in text[:text.index("Root Cause")]
    data = launcher_error_data(failures, None)
    assert data["message"]["message"] == "ValueError: rank 1 failed" and data["message"]["extraInfo"]["rank"] == 1


@pytest.mark.slow
def test_killed_worker_without_error_file_still_gives_the_launcher_one(job, node_url, tmp_path):
    """A worker killed by SIGKILL writes no error file; torchrun then writes none for itself. rdzv-run writes one
    in torch's shape: errorCode -9, the rank, and the summary's root cause names the signal."""
    error_file = tmp_path / "launcher-error.json"
    launcher = job.start(["--rdzv", node_url(job.run_id()), "--nproc-per-node", "2", "--monitor-interval", "0.1"],
                         "node", env={"FAIL_RANK": "1", "KILL": "1", "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert launcher.wait(120) == 1, launcher.tail()
    data = json.loads(error_file.read_text())
    assert data["message"]["errorCode"] == -9
    assert "SIGKILL" in data["message"]["message"]
    assert data["message"]["extraInfo"]["rank"] == 1 and int(data["message"]["extraInfo"]["timestamp"]) > 0
    root = _root_cause(_summary(launcher))
    assert "exitcode  : -9" in root and "(SIGKILL)" in root and "error_file: <N/A>" in root


@pytest.mark.slow
def test_rendezvous_failure_error_file_is_torchs_record_exception(job, node_url, tmp_path):
    """No worker failed (the run is closed): the file holds the launcher's exception, as torch's @record main."""
    run_id = job.run_id()
    url = node_url(run_id)
    handler = create_handler(url)
    handler.set_closed()
    handler.release()
    error_file = tmp_path / "launcher-error.json"
    launcher = job.start(["--rdzv", url, "--nproc-per-node", "1"], "node",
                         env={"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert launcher.wait(60) == 1, launcher.tail()
    message = json.loads(error_file.read_text())["message"]
    assert message["message"].startswith("RendezvousClosedError")
    assert "Traceback" in message["extraInfo"]["py_callstack"] and int(message["extraInfo"]["timestamp"]) > 0
    failed = [e for e in job.rdzv_events("node") if e.node_state == NodeState.FAILED]  # torch's handler records it
    assert [e.name for e in failed] == ["handler.py:RdzvHandler.next_rendezvous"], failed
    assert failed[0].message.startswith("RendezvousClosedError") and "Traceback" in failed[0].error_trace
