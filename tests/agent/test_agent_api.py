"""Agent API, output handling and option parsing: no processes, no backend."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest

import rdzv_agent
from rdzv_agent import master_address
from rdzv_agent.launch import args as launch_args
from rdzv_agent.launch import config as launch_config
from rdzv_agent.api import MonitorResult, WorkerFailure, WorkerGroup, WorkerSpec, WorkerState, describe_exit
from rdzv_agent.launch.launcher import main, worker_environment
from rdzv_agent.workers.streams import Std, error_excerpt, parse_std, std_for_rank
from rdzv_core.errors import ConfigError
from rdzv_core.url import RendezvousURL, parse_url


class _Handler:
    """Only identity matters to WorkerSpec; nothing calls it in these tests."""


def spec(**kw):
    args = dict(role="trainer", local_world_size=2, fn=sys.executable, args=("x.py",), rdzv_handler=_Handler())
    args.update(kw)
    return WorkerSpec(**args)


def test_public_names():
    assert set(rdzv_agent.__all__) >= {
        "WorkerSpec", "Worker", "WorkerState", "WorkerGroup", "MonitorResult", "ElasticAgent",
        "SimpleElasticAgent", "WorkerGroupFailureException", "LocalElasticAgent",
    }
    for name in rdzv_agent.__all__:
        assert hasattr(rdzv_agent, name)


@pytest.mark.parametrize(
    "field, value",
    [
        ("local_world_size", 0),
        ("local_world_size", 1.5),
        ("max_restarts", -1),
        ("max_restarts", True),
        ("monitor_interval", 0),
        ("monitor_interval", float("nan")),
        ("monitor_interval", "1"),
        ("role", ""),
        ("role", "two words"),
        ("master_port", 0),
        ("master_port", 70000),
        ("fn", ""),
        ("rdzv_handler", None),
        ("local_addr", ""),
    ],
)
def test_worker_spec_rejects_bad_fields(field, value):
    with pytest.raises(ConfigError) as info:
        spec(**{field: value})
    assert info.value.field == field
    assert info.value.value == value or value != value  # nan != nan
    assert isinstance(info.value, ValueError)


def test_worker_spec_accepts_zero_restarts_and_builds_group():
    s = spec(max_restarts=0, monitor_interval=0.1)
    group = WorkerGroup(s)
    assert s.max_restarts == 0
    assert [w.local_rank for w in group.workers] == [0, 1]
    assert group.state == WorkerState.INIT
    assert all(w.global_rank is None for w in group.workers)


def test_worker_state_running():
    assert WorkerState.is_running(WorkerState.HEALTHY)
    assert WorkerState.is_running(WorkerState.UNHEALTHY)
    assert not WorkerState.is_running(WorkerState.FAILED)


def test_monitor_result_defaults_are_empty():
    r = MonitorResult(WorkerState.HEALTHY)
    assert r.ret_vals == {} and r.exceptions == {}


def test_worker_failure_describes_rank_exit_and_first_error_line():
    f = WorkerFailure(3, 1, 7, error="ValueError: boom\nmore", log_path="/x/stderr.log")
    assert "rank 3" in str(f) and "code 7" in str(f) and "ValueError: boom" in str(f)
    assert "more" not in str(f)
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(None) == "did not exit"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", Std.NONE),
        ("3", Std.ALL),
        ("2", Std.ERR),
        ("0:3,1:0", {0: Std.ALL, 1: Std.NONE}),
    ],
)
def test_parse_std(text, expected):
    assert parse_std("tee", text) == expected


@pytest.mark.parametrize("text", ["4", "a", "0:4", "0:1,0:2", "", "1,2"])
def test_parse_std_rejects(text):
    with pytest.raises(ConfigError) as info:
        parse_std("redirects", text)
    assert info.value.field == "redirects"


def test_std_for_rank():
    assert std_for_rank(Std.OUT, 5) == Std.OUT
    assert std_for_rank({1: Std.ERR}, 1) == Std.ERR
    assert std_for_rank({1: Std.ERR}, 0) == Std.NONE


def test_error_excerpt_takes_the_exception_of_the_last_traceback():
    lines = [
        "some warning",
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in <module>',
        "    f()",
        "KeyError: 'first'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "a.py", line 3, in <module>',
        "    raise RuntimeError('second')",
        "RuntimeError: second",
        "  detail line",
    ]
    assert error_excerpt(lines) == "RuntimeError: second\n  detail line"


def test_error_excerpt_reads_tracebacks_with_torchs_rank_prefix():
    """init_process_group's excepthook writes every traceback line as ``[rankN]: ...``."""
    traceback = [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "a.py", line 1, in <module>',
        "[rank1]:     f()",
        "[rank1]: KeyError: 'first'",
        "",
        "[rank1]: During handling of the above exception, another exception occurred:",
        "",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "a.py", line 3, in <module>',
        "[rank1]:     raise RuntimeError('second')",
        "[rank1]: RuntimeError: second",
        "[rank1]:   detail line",
        "",
    ]
    noise = [f"[W1130 03:00:0{i} ProcessGroupGloo.cpp:{i}] Warning: destroy_process_group() was not called"
             for i in range(6)]
    assert error_excerpt(["some warning", *traceback, *noise]) == "RuntimeError: second\n  detail line"
    assert error_excerpt(["[rank12]: ValueError: no traceback"]) == "ValueError: no traceback"


