"""``rdzv-run`` as a person runs it: real launcher processes, real workers, a real backend.

The backend is a parameter (the conformance plugin's ``--rdzv-url``; by
default ``file://``); ``memory://`` is skipped because it lives in one process.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.support.agent_workers.harness import HERE, WORKER, pid_alive

from tests.support.waiting import eventually
from tests.support.launch_runs import new_run, records, run_is_closed
from rdzv_agent.launch import args as launch_args
from rdzv_agent.launch import config as launch_config
from rdzv_agent.launch.launcher import main
from rdzv_agent.master_address import choose_port
from rdzv_core.outage import LATEST_JUDGEMENT

pytestmark = [pytest.mark.agent_scenario, pytest.mark.launchers]  # over file:// and redis:// only (tests/conftest.py)

def test_failing_worker_exhausts_restarts_and_summary_names_rank_and_error(node_url, procs, tmp_path):
    run_id = new_run(procs)
    out = str(tmp_path / "out")
    marker = f"ERR_{uuid.uuid4().hex[:8]}"
    url = node_url(run_id)
    launcher = procs.start(
        ["--rdzv", url, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "2",
         "--monitor-interval", "0.1", WORKER, "--out", out, "--fail-rank", "1", "--message", marker],
        "node",
    )
    assert launcher.wait(120) == 1, launcher.tail()
    assert len([r for r in records(out) if r["RANK"] == "1"]) == 3, launcher.tail()  # first run + 2 restarts
    err = launcher.stderr()
    summary = err[err.rindex("rdzv-run summary"):]
    assert marker in summary and "rank 1" in summary
    assert run_is_closed(url)  # as with torchrun: the failed job ends everywhere (shutdown() closes the run)


def test_standalone_module_with_two_workers(procs, tmp_path):
    out = str(tmp_path / "out")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    launcher = procs.start(
        ["--standalone", "--nproc_per_node", "2", "--monitor-interval", "0.1", "-m", "agent_workers.worker",
         "--out", out],
        "node", env={"PYTHONPATH": os.path.dirname(HERE), "TMPDIR": str(tmpdir)},
    )
    assert launcher.wait(120) == 0, launcher.tail()
    recs = records(out)
    assert sorted(r["RANK"] for r in recs) == ["0", "1"]
    assert all(r["TORCHELASTIC_RUN_ID"].startswith("standalone-") for r in recs)
    assert not glob.glob(str(tmpdir / "rdzv-standalone-*"))  # the rendezvous directory is removed


def test_no_python_runs_any_executable(procs, tmp_path):
    out = tmp_path / "ranks"
    launcher = procs.start(
        ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", "--no-python",
         "/bin/sh", "-c", f'echo "$RANK/$WORLD_SIZE" >> {out}'],
        "node",
    )
    assert launcher.wait(120) == 0, launcher.tail()
    assert sorted(out.read_text().split()) == ["0/2", "1/2"]


def test_the_url_password_reaches_no_worker_log_or_output(procs, tmp_path, rdzv_server_redis):
    # A real Redis whose default user has no password accepts any password for it (AUTH default <any>):
    # the URL carries a secret end to end without configuring server auth.
    secret = f"pw{uuid.uuid4().hex[:12]}"
    run_id = new_run(procs)
    url = f"redis://default:{secret}@{rdzv_server_redis.address}/{run_id}?last_call_timeout=0.5"
    out = str(tmp_path / "out")
    logs = str(tmp_path / "logs")
    args = ["--nproc-per-node", "2", "--monitor-interval", "0.1", "--log-dir", logs, "--tee", "3",
            WORKER, "--out", out, "--print", "hello"]
    via_env = procs.start(args, "env", env={"RDZV_URL": url, "MY_BACKEND": f"etcd://u:{secret}@h:1"})
    assert via_env.wait(120) == 0, via_env.tail()
    gate = str(tmp_path / "gate")
    via_argv = procs.start(["--rdzv", url.replace(run_id, run_id + "b"), *args, "--wait-for", gate], "argv")
    eventually(lambda: len(records(out)) == 4, 120, "the second launcher's workers", via_argv.tail)
    cmdline = " ".join(psutil.Process(via_argv.pid).cmdline())
    assert secret not in cmdline and "--rdzv" not in cmdline  # the launcher took it off its command line
    open(gate, "w").close()
    assert via_argv.wait(120) == 0, via_argv.tail()

    recs = records(out)
    assert len(recs) == 4
    for rec in recs:
        assert secret not in json.dumps(rec["env"])
        assert "MY_BACKEND" not in rec["env"] and "RDZV_URL" not in rec["env"]
    for launcher in (via_env, via_argv):
        assert secret not in launcher.stdout() + launcher.stderr()
        assert "hello" in launcher.stdout()
    for root, _, files in os.walk(logs):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert secret.encode() not in f.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_stops_workers_and_leaves_the_run_open(node_url, procs, tmp_path, sig):
    run_id = new_run(procs)
    url = node_url(run_id, min_nodes="1", max_nodes="2")
    out = str(tmp_path / "out")
    launcher = procs.start(
        ["--rdzv", url, "--monitor-interval", "0.1", WORKER, "--out", out, "--child", "--wait-for",
         str(tmp_path / "never")],
        "node",
    )
    rec = eventually(lambda: records(out), 120, "the worker to start", launcher.tail)[0]
    os.kill(launcher.pid, sig)
    assert launcher.wait(60) == 128 + sig, launcher.tail()
    eventually(lambda: not pid_alive(rec["pid"]) and not pid_alive(rec["child_pid"]), 30,
               "the worker and its child to be gone",
               lambda: f"worker alive={pid_alive(rec['pid'])} child alive={pid_alive(rec['child_pid'])}\n"
                       + launcher.tail())

    assert not run_is_closed(url)  # release(), not shutdown(): as torchrun after a signal
    if sig == signal.SIGTERM:  # the run is still usable: a new node forms a round and finishes
        again = procs.start(["--rdzv", url, "--monitor-interval", "0.1", WORKER, "--out", out], "again")
        assert again.wait(120) == 0, again.tail()


def test_workers_die_when_the_launcher_is_killed_with_sigkill(procs, tmp_path):
    """PR_SET_PDEATHSIG: nothing can stop the workers for a SIGKILLed launcher, so the kernel does."""
    out = str(tmp_path / "out")
    launcher = procs.start(["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", WORKER,
                            "--out", out, "--ignore-sigterm", "--wait-for", str(tmp_path / "never")], "node")
    recs = eventually(lambda: len(records(out)) == 2 and records(out), 120, "both workers to start", launcher.tail)
    pids = [r["pid"] for r in recs]
    assert all(pid_alive(p) for p in pids)
    assert set(pids) <= set(launcher.descendants())  # remembered: teardown kills them if this test fails
    os.kill(launcher.pid, signal.SIGKILL)
    assert launcher.wait(30) == -signal.SIGKILL
    eventually(lambda: not any(pid_alive(p) for p in pids), 30, "the workers to die with their launcher",
               lambda: f"alive: {[p for p in pids if pid_alive(p)]}")


def test_static_rendezvous_two_nodes_share_node_rank_0s_store(procs, tmp_path):
    """torchrun's static mode: fixed node ranks; the workers get --master-addr/--master-port and
    reuse node rank 0's store (TORCHELASTIC_USE_AGENT_STORE) for their own process group."""
    port = choose_port()
    out = str(tmp_path / "out")
    nodes = [
        procs.start(["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port",
                     str(port), "--monitor-interval", "0.1", "--rdzv-conf", "timeout=120", WORKER, "--out", out,
                     "--allreduce"], f"node{rank}")
        for rank in (1, 0)  # rank 1 first: it waits for node rank 0's store
    ]
    for node in nodes:
        assert node.wait(240) == 0, node.tail()
    recs = {r["RANK"]: r for r in records(out)}
    assert sorted(recs) == ["0", "1"]
    for rank, r in recs.items():
        assert (r["GROUP_RANK"], r["WORLD_SIZE"], r["GROUP_WORLD_SIZE"]) == (rank, "2", "2")
        assert (r["MASTER_ADDR"], r["MASTER_PORT"], r["TORCHELASTIC_USE_AGENT_STORE"]) == ("127.0.0.1", str(port),
                                                                                           "True")
        assert r["allreduce"] == 3  # 1 + 2: the process group really formed


