"""LocalElasticAgent with real worker processes and a real one-node rendezvous.

The handler is rdzv's own over the server-less ``file://`` backend, and for the
layering check also torch's own c10d handler: the agent must not care which.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time
import uuid

import pytest

from tests.support.agent_workers.harness import WORKER, pid_alive

from tests.support.waiting import eventually
from rdzv_agent import LocalElasticAgent, Std, WorkerFailure, WorkerGroupFailureException, WorkerSpec
from rdzv_agent.master_address import choose_port
from rdzv_core import create_handler

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)


def file_handler(tmp_path):
    run_id = f"local{uuid.uuid4().hex[:8]}"
    return create_handler(
        f"file://{tmp_path}/rdzv/{run_id}?min_nodes=1&max_nodes=1&last_call_timeout=0.2&keep_alive_ttl=2&timeout=30"
    )


def c10d_handler(tmp_path):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{choose_port()}", run_id=f"c10d{uuid.uuid4().hex[:8]}",
        min_nodes=1, max_nodes=1, is_host=True, last_call_timeout=1, join_timeout=30,
    )
    return get_rendezvous_handler(params)


@pytest.fixture
def handler(tmp_path):
    h = file_handler(tmp_path)
    yield h
    h.shutdown()


def records(out_dir):
    """Every JSON record the workers wrote, oldest first."""
    found = []
    for path in glob.glob(os.path.join(out_dir, "*.json")):
        with open(path) as f:
            found.append((os.path.getmtime(path), json.load(f)))
    return [r for _, r in sorted(found, key=lambda x: x[0])]


def make_agent(handler, tmp_path, *worker_args, nproc=2, max_restarts=0, env=None, **kw):
    out = str(tmp_path / "out")
    spec = WorkerSpec("trainer", nproc, sys.executable, ["-u", WORKER, "--out", out, *worker_args], handler,
                      max_restarts=max_restarts, monitor_interval=0.1)
    base_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} if env is None else env
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path / "logs"), env=base_env, stop_grace=kw.pop("stop_grace", 5),
                              **kw)
    return agent, out


@pytest.mark.parametrize("kind", ["rdzv-file", "torch-c10d"])
def test_workers_get_torchrun_environment(kind, tmp_path):
    h = file_handler(tmp_path) if kind == "rdzv-file" else c10d_handler(tmp_path)
    try:
        agent, out = make_agent(h, tmp_path, max_restarts=3)
        assert agent.run() == {0: 0, 1: 0}
    finally:
        h.shutdown()
    recs = sorted(records(out), key=lambda r: int(r["RANK"]))
    assert [r["RANK"] for r in recs] == ["0", "1"]
    assert [r["LOCAL_RANK"] for r in recs] == ["0", "1"]
    for r in recs:
        assert r["ROLE_RANK"] == r["RANK"]
        assert (r["GROUP_RANK"], r["ROLE_NAME"]) == ("0", "trainer")
        sizes = (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_WORLD_SIZE"], r["ROLE_WORLD_SIZE"])
        assert sizes == ("2", "2", "1", "2")
        assert (r["TORCHELASTIC_RESTART_COUNT"], r["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "3")
        assert r["TORCHELASTIC_RUN_ID"] == h.get_run_id()
        assert r["OMP_NUM_THREADS"] == "1" and r["PYTHONUNBUFFERED"] == "1"
        assert r["TORCHELASTIC_ERROR_FILE"].startswith(agent.log_dir)
        assert r["MASTER_ADDR"] and 0 < int(r["MASTER_PORT"]) < 65536
        # torch's c10d handler shares its TCP store with the workers (use_agent_store), rdzv's does not
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == str(kind == "torch-c10d")
    assert recs[0]["MASTER_PORT"] == recs[1]["MASTER_PORT"]
    group = agent.get_worker_group()
    assert (group.group_rank, group.group_world_size) == (0, 1)
    assert agent.worker_exit_codes() == {0: (0, 0, False), 1: (1, 0, False)}


def test_omp_num_threads_is_kept_when_set(handler, tmp_path):
    agent, out = make_agent(handler, tmp_path, env={**os.environ, "OMP_NUM_THREADS": "4"})
    agent.run()
    assert {r["OMP_NUM_THREADS"] for r in records(out)} == {"4"}


def test_one_worker_gets_no_omp_default(handler, tmp_path):
    agent, out = make_agent(handler, tmp_path, nproc=1)
    agent.run()
    assert records(out)[0]["OMP_NUM_THREADS"] is None


def test_failed_group_restarts_until_it_succeeds(handler, tmp_path):
    agent, out = make_agent(handler, tmp_path, "--fail-rank", "1", "--fail-times", "2", max_restarts=2)
    assert agent.run() == {0: 0, 1: 0}
    assert agent.restart_count == 2 and agent.membership_restarts == 0
    seen = sorted(r["TORCHELASTIC_RESTART_COUNT"] for r in records(out) if r["RANK"] == "1")
    assert seen == ["0", "1", "2"]
    assert sorted(os.listdir(agent.log_dir)) == ["attempt_0", "attempt_1", "attempt_2"]


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_gives_up_after_max_restarts_with_per_rank_failures(handler, tmp_path, max_restarts):
    agent, out = make_agent(handler, tmp_path, "--fail-rank", "1", "--message", "disk on fire",
                            max_restarts=max_restarts)
    with pytest.raises(WorkerGroupFailureException) as info:
        agent.run()
    failures = info.value.get_worker_exceptions()
    assert list(failures) == [1]
    failure = failures[1]
    assert isinstance(failure, WorkerFailure)
    assert (failure.global_rank, failure.local_rank, failure.exit_code) == (1, 1, 1)
    assert failure.error == "RuntimeError: disk on fire"
    with open(failure.log_path) as f:
        assert "Traceback" in f.read()
    assert len([r for r in records(out) if r["RANK"] == "1"]) == max_restarts + 1
    assert agent.restart_count == max_restarts


def test_exit_code_and_stderr_lines_without_traceback(handler, tmp_path):
    agent, _ = make_agent(handler, tmp_path, "--fail-rank", "0", "--exit-code", "7", "--message", "bad input")
    with pytest.raises(WorkerGroupFailureException) as info:
        agent.run()
    failure = info.value.get_worker_exceptions()[0]
    assert failure.exit_code == 7 and failure.error == "worker rank 0: bad input"


def test_any_executable_and_torchelastic_error_file(handler, tmp_path):
    script = (
        'printf \'{"message": {"message": "from the error file\\\\nsecond line"}}\' > "$TORCHELASTIC_ERROR_FILE"; '
        "echo noise >&2; exit 4"
    )
    spec = WorkerSpec("sh", 1, "/bin/sh", ["-c", script], handler, max_restarts=0, monitor_interval=0.1)
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path / "logs"))
    with pytest.raises(WorkerGroupFailureException) as info:
        agent.run()
    failure = info.value.get_worker_exceptions()[0]
    assert failure.exit_code == 4
    assert failure.error == "from the error file\nsecond line"


def test_missing_program_raises_oserror(handler, tmp_path):
    spec = WorkerSpec("x", 2, str(tmp_path / "no-such-program"), [], handler, max_restarts=3, monitor_interval=0.1)
    with pytest.raises(OSError):
        LocalElasticAgent(spec, log_dir=str(tmp_path / "logs")).run()


def test_stop_kills_the_process_tree_and_sigterm_ignorers(handler, tmp_path):
    never = str(tmp_path / "never")
    agent, out = make_agent(handler, tmp_path, "--child", "--ignore-sigterm", "--wait-for", never,
                            "--fail-rank", "1", stop_grace=1.0)
    started = time.monotonic()
    with pytest.raises(WorkerGroupFailureException):
        agent.run()
    assert time.monotonic() - started < 30
    recs = records(out)
    assert len(recs) == 2
    pids = [r["pid"] for r in recs] + [r["child_pid"] for r in recs]
    eventually(lambda: not any(pid_alive(p) for p in pids), 10, "workers and their children to be gone")
    codes = agent.worker_exit_codes()
    assert codes[1] == (1, 1, False)
    assert codes[0] == (0, -signal.SIGKILL, True)  # ignored SIGTERM: killed after the grace period


def test_only_workers_killed_by_the_agents_signal_count_as_stopped_by_the_agent(handler, tmp_path):
    """Rank 1 fails; the agent stops ranks 0 and 2. Rank 0 exits with its own code 5 while the
    agent's SIGTERM is pending (blocked): it ended on its own. Rank 2 dies of the SIGTERM."""
    agent, _ = make_agent(handler, tmp_path, "--fail-rank", "1", "--exit-code", "3", "--sigterm-race-rank", "0",
                          "--wait-for", str(tmp_path / "never"), nproc=3)
    with pytest.raises(WorkerGroupFailureException) as info:
        agent.run()
    assert list(info.value.get_worker_exceptions()) == [1]
    assert agent.worker_exit_codes() == {0: (0, 5, False), 1: (1, 3, False), 2: (2, -signal.SIGTERM, True)}