def test_error_excerpt_without_traceback_uses_the_last_lines():
    lines = [f"line {i}" for i in range(10)] + [""]
    assert error_excerpt(lines, max_lines=3) == "line 7\nline 8\nline 9"
    assert error_excerpt([]) == ""


def test_port_in_use_detection():
    torch_text = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                  "network address. port: 1, useIpv6: false, code: -98, name: EADDRINUSE, message: address "
                  "already in use")
    assert master_address.is_port_in_use_error(torch_text)
    assert master_address.is_port_in_use_error("OSError: [Errno 98] Address already in use")
    assert not master_address.is_port_in_use_error("RuntimeError: boom")


def test_port_is_free_sees_a_listening_socket():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        assert not master_address.port_is_free(s.getsockname()[1])
    assert master_address.port_is_free(master_address.choose_port())


# -- rdzv-run options -------------------------------------------------------------------------


def config(argv, environ=None, tmp_path=None):
    return launch_config.build_config(launch_args.parse_args(argv), environ or {})


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def test_both_spellings_and_nnodes_forms(script):
    c = config(["--nproc_per_node", "3", "--nnodes", "2:4", "--rdzv", "file:///d/run", script, "--lr", "1"])
    assert c.nproc_per_node == 3 and (c.min_nodes, c.max_nodes) == (2, 4)
    assert c.program == sys.executable and c.program_args == ["-u", script, "--lr", "1"]
    c = config(["--nproc-per-node", "2", "--nnodes", "2", "--rdzv", "file:///d/run", script])
    assert (c.min_nodes, c.max_nodes) == (2, 2)


def test_nnodes_must_agree_with_the_url_query(script):
    """--nnodes never silently overrides the URL: it fills in missing keys, equal values are fine, others are an
    error naming the flag, the query key (as written) and both values."""
    c = config(["--nnodes", "2:3", "--rdzv", "etcd://h:1/run?min_workers=2&timeout=7", script])
    assert dict(c.url.params) == {"min_nodes": 2, "timeout": 7.0, "max_nodes": 3}
    assert (c.min_nodes, c.max_nodes, c.url.key_name("min_nodes")) == (2, 3, "min_workers")
    c = config(["--nnodes", "2:3", "--rdzv", "etcd://h:1/run?min_nodes=2&max_nodes=3", script])
    assert c.url.redacted() == "etcd://h:1/run?min_nodes=2&max_nodes=3"
    for argv, shown in (
        (["--nnodes", "2:3", "--rdzv", "etcd://h:1/run?min_workers=5&max_nodes=9"], "min_workers=5"),
        (["--nnodes", "2", "--rdzv", "etcd://h:1/run?max_nodes=4"], "max_nodes=4"),
        (["--nnodes", "2", "--rdzv", "etcd://h:1/run", "--rdzv-conf", "max_nodes=3"], "max_nodes=3 in --rdzv-conf"),
    ):
        with pytest.raises(ConfigError) as info:
            config([*argv, script])
        assert (info.value.field, info.value.value) == ("--nnodes", argv[1] if ":" in argv[1] else "2:2")
        assert shown in str(info.value)


@pytest.mark.parametrize("query, field", [("min_nodes=0", "min_nodes"), ("max_workers=x", "max_workers"),
                                          ("min_nodes=3&max_nodes=2", "min_nodes")])
def test_bad_url_node_counts_are_reported_even_with_nnodes(query, field, script):
    with pytest.raises(ConfigError) as info:
        config(["--nnodes", "2", "--rdzv", f"etcd://h:1/run?{query}", script])
    assert info.value.field == field