def test_static_rendezvous_missing_node_times_out_with_exit_1(procs, tmp_path):
    launcher = procs.start(["--rdzv-backend", "static", "--nnodes", "2", "--master-port", str(choose_port()),
                            "--rdzv-conf", "timeout=2", WORKER, "--out", str(tmp_path / "out")], "alone")
    assert launcher.wait(120) == 1, launcher.tail()
    assert not records(str(tmp_path / "out"))


def test_master_addr_and_port_reach_the_workers_of_an_elastic_job(procs, tmp_path):
    port = choose_port()
    out = str(tmp_path / "out")
    launcher = procs.start(["--standalone", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                            str(port), "--node-rank", "0", "--monitor-interval", "0.1", WORKER, "--out", out,
                            "--allreduce"], "node")
    assert launcher.wait(240) == 0, launcher.tail()
    recs = records(out)
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"], r["TORCHELASTIC_USE_AGENT_STORE"]) for r in recs} == {
        ("127.0.0.1", str(port), "False")}
    assert [r["allreduce"] for r in recs] == [3, 3]


def test_python_m_rdzv_agent_and_run_path(tmp_path):
    out = str(tmp_path / "out")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PET_NPROC_PER_NODE": "2"}  # torchrun's variable for the flag
    env.pop("RDZV_URL", None)
    done = subprocess.run([sys.executable, "-m", "rdzv_agent", "--standalone",
                           "--monitor-interval", "0.1", "--start-method", "fork", "--run-path", WORKER, "--out", out],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(r["RANK"] for r in records(out)) == ["0", "1"]
    bad = subprocess.run([sys.executable, "-m", "rdzv_agent", "--standalone", WORKER],
                         env={**env, "PET_NPROC_PER_NODE": "abc"}, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "PET_NPROC_PER_NODE" in bad.stderr and "'abc'" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "rdzv_agent", "--rdzv-id", "a?b", "--rdzv-backend", "file",
                            "--rdzv-endpoint", str(tmp_path), WORKER], env=env, capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 2 and len(usage.stderr.strip().splitlines()) == 1


def test_rendezvous_timeout_exits_1(node_url, procs):
    run_id = new_run(procs)
    url = node_url(run_id, timeout="2")
    launcher = procs.start(["--rdzv", url, "--nnodes", "2", WORKER, "--out", "x"], "lonely")
    assert launcher.wait(120) == 1, launcher.tail()
    assert run_is_closed(url)  # as torchrun's shutdown() does after a rendezvous timeout


def test_closed_run_exits_1_and_success_closes_the_run(node_url, procs, tmp_path):
    run_id = new_run(procs)
    url = node_url(run_id)
    first = procs.start(["--rdzv", url, "--monitor-interval", "0.1", WORKER, "--out", str(tmp_path / "a")], "first")
    assert first.wait(120) == 0, first.tail()
    assert run_is_closed(url)
    late = procs.start(["--rdzv", url, WORKER, "--out", str(tmp_path / "b")], "late")
    assert late.wait(120) == 1, late.tail()
    assert not records(str(tmp_path / "b"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--rdzv", "nosuchscheme://h:1/run"],
        ["--rdzv", "file:///tmp/x/run?bogus_key=1"],
        ["--rdzv", "file:///tmp/x/run?timeout=-1"],
        ["--rdzv", "file:///tmp/x/run", "--rdzv-conf", "min_nodes=0"],
        ["--rdzv", "file:///tmp/x/bad%2Fid"],
        ["--standalone", "--log-level", "LOUD"],
        ["--standalone", "--role", "two words"],
        ["--rdzv-backend", "file", "--rdzv-endpoint", "/tmp/x", "--rdzv-id", "job?min_nodes=1"],
        ["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1/?max_nodes=9", "--rdzv-id", "job"],
        ["--rdzv", "file:///tmp/x/run?rank_policy=join", "--nnodes", "2", "--node-rank", "1"],
        ["--rdzv", "file:///tmp/x/run", "--nnodes", "2", "--node-labels", "rack"],
        ["--rdzv", "file:///tmp/x/run?rank_policy=first", "--nnodes", "2"],
        ["--rdzv", "file:///tmp/x/run", "--nnodes", "2", "--master-addr", "10.0.0.1"],
        ["--rdzv-backend", "static", "--nnodes", "1:2"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert main([*argv, WORKER]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("rdzv-run: error:")


@pytest.mark.parametrize("argv", [
    ["--rdzv-backend", "redis", "--rdzv-endpoint", "u:hunter2@127.0.0.1:6379", "--rdzv-id", "job"],
    ["--rdzv-backend", "redis", "--rdzv-endpoint", "u:hunter2@127.0.0.1:99999", "--rdzv-id", "job"],
    ["--rdzv-backend", "static", "--rdzv-endpoint", "u:hunter2@127.0.0.1:99999"],
])
def test_a_password_in_rdzv_endpoint_is_not_echoed(argv, capsys):
    """--rdzv-endpoint takes no credentials (they go in --rdzv URL); refusing them must not print them."""
    assert main([*argv, "--nproc-per-node", "1", WORKER]) == 2
    err = capsys.readouterr().err
    assert "--rdzv-endpoint" in err and "hunter2" not in err, err


@pytest.mark.parametrize("url, shown", [("nonsense", "'nonsense':"),
                                        ("redis://u:hunter2@h/run#x", "'redis://u:***@h/run#x':")])
def test_a_malformed_url_is_echoed_as_given(url, shown, capsys):
    """The error shows the user's URL, not the URL with --nnodes' keys merged into it; no password."""
    assert main(["--rdzv", url, "--nnodes", "2", WORKER]) == 2
    err = capsys.readouterr().err
    assert shown in err and "min_nodes" not in err and "hunter2" not in err, err


@pytest.mark.parametrize(
    "env, argv, shown",
    [
        ({"PET_NPROC_PER_NODE": "abc"}, ["--standalone"], "'PET_NPROC_PER_NODE': 'abc'"),
        ({"PET_NPROC_PER_NODE": "0"}, ["--standalone"], "'PET_NPROC_PER_NODE': '0'"),
        ({"PET_MAX_RESTARTS": "-1"}, ["--standalone"], "'PET_MAX_RESTARTS': '-1'"),
        ({"PET_MONITOR_INTERVAL": "nan"}, ["--standalone"], "'PET_MONITOR_INTERVAL': 'nan'"),
        ({"PET_START_METHOD": "thread"}, ["--standalone"], "'PET_START_METHOD': 'thread'"),
        ({"PET_TEE": "7"}, ["--standalone"], "'PET_TEE': '7'"),
        ({"PET_STANDALONE": "yes"}, [], "'PET_STANDALONE': 'yes'"),
        ({"PET_NNODES": "3:2"}, ["--standalone"], "'PET_NNODES': '3:2'"),
        ({"PET_NNODES": "2"}, ["--rdzv", "file:///tmp/x/run?max_nodes=4"], "'PET_NNODES': '2:2'"),
        ({"PET_RDZV_ID": "a?b"}, ["--rdzv-backend", "file", "--rdzv-endpoint", "/tmp/x"], "'PET_RDZV_ID': 'a?b'"),
        ({"PET_RDZV_BACKEND": "file"}, ["--standalone"], "--standalone and PET_RDZV_BACKEND"),
        ({"PET_NODE_RANK": "1"}, ["--rdzv", "file:///tmp/x/run?rank_policy=join", "--nnodes", "2"],
         "'PET_NODE_RANK': 1"),
        ({"PET_NODE_RANK": "2"}, ["--rdzv", "file:///tmp/x/run", "--nnodes", "2"], "'PET_NODE_RANK': 2"),
    ],
)
def test_bad_pet_variables_exit_2_with_one_line_naming_them(env, argv, shown, monkeypatch, capsys):
    """torchrun reads every option from PET_<OPTION>; so does rdzv-run, checking the value like the flag's."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([*argv, WORKER]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("rdzv-run: error:"), err
    assert shown in err, err


def test_pet_variables_set_torchruns_options_and_flags_win(monkeypatch, tmp_path):
    for name, value in {"PET_NPROC_PER_NODE": "3", "PET_NNODES": "2:4", "PET_MAX_RESTARTS": "2",
                        "PET_MONITOR_INTERVAL": "0.25", "PET_RDZV_BACKEND": "file", "PET_RDZV_ENDPOINT": str(tmp_path),
                        "PET_RDZV_ID": "job", "PET_RDZV_CONF": "last_call_timeout=1", "PET_ROLE": "trainer",
                        "PET_TEE": "3", "PET_RUN_PATH": "1", "PET_START_METHOD": "fork",
                        "PET_LOCAL_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    c = launch_config.build_config(launch_args.parse_args([WORKER]))
    assert (c.nproc_per_node, c.min_nodes, c.max_nodes, c.max_restarts, c.monitor_interval, c.role) == (
        3, 2, 4, 2, 0.25, "trainer")
    assert c.url.redacted() == f"file://{tmp_path}/job?last_call_timeout=1.0&min_nodes=2&max_nodes=4"
    assert (c.local_addr, c.start_method, c.program_args[:2]) == ("127.0.0.1", "fork", ["-u", "-c"])
    # the command line wins, and a bad variable behind a given flag is not even read (as in torchrun)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "abc")
    monkeypatch.setenv("PET_STANDALONE", "0")
    argv = ["--nproc-per-node", "2", "--nnodes", "1", "--rdzv-id", "other", WORKER]
    c = launch_config.build_config(launch_args.parse_args(argv))
    assert (c.nproc_per_node, c.min_nodes, c.max_nodes) == (2, 1, 1)
    assert c.url.redacted().startswith(f"file://{tmp_path}/other?")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.delenv("PET_RDZV_BACKEND")
    monkeypatch.delenv("PET_RDZV_ENDPOINT")
    monkeypatch.delenv("PET_RDZV_ID")
    monkeypatch.delenv("PET_NNODES")
    assert launch_config.build_config(launch_args.parse_args(["--nproc-per-node", "1", WORKER])).standalone


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--nnodes", "3:1", "--standalone", WORKER])
    assert info.value.code == 2


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "--nproc-per-node" in capsys.readouterr().out


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("rdzv-run")
    if exe is None:
        pytest.skip("rdzv-run is not on PATH (package not installed)")
    assert os.path.exists(exe)
    assert sys.executable


def _parses_of_one_launch(argv):
    from tests.support.agent_workers.parse_counter import install

    calls = []
    uninstall = install(calls.append)
    try:
        assert main([*argv, "--no-python", "/bin/true"]) == 0
    finally:
        uninstall()
    return calls


@pytest.mark.parametrize("mode", ["url", "backend", "standalone"])
def test_one_launch_parses_the_url_once(mode, tmp_path):
    """From ``rdzv-run``'s options to the backend's ``open``, the URL text is parsed once (none for
    ``--standalone`` and ``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``, whose URLs are built), with
    ``--rdzv-conf`` and ``--nnodes`` added to it."""
    argv = {"url": ["--rdzv", f"file://{tmp_path}/job?last_call_timeout=1", "--rdzv-conf", "keep_alive_ttl=5",
                    "--nnodes", "1"],
            "backend": ["--rdzv-backend", "file", "--rdzv-endpoint", str(tmp_path), "--rdzv-id", "job",
                        "--rdzv-conf", "keep_alive_ttl=5", "--nnodes", "1"],
            "standalone": ["--standalone", "--rdzv-conf", "keep_alive_ttl=5"]}[mode]
    calls = _parses_of_one_launch(argv)
    expected = ["parse_url", "parse_qsl"] if mode == "url" else []
    assert sorted(calls) == sorted(expected), calls


def test_the_parse_counter_sees_a_second_parse(tmp_path, monkeypatch):
    """The count above can fail: one more parse anywhere on the path (here in ``create_handler``) is seen."""
    import rdzv_core
    import rdzv_core.plugins

    original = rdzv_core.create_handler

    def create_handler(url, **options):
        return original(rdzv_core.plugins.parse_backend_url(url.redacted())[1], **options)

    monkeypatch.setattr(rdzv_core, "create_handler", create_handler)
    assert _parses_of_one_launch(["--rdzv", f"file://{tmp_path}/job"]).count("parse_url") == 2


def test_a_launcher_that_hides_its_password_parses_the_url_once_per_image(tmp_path, rdzv_server_redis):
    """A real ``rdzv-run`` with the password on its command line re-executes itself (same pid) with the URL
    in ``RDZV_URL``: each of the two images parses the URL once."""
    parse_log = tmp_path / "parses"
    site = os.path.join(HERE, "count_site")
    env = {**os.environ, "RDZV_TEST_PARSE_LOG": str(parse_log),
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    env.pop("RDZV_URL", None)
    url = f"redis://default:pw{uuid.uuid4().hex[:8]}@{rdzv_server_redis.address}/{uuid.uuid4().hex[:8]}"
    rdzv_run = os.path.join(os.path.dirname(sys.executable), "rdzv-run")
    proc = subprocess.run([rdzv_run, "--rdzv", url, "--rdzv-conf", "last_call_timeout=0.5", "--no-python", "/bin/true"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = parse_log.read_text().split("\n")[:-1]
    assert sorted(lines) == ["first parse_qsl", "first parse_url", "reexec parse_qsl", "reexec parse_url"], lines


SWALLOWING_LAUNCHER = """
import glob, os, signal, sys, time
from rdzv_agent import local
from rdzv_agent.launch.launcher import main

started = local.LocalElasticAgent._start_workers


class Swallowed:
    def __del__(self):  # Python prints and drops what a finalizer raises, as it does for an at-fork hook
        signal.raise_signal(signal.SIGTERM)


def start_then_signal(self, group):
    pids = started(self, group)
    deadline = time.monotonic() + 60
    while not glob.glob(os.path.join(os.environ["RECORDS"], "*.json")) and time.monotonic() < deadline:
        time.sleep(0.02)  # the worker has written its record: the test knows its pid
    Swallowed()
    return pids


local.LocalElasticAgent._start_workers = start_then_signal
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_whose_exception_was_lost_still_stops_the_launcher(procs, tmp_path):
    """SIGTERM arriving where its exception is printed and dropped (while the launcher forks, in a finalizer):
    the launcher still stops its workers and exits 128 + SIGTERM, as for any SIGTERM."""
    out = str(tmp_path / "out")
    script = tmp_path / "swallowing_launcher.py"
    script.write_text(SWALLOWING_LAUNCHER)
    launcher = procs.start(["--standalone", "--monitor-interval", "0.1", WORKER, "--out", out, "--wait-for",
                            str(tmp_path / "never")], "node", module="swallowing_launcher",
                           env={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "RECORDS": out})
    rec = eventually(lambda: records(out), 120, "the worker to start", launcher.tail)[0]
    assert launcher.wait(60) == 128 + signal.SIGTERM, launcher.tail()
    eventually(lambda: not pid_alive(rec["pid"]), 30, "the worker to be gone", launcher.tail)


def test_a_standalone_node_paused_past_its_keep_alive_ttl_keeps_its_workers(procs, tmp_path):
    """The whole node (launcher and worker) SIGSTOPped for three keep-alive TTLs, then SIGCONTed (a VM paused,
    a host too loaded to run the agent): its own key lapsed, but nobody else saw it lapse, so the agent writes it
    again and the workers run on -- started once, exit 0 -- as torchrun's do."""
    ttl = 1.0
    out, gate = str(tmp_path / "out"), str(tmp_path / "gate")
    launcher = procs.start(["--standalone", "--rdzv-conf", f"keep_alive_ttl={ttl:g}", "--monitor-interval", "0.1",
                            WORKER, "--out", out, "--wait-for", gate], "node")
    eventually(lambda: records(out), 120, "the worker to start", launcher.tail)
    frozen = launcher.freeze()
    try:
        time.sleep(3 * ttl)  # the pause itself
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    time.sleep(LATEST_JUDGEMENT * ttl + 1.0)  # the window in which a lapse would be judged and the round destroyed
    open(gate, "w").close()
    assert launcher.wait(120) == 0, launcher.tail()
    assert len(records(out)) == 1, f"the worker was started again: {records(out)}\n{launcher.tail()}"
