"""torchrun 2.13's per-worker flags and variables under real ``rdzv-run`` launchers and workers.

``--nproc-per-node`` names, ``--signals-to-handle``, ``--virtual-local-rank``,
``--numa-binding`` and ``PYTHON_EXEC``. The worker variables (and per-role ranks)
are compared with torchrun's own in tests/torchrun/test_torchrun_parity.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.agent_workers.harness import WORKER, pid_alive

from tests.support.waiting import eventually
from rdzv_agent.launch.launcher import main
from tests.support.launch_runs import new_run, records, run_is_closed

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

AFFINITY = textwrap.dedent(
    """
    import json, os, sys
    with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
        json.dump({"cpus": sorted(os.sched_getaffinity(0)), "LOCAL_RANK": os.environ["LOCAL_RANK"]}, f)
    """
)


@pytest.mark.parametrize("argv, env, named, reason", [
    (["--nproc-per-node", "0"], {}, "--nproc-per-node", "must be >= 1"),
    (["--nproc-per-node", "tpu"], {}, "--nproc-per-node", "Unsupported nproc_per_node value"),
    ([], {"PET_NPROC_PER_NODE": "gpu"}, "PET_NPROC_PER_NODE", "not available"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE"], {}, "--signals-to-handle", "'SIGNOPE'"),
    (["--signals-to-handle", "SIGKILL"], {}, "--signals-to-handle", "cannot be handled"),
    (["--signals-to-handle", ""], {}, "--signals-to-handle", "not a signal name"),
    ([], {"PET_SIGNALS_TO_HANDLE": "TERM"}, "PET_SIGNALS_TO_HANDLE", "not a signal name"),
    (["--numa-binding", "everywhere"], {}, "--numa-binding", "invalid choice"),
    (["--nproc-per-node", "2", "--virtual-local-rank"], {"CUDA_VISIBLE_DEVICES": "0"}, "--virtual-local-rank",
     "only 1 devices"),
    ([], {"PYTHON_EXEC": "/nonexistent/python3"}, "PYTHON_EXEC", "not an executable"),
    (["--node-check-timeout", "0"], {}, "--node-check-timeout", "'0'"),
    (["--node-check-timeout", "1e9"], {}, "--node-check-timeout", "<= 1e+07"),
    (["--node-check-action", "retry"], {}, "--node-check-action", "invalid choice"),
    (["--node-check-min-free-mb", "lots"], {}, "--node-check-min-free-mb", "'lots'"),
    (["--node-check-dir", "/a:/b"], {}, "--node-check-dir", "without ':'"),
    (["--node-check", "a\tb"], {}, "--node-check", "control characters"),
])
def test_bad_flag_values_exit_2_naming_the_flag(argv, env, named, reason, monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        code = main(["--standalone", *argv, WORKER, "--out", "/nonexistent"])
    except SystemExit as exc:  # argparse's own error for a bad value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert named in err and reason in err and "unrecognized" not in err, err


def test_node_check_options_become_the_urls_query_keys(monkeypatch, tmp_path):
    """--node-check* set the node_check* keys the handler reads (as --rdzv-conf would); a flag on the command line
    replaces the URL's key, PET_NODE_CHECK only fills in a missing node_check."""
    from rdzv_agent.launch.args import NODE_CHECK_ACTIONS, parse_args
    from rdzv_agent.launch.config import build_config
    from rdzv_core.errors import ConfigError
    from rdzv_core.url import NODE_CHECK_ACTIONS as QUERY_ACTIONS

    assert NODE_CHECK_ACTIONS == QUERY_ACTIONS  # --node-check-action's choices are the query key's values

    monkeypatch.delenv("PET_NODE_CHECK", raising=False)
    base = f"file://{tmp_path}/run"
    url = build_config(parse_args(["--rdzv", f"{base}?node_check=from-url&node_check_interval=5", "--node-check-dir",
                                   "/scratch", "--node-check-dir", "/tmp", "--node-check-timeout", "20",
                                   "--node-check-min-free-mb", "512", "--node-check-action", "exit", WORKER])).url
    assert {k: v for k, v in url.params.items() if k.startswith("node_check")} == {
        "node_check": "from-url", "node_check_interval": 5.0, "node_check_dirs": "/scratch:/tmp",
        "node_check_timeout": 20.0, "node_check_min_free_mb": 512.0, "node_check_action": "exit"}
    argv = ["--rdzv", f"{base}?node_check=from-url", "--node-check", "from-flag", WORKER]
    assert build_config(parse_args(argv)).url.params["node_check"] == "from-flag"
    monkeypatch.setenv("PET_NODE_CHECK", "from-env")
    assert build_config(parse_args(argv)).url.params["node_check"] == "from-flag"
    assert build_config(parse_args(["--rdzv", f"{base}?node_check=from-url", WORKER])).url.params["node_check"] == (
        "from-url")
    assert build_config(parse_args(["--standalone", WORKER])).target.url.params["node_check"] == "from-env"
    static = ["--nnodes", "2", "--master-port", "29555", WORKER]  # torch's static rendezvous runs no checks
    with pytest.raises(ConfigError, match="'PET_NODE_CHECK'.*runs no node or network checks"):
        build_config(parse_args(static))
    monkeypatch.setenv("PET_NODE_CHECK", "")
    assert build_config(parse_args(static)).static is not None