def test_url_keeps_its_nodes_without_nnodes(script):
    c = config(["--rdzv", "etcd://h:1/run?min_nodes=2&max_nodes=3", script])
    assert c.url.redacted() == "etcd://h:1/run?min_nodes=2&max_nodes=3"
    c = config(["--rdzv", "etcd://h:1/run", script])
    assert dict(c.url.params) == {"min_nodes": 1, "max_nodes": 1}
    c = config(["--rdzv", "etcd://h:1/run?max_nodes=3", script])
    assert dict(c.url.params) == {"max_nodes": 3}  # one count given: the rendezvous's default for the other


def test_backend_endpoint_id_and_conf_build_the_url(script):
    c = config(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--rdzv-id", "job",
                "--rdzv-conf", "last_call_timeout=1,keep_alive_ttl=2", "--nnodes", "1:2", script])
    assert (c.url.scheme, c.url.hosts, c.url.run_id) == ("etcd", (("h", 2379),), "job")
    assert dict(c.url.params) == {"last_call_timeout": 1.0, "keep_alive_ttl": 2.0, "min_nodes": 1, "max_nodes": 2}
    c = config(["--rdzv_backend", "file", "--rdzv_endpoint", "/tmp/x/", "--rdzv_id", "job", script])
    assert c.url.redacted().startswith("file:///tmp/x/job?")


@pytest.mark.parametrize("directory", ["/tmp/a%62", "/tmp/q?x=1", "/tmp/h#f", "/tmp/at@x", "/tmp/pct%2F"])
def test_endpoint_directory_reaches_the_backend_exactly(script, directory):
    c = config(["--rdzv-backend", "file", "--rdzv-endpoint", directory + "/", "--rdzv-id", "job", script])
    assert (c.url.path, c.url.run_id) == (directory.strip("/"), "job")
    assert set(c.url.params) == {"min_nodes", "max_nodes"}


def test_backend_url_round_trips_hosts_and_run_id():
    for endpoint in ("h:2379", "h1:1,h2:2", "[::1]:2379", "127.0.0.1"):
        parsed = parse_url(launch_config.backend_url("etcd", endpoint, "a-b_c.d=e+f:g@h~i"))
        assert parsed.run_id == "a-b_c.d=e+f:g@h~i" and not parsed.params and parsed.username is None