def test_a_traceback_with_torchs_rank_prefix_is_the_error(handler, tmp_path):
    """After init_process_group, torch prefixes every traceback line with ``[rankN]:``."""
    marker = f"boom-{uuid.uuid4().hex[:8]}"
    agent, out = make_agent(handler, tmp_path, "--allreduce", "--fail-rank", "1", "--message", marker)
    with pytest.raises(WorkerGroupFailureException) as info:
        agent.run()
    failure = info.value.get_worker_exceptions()[1]
    # 1 from the uncaught exception, or SIGABRT when gloo's destructor aborts at exit (torch 2.13 does, sometimes)
    assert failure.exit_code in (1, -signal.SIGABRT)
    assert failure.error == f"RuntimeError: {marker}"
    with open(failure.log_path) as f:
        assert f"[rank1]: RuntimeError: {marker}" in f.read()  # the prefix was there to be read past
    assert {r["RANK"]: r.get("allreduce") for r in records(out) if "allreduce" in r} == {"0": 3, "1": 3}


def test_port_taken_at_startup_is_retried_without_a_restart(handler, tmp_path):
    agent, out = make_agent(handler, tmp_path, "--steal-master-port", nproc=1, max_restarts=0)
    assert agent.run() == {0: 0}
    recs = records(out)
    assert len(recs) == 2
    assert recs[0]["MASTER_PORT"] != recs[1]["MASTER_PORT"]
    assert agent.restart_count == 0
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in recs} == {"0"}