def test_gpu_on_a_machine_without_cuda_is_refused_as_torch_refuses_it(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        main(["--standalone", "--nproc-per-node", "gpu", WORKER])
    assert exc.value.code == 2
    assert "Cuda is not available" in capsys.readouterr().err  # torch's determine_local_world_size's reason


@pytest.mark.parametrize("value", ["cpu", "auto"])
def test_nproc_per_node_cpu_and_auto_run_one_worker_per_usable_cpu(value, procs, tmp_path):  # noqa: F811
    if torch.accelerator.is_available() and value == "auto":
        pytest.skip("auto counts accelerators here")
    out = str(tmp_path / "out")
    launcher = procs.start(["--standalone", "--nproc-per-node", value, "--monitor-interval", "0.1", WORKER,
                            "--out", out], "node")
    assert launcher.wait(120) == 0, launcher.tail()
    count = torch._utils.cpu_count()  # what torch's determine_local_world_size uses
    assert sorted(int(r["RANK"]) for r in records(out)) == list(range(count))
    assert {r["LOCAL_WORLD_SIZE"] for r in records(out)} == {str(count)}


def file_url(tmp_path, run_id):
    """A one-to-two-node run over ``file://`` (signal handling is the launcher's: one backend serves)."""
    return f"file://{tmp_path}/rdzv/{run_id}?min_nodes=1&max_nodes=2&last_call_timeout=0.5&keep_alive_ttl=2&timeout=60"


@pytest.mark.parametrize("argv, sig", [
    ([], signal.SIGQUIT),  # in torchrun's default list (SIGTERM, SIGINT, SIGHUP, SIGQUIT)
    (["--signals-to-handle", "SIGUSR1,SIGTERM"], signal.SIGUSR1),
])
def test_a_handled_signal_stops_the_workers_and_leaves_the_run_open(argv, sig, procs, tmp_path):  # noqa: F811
    url = file_url(tmp_path, new_run(procs))
    out = str(tmp_path / "out")
    launcher = procs.start(["--rdzv", url, "--monitor-interval", "0.1", *argv, WORKER, "--out", out, "--child",
                            "--wait-for", str(tmp_path / "never")], "node")
    rec = eventually(lambda: records(out), 120, "the worker to start", launcher.tail)[0]
    assert rec["env"]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == (argv[1] if argv else "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    os.kill(launcher.pid, sig)
    assert launcher.wait(60) == 128 + sig, launcher.tail()
    eventually(lambda: not pid_alive(rec["pid"]) and not pid_alive(rec["child_pid"]), 30,
               "the worker and its child to be gone", launcher.tail)
    assert not run_is_closed(url)  # release(), not shutdown(): as torchrun after a signal


def test_a_signal_left_out_of_the_list_is_not_handled(procs, tmp_path):  # noqa: F811
    """``--signals-to-handle SIGTERM``: SIGUSR2 then kills the launcher as it would any program. (Not SIGHUP: a
    suite started under ``nohup`` passes SIGHUP on ignored, and an ignored signal kills nothing.)"""
    url = file_url(tmp_path, new_run(procs))
    out = str(tmp_path / "out")
    launcher = procs.start(["--rdzv", url, "--monitor-interval", "0.1", "--signals-to-handle", "SIGTERM", WORKER,
                            "--out", out, "--wait-for", str(tmp_path / "never")], "node")
    eventually(lambda: records(out), 120, "the worker to start", launcher.tail)
    os.kill(launcher.pid, signal.SIGUSR2)
    assert launcher.wait(60) == -signal.SIGUSR2, launcher.tail()


def test_virtual_local_rank_without_cuda_visible_devices_gives_each_worker_its_local_rank(procs, tmp_path):  # noqa: F811
    out = str(tmp_path / "out")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    launcher = procs.start(["--standalone", "--nproc-per-node", "2", "--virtual-local-rank", "--monitor-interval",
                            "0.1", WORKER, "--out", out], "node", env=env)
    assert launcher.wait(120) == 0, launcher.tail()
    seen = sorted((r["RANK"], r["LOCAL_RANK"], r["env"].get("CUDA_VISIBLE_DEVICES")) for r in records(out))
    assert seen == [("0", "0", "0"), ("1", "0", "1")]


def test_numa_binding_without_numactl_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no numactl there
    assert main(["--standalone", "--numa-binding", "node", WORKER]) == 2
    err = capsys.readouterr().err
    assert "--numa-binding" in err and "numactl" in err


@pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl is not installed (apt-get install numactl)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only plan; with CUDA the GPUs' NUMA nodes decide")
@pytest.mark.parametrize("mode", ["node", "exclusive"])
def test_numa_binding_binds_each_worker_with_numactl(mode, procs, tmp_path):  # noqa: F811
    allowed = sorted(os.sched_getaffinity(0))
    nodes = [n for n in os.listdir("/sys/devices/system/node") if n.startswith("node")]
    if mode == "exclusive" and (len(allowed) < 2 or len(nodes) != 1):
        pytest.skip("needs one NUMA node with at least two usable CPUs")
    script = tmp_path / "affinity.py"
    script.write_text(AFFINITY)
    out = tmp_path / "out"
    out.mkdir()
    launcher = procs.start(["--standalone", "--nproc-per-node", "2", "--numa-binding", mode, "--monitor-interval",
                            "0.1", str(script), str(out)], "node")
    assert launcher.wait(120) == 0, launcher.tail()
    cpus = {}
    for name in os.listdir(out):
        with open(out / name) as f:
            cpus[name] = json.load(f)["cpus"]
    if mode == "exclusive":  # disjoint shares of the node's CPUs
        assert not set(cpus["0.json"]) & set(cpus["1.json"]) and cpus["0.json"] and cpus["1.json"]
        assert set(cpus["0.json"]) | set(cpus["1.json"]) <= set(allowed)
        assert max(cpus["0.json"]) < min(cpus["1.json"])  # lower local rank, lower cores (torch's order)
    elif len(nodes) == 1:
        assert cpus == {"0.json": allowed, "1.json": allowed}



@pytest.mark.parametrize("log_dir", ["/proc/no-such-dir", "/etc/passwd"])
def test_a_log_dir_that_cannot_be_made_is_a_usage_error_naming_the_flag(log_dir, tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    done = subprocess.run([sys.executable, "-m", "rdzv_agent", "--standalone", "--log-dir", log_dir, str(script)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--log-dir" in done.stderr or "log_dir" in done.stderr, done.stderr