def test_bad_run_id_exits_2_before_any_rendezvous(tmp_path, capsys):
    endpoint = tmp_path / "rdzv"
    for run_id in ("job?min_nodes=1", "jo%62"):
        assert main(["--rdzv-backend", "file", "--rdzv-endpoint", str(endpoint), "--rdzv-id", run_id,
                     "--no-python", "/bin/true"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--rdzv-id" in err and run_id in err
    assert not endpoint.exists()


def test_static_rendezvous_options(script):
    c = config(["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "29501", script])
    assert c.static == launch_config.StaticRendezvous("10.0.0.1", 29501, 1, 2, "none",
                                                      launch_args.STATIC_DEFAULT_TIMEOUT)
    assert (c.master_addr, c.master_port, c.min_nodes, c.max_nodes, c.standalone) == ("10.0.0.1", 29501, 2, 2, False)
    c = config(["--rdzv-backend", "static", "--nnodes", "3", "--rdzv-id", "job", "--rdzv-conf", "timeout=30", script])
    assert c.static == launch_config.StaticRendezvous("127.0.0.1", 29500, 0, 3, "job", 30)  # torchrun's defaults
    c = config(["--rdzv-backend", "static", "--rdzv-endpoint", "[::1]:7", "--nnodes", "2", "--node-rank", "1", script])
    assert (c.static.master_addr, c.static.master_port, c.static.node_rank) == ("::1", 7, 1)


def test_one_node_static_without_a_port_runs_standalone(script):
    """torchrun's rule: static, one node, no port -> a standalone rendezvous (here file://)."""
    c = config(["--node-rank", "0", "--master-addr", "127.0.0.2", script])
    assert c.standalone and c.static is None and c.master_addr == "127.0.0.2" and c.master_port is None
    c = config(["--rdzv-backend", "static", "--rdzv-id", "myjob", script])
    assert c.standalone and c.url is None and c.target == launch_config.Standalone(
        RendezvousURL("file", (), "", "myjob", {"min_nodes": 1, "max_nodes": 1}))
    assert c.target.in_directory("/tmp/d").redacted() == "file:///tmp/d/myjob?min_nodes=1&max_nodes=1"


def test_node_rank_and_labels_with_an_elastic_rendezvous_are_a_rank_request(script):
    """Elastic: --node-rank asks for a group rank, --node-labels declares labels (docs/ranks.md); both go to the
    rendezvous as its query keys."""
    c = config(["--rdzv", "file:///d/r", "--nnodes", "2:3", "--node-rank", "2", "--node-labels", "rack=r1,sw=s2",
                script])
    assert (c.target.params["node_rank"], c.target.params["node_labels"]) == (2, "rack=r1,sw=s2")
    assert "node_rank" not in config(["--rdzv", "file:///d/r", "--nnodes", "2:3", script]).target.params


def test_master_options_with_an_elastic_rendezvous(script):
    c = config(["--rdzv", "file:///d/r?max_nodes=3", "--master-port", "29999", script])
    assert (c.master_port, c.master_addr, c.static) == (29999, None, None)
    c = config(["--standalone", "--master-addr", "[::1]", "--master-port", "1", "--node-rank", "0", script])
    assert (c.master_addr, c.master_port, c.standalone) == ("::1", 1, True)
    c = config(["--rdzv", "file:///d/r", "--nnodes", "1", "--node-rank", "0", "--master-addr", "h", script])
    assert c.master_addr == "h"


@pytest.mark.parametrize("method", launch_args.START_METHODS)
def test_start_method_is_accepted_and_changes_nothing(script, method):
    base = config(["--standalone", script])
    c = config(["--standalone", "--start-method", method, script])
    assert c.start_method == method and (c.program, c.program_args) == (base.program, base.program_args)


def test_run_path_runs_the_script_with_runpy(script, tmp_path):
    c = config(["--standalone", "--run_path", script, "--lr", "1"])
    assert c.program == sys.executable
    assert c.program_args == ["-u", "-c", launch_args.RUN_PATH_CODE, script, "--lr", "1"]
    probe = tmp_path / "probe.py"
    probe.write_text("import json, sys\nprint(json.dumps([__name__, sys.argv]))\n")
    out = subprocess.run([c.program, *c.program_args[:3], str(probe), "a", "--b"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out) == ["__main__", [str(probe), "a", "--b"]]


def test_url_from_environment(script):
    c = config([script], environ={launch_args.URL_ENV: "file:///d/run"})
    assert c.url.redacted() == "file:///d/run?min_nodes=1&max_nodes=1"


def test_no_rendezvous_options_mean_torchruns_default_static_rendezvous(script):
    """``rdzv-run train.py`` runs as ``torchrun train.py`` does: torchrun's default static rendezvous, which
    for one node without a port is a standalone job; ``--nnodes 2`` meets at 127.0.0.1:29500."""
    assert config([script]).standalone
    c = config(["--nnodes", "2", "--node-rank", "1", script])
    assert (c.static.master_addr, c.static.master_port, c.static.node_rank, c.static.nnodes) == ("127.0.0.1", 29500,
                                                                                                 1, 2)
    assert config(["--nnodes", "2", script]).static.node_rank == 0


def test_torchruns_handler_names_are_the_backends(script):
    """``--rdzv-backend rdzv-redis`` (the name torchrun knows this project's handler by) is ``redis``."""
    c = config(["--rdzv-backend", "rdzv-redis", "--rdzv-endpoint", "h:1", "--rdzv-id", "job", script])
    assert c.url.redacted() == "redis://h:1/job?min_nodes=1&max_nodes=1"
    c = config(["--rdzv-backend", "rdzv-etcd-v3", "--rdzv-endpoint", "h:1", "--rdzv-id", "job", script])
    assert c.url.redacted().startswith("etcd-v3://h:1/job")


def test_module_and_no_python(script, tmp_path):
    c = config(["--standalone", "-m", "pkg.mod", "a"])
    assert c.program_args == ["-u", "-m", "pkg.mod", "a"] and c.standalone
    exe = tmp_path / "run.sh"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    c = config(["--standalone", "--no-python", str(exe), "b"])
    assert c.program == str(exe) and c.program_args == ["b"]


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--standalone", "--rdzv", "file:///d/r", "S"], "rendezvous"),
        (["--rdzv-backend", "etcd", "S"], "--rdzv-endpoint"),
        (["--standalone", "--nnodes", "2", "S"], "--nnodes"),
        (["--standalone", "-m", "--no-python", "x"], "-m"),
        (["--standalone", "--run-path", "--no-python", "S"], "--no-python"),
        (["--standalone", "-m", "--run-path", "x"], "-m"),
        (["--standalone", "/no/such/script.py"], "script"),
        (["--standalone", "--run-path", "/no/such/script.py"], "script"),
        (["--standalone", "--no-python", "/no/such/exe"], "script"),
        (["--rdzv", "file:///d/r", "--rdzv-conf", "novalue", "S"], "--rdzv-conf"),
        # the run id and endpoint cannot inject into the URL
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "job?min_nodes=1", "S"], "--rdzv-id"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "jo%62", "S"], "--rdzv-id"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "a/b", "S"], "--rdzv-id"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "..", "S"], "--rdzv-id"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1?min_nodes=1", "--rdzv-id", "job", "S"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1#x", "--rdzv-id", "job", "S"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "u:pw@h:1", "--rdzv-id", "job", "S"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h%3A1", "--rdzv-id", "job", "S"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1 x", "--rdzv-id", "job", "S"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:99999", "--rdzv-id", "job", "S"], "--rdzv-endpoint"),
        (["--rdzv-backend", "file", "--rdzv-endpoint", "/tmp/../etc", "--rdzv-id", "job", "S"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd://h", "--rdzv-endpoint", "h:1", "--rdzv-id", "job", "S"], "--rdzv-backend"),
        # torchrun's static options: refused where they cannot do what torchrun does
        (["--rdzv", "file:///d/r?rank_policy=join", "--nnodes", "2", "--node-rank", "1", "S"], "--node-rank"),
        (["--rdzv", "file:///d/r", "--nnodes", "1:2", "--node-rank", "2", "S"], "--node-rank"),
        (["--standalone", "--node-rank", "1", "S"], "--node-rank"),
        (["--rdzv", "file:///d/r?max_nodes=3", "--master-addr", "10.0.0.1", "S"], "--master-addr"),
        (["--standalone", "--master-addr", "bad host", "S"], "--master-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "29501", "S"], "--node-rank"),
        (["--nnodes", "1:2", "--node-rank", "0", "--master-port", "29501", "S"], "--nnodes"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--local-addr", "h", "S"], "--local-addr"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-conf", "last_call_timeout=1", "S"], "--rdzv-conf"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-conf", "timeout=0", "S"], "--rdzv-conf"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-id", "a?b", "S"], "--rdzv-id"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--master-port", "2", "S"],
         "--rdzv-endpoint"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-endpoint", "h", "S"], "--rdzv-endpoint"),
    ],
)
def test_bad_combinations_name_the_option(argv, field, script):
    argv = [script if a == "S" else a for a in argv]
    with pytest.raises(ConfigError) as info:
        config(argv)
    assert info.value.field == field


@pytest.mark.parametrize(
    "argv",
    [
        ["--start-method", "thread", "--standalone", "x"],
        ["--master-port", "0", "--standalone", "x"],
        ["--master-port", "65536", "--standalone", "x"],
        ["--node-rank", "-1", "--standalone", "x"],
        ["--nnodes", "3:2", "--standalone", "x"],
        ["--nnodes", "0", "--standalone", "x"],
        ["--nnodes", "a", "--standalone", "x"],
        ["--nproc-per-node", "0", "--standalone", "x"],
        ["--max-restarts", "-1", "--standalone", "x"],
        ["--monitor-interval", "0", "--standalone", "x"],
        ["--tee", "7", "--standalone", "x"],
        ["--standalone"],
    ],
)
def test_bad_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        launch_args.parse_args(argv)
    assert info.value.code == 2


def test_worker_environment_drops_the_url_and_password():
    env = {
        "PATH": "/usr/bin",
        launch_args.URL_ENV: "etcd://u:pw%2Fx@h/run",
        "OTHER_URL": "redis://u:pw/x@h:1/0",
        "PASSWORD": "pw/x",
        "HARMLESS": "pw",
    }
    out = worker_environment(env, "pw/x")
    assert out == {"PATH": "/usr/bin", "HARMLESS": "pw"}
    assert worker_environment(env, None).keys() == env.keys() - {launch_args.URL_ENV}


def test_strip_rdzv_options_keeps_everything_else():
    argv = ["--nnodes", "2", "--rdzv", "etcd://u:pw@h/r", "-m", "--rdzv_id=x", "--standalone",
            "--rdzv-endpoint", "h:1", "--rdzv-backend", "etcd", "--tee=3", "--run-path", "mod", "--rdzv", "keep"]
    assert launch_args.strip_rdzv_options(argv) == ["--nnodes", "2", "-m", "--standalone", "--tee=3", "--run-path",
                                                    "mod", "--rdzv", "keep"]


def test_nnodes_type_messages():
    with pytest.raises(argparse.ArgumentTypeError):
        launch_args._nnodes("2:1")