def test_redirects_and_tee(handler, tmp_path, capfd):
    agent, _ = make_agent(handler, tmp_path, "--print", "hello-out", nproc=2,
                          redirects={0: Std.ALL}, tee={1: Std.OUT})
    agent.run()
    attempt = agent.attempt_log_dir()
    with open(os.path.join(attempt, "0", "stdout.log")) as f:
        assert f.read() == "hello-out\n"
    with open(os.path.join(attempt, "1", "stdout.log")) as f:
        assert f.read() == "hello-out\n"
    for rank in ("0", "1"):
        with open(os.path.join(attempt, rank, "stderr.log")) as f:
            assert f.read() == "err:hello-out\n"
    captured = capfd.readouterr()
    assert "[trainer1]:hello-out" in captured.out  # teed, prefixed
    assert "[trainer1]:err:hello-out" in captured.err  # stderr is teed by default
    assert "[trainer0]" not in captured.out + captured.err  # rank 0 redirected: files only


def test_a_round_without_master_endpoint_is_formed_again(tmp_path):
    """Group rank 0 vanishes right after the round formed, before publishing MASTER_ADDR/PORT."""
    import threading

    from rdzv_agent import AgentEvent

    url = f"file://{tmp_path}/rdzv/gone{uuid.uuid4().hex[:8]}?min_nodes=1&max_nodes=2&last_call_timeout=1&keep_alive_ttl=2"
    joined = threading.Event()
    ghost = create_handler(url, on_progress=lambda p: joined.set() if p.joined >= 1 else None)
    formed: list = []

    def ghost_node() -> None:  # joins first (rank 0), then leaves without publishing anything
        formed.append(ghost.next_rendezvous())
        ghost.release()  # leaves; shutdown() would close the run under the other node

    thread = threading.Thread(target=ghost_node, daemon=True)
    thread.start()
    eventually(joined.is_set, 30, "the ghost node to join")

    handler = create_handler(url, store_timeout=1)
    events: list[AgentEvent] = []
    try:
        out = str(tmp_path / "out")
        spec = WorkerSpec("trainer", 1, sys.executable, ["-u", WORKER, "--out", out], handler, max_restarts=0,
                          monitor_interval=0.1)
        agent = LocalElasticAgent(spec, log_dir=str(tmp_path / "logs"), listener=events.append)
        assert agent.run() == {0: 0}
    finally:
        handler.shutdown()
        thread.join(10)
    assert formed and formed[0].rank == 0 and formed[0].world_size == 2
    # the agent re-formed once without spending a restart: after the store timeout (no_master) or, as the
    # ghost's leave deleted its keep-alive key, because the round's watch destroyed the round (membership)
    assert [e.data["reason"] for e in events if e.kind == "restarting"] in (["no_master"], ["membership"])
    assert agent.restart_count == 0 and agent.get_worker_group().group_world_size == 1


def test_a_worker_that_fails_while_num_nodes_waiting_is_asked_is_a_failure(handler, tmp_path):
    """A worker dies of its own while the agent asks ``num_nodes_waiting()`` and another node waits:
    the failure counts (a restart spent), not a membership change (a fresh-user trial saw nodes
    whose own workers crashed book a membership change because a peer had already re-joined)."""
    gate = str(tmp_path / "gate")
    agent, out = make_agent(handler, tmp_path, "--wait-for", gate, nproc=1, max_restarts=1)
    asked = handler.num_nodes_waiting
    fired: list[int] = []

    def num_nodes_waiting() -> int:
        first = records(out)
        if fired or not first:
            return asked()
        fired.append(first[0]["pid"])
        os.kill(fired[0], signal.SIGKILL)  # not the agent's signal: the worker died of its own
        eventually(lambda: not pid_alive(fired[0]), 30, "the worker to die")
        open(gate, "w").close()  # the next attempt finishes
        return 1  # ... and a node waits to join

    handler.num_nodes_waiting = num_nodes_waiting
    assert agent.run() == {0: 0}
    assert fired, "the worker never ran"
    assert (agent.restart_count, agent.membership_restarts) == (1, 0)
