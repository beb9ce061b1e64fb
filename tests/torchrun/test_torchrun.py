"""Plain torchrun with rdzv backends through the ``torchrun.handlers`` entry points.

torchrun's ``launch_agent`` calls the handler's ``shutdown()`` at the end of a job
unless a signal stopped the agent; like torch's own handlers, rdzv's then closes
the run. Both ends are checked here with real torchrun processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

from tests.support.waiting import eventually
from rdzv_core import Rendezvous, RendezvousParams, open_backend

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

pytest.importorskip("torch")

#: ``--rdzv-backend`` -> rdzv URL scheme (see rdzv_core.torch_api.torchrun).
SCHEMES = {"rdzv-file": "file", "rdzv-redis": "redis", "rdzv-etcd": "etcd", "rdzv-etcd-v3": "etcd-v3"}

WORKER = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"RESULT rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture(params=["rdzv-file", "rdzv-redis", "rdzv-etcd", "rdzv-etcd-v3"])
def backend_and_endpoint(request, tmp_path):
    name = request.param
    if name == "rdzv-file":
        return name, str(tmp_path / "store")
    server = request.getfixturevalue("rdzv_server_redis" if name == "rdzv-redis" else "rdzv_server_etcd")
    return name, server.address


@pytest.mark.slow
def test_two_torchrun_nodes_all_reduce(backend_and_endpoint, tmp_path) -> None:
    backend, endpoint = backend_and_endpoint
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", f"tr{uuid.uuid4().hex[:8]}",
        "--rdzv-conf", "last_call_timeout=1,keep_alive_ttl=2,join_timeout=90", "--monitor-interval", "0.5",
        str(script),
    ]
    run_id = cmd[cmd.index("--rdzv-id") + 1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
             for _ in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err.decode(errors="replace")[-3000:]
            outs.append(out.decode())
    finally:
        for p in procs:
            p.kill()
    results = sorted(line for o in outs for line in o.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT rank=0 world=2 sum=3.0", "RESULT rank=1 world=2 sum=3.0"]
    assert _run_is_closed(backend, endpoint, run_id)  # torchrun's shutdown() closed it, as torch's handlers do


def _run_is_closed(backend: str, endpoint: str, run_id: str) -> bool:
    """Read the run's state through the backend (rdzv_core's API, not torchrun's)."""
    with open_backend(f"{SCHEMES[backend]}://{endpoint.rstrip('/')}/") as kv:
        return Rendezvous(kv, run_id, RendezvousParams(min_nodes=1)).is_closed()


SLEEPER = textwrap.dedent(
    """
    import pathlib, sys, time
    pathlib.Path(sys.argv[1]).write_text("started")
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_torchrun_stopped_by_sigterm_leaves_the_run_open(tmp_path) -> None:
    """torch's launch_agent skips shutdown() after a signal: the run stays open for the other nodes."""
    script, started = tmp_path / "sleeper.py", tmp_path / "started"
    script.write_text(SLEEPER)
    endpoint, run_id = str(tmp_path / "store"), f"tr{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "rdzv-file", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", "last_call_timeout=0.5,keep_alive_ttl=2,join_timeout=90", "--monitor-interval", "0.5",
        str(script), str(started),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        eventually(started.exists, 120, "the worker to start", lambda: f"torchrun alive: {proc.poll() is None}")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode != 0, err.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert not _run_is_closed("rdzv-file", endpoint, run_id)


def test_rdzv_conf_maps_to_url() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_core.torch_api.torchrun import handler_url

    params = RendezvousParameters(
        backend="rdzv-redis", endpoint="127.0.0.1:6379", run_id="job", min_nodes=2, max_nodes=3,
        last_call_timeout=5, join_timeout=60, is_host=True,
    )
    url = handler_url("redis", params)
    assert url.startswith("redis://127.0.0.1:6379/job?")
    from rdzv_core import parse_url

    parsed = parse_url(url)
    assert parsed.params == {"min_nodes": 2, "max_nodes": 3, "last_call_timeout": 5.0, "timeout": 60.0}


def test_the_sentinel_handler_takes_every_sentinel_and_the_master_name() -> None:
    """``--rdzv-backend rdzv-redis-sentinel --rdzv-endpoint S1,S2 --rdzv-conf master_name=NAME``: every sentinel
    in the URL, the master name as its query key (entry point registered for torchrun)."""
    from importlib.metadata import entry_points

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_core import parse_backend_url
    from rdzv_core.torch_api.torchrun import handler_url

    assert any(ep.name == "rdzv-redis-sentinel" for ep in entry_points(group="torchrun.handlers"))
    params = RendezvousParameters(backend="rdzv-redis-sentinel", endpoint="127.0.0.1:26379,127.0.0.1:26380",
                                  run_id="job", min_nodes=1, max_nodes=2, master_name="mymaster")
    url = handler_url("redis+sentinel", params)
    assert url.startswith("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/job?")
    assert parse_backend_url(url)[1].params["master_name"] == "mymaster"


@pytest.mark.parametrize("run_id", ["../x", "a/b", ""])
def test_a_bad_rdzv_id_is_blamed_on_the_run_id_not_the_endpoint(run_id: str) -> None:
    """``--rdzv-id ../x`` with rdzv-file used to be reported as a bad directory (``path``)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_core import InvalidURLError
    from rdzv_core.torch_api.torchrun import handler_url

    params = RendezvousParameters(backend="rdzv-file", endpoint="/tmp/rdzv-x", run_id=run_id,
                                  min_nodes=1, max_nodes=1)
    with pytest.raises(InvalidURLError) as info:
        handler_url("file", params)
    assert info.value.field == "rdzv_id"


def test_torchrun_parameters_build_the_url_without_parsing_text() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_core import InvalidURLError
    from rdzv_core.torch_api.torchrun import rendezvous_url

    params = RendezvousParameters(backend="rdzv-redis", endpoint="u:p%40w@127.0.0.1,[::1]:7", run_id="job",
                                  min_nodes=1, max_nodes=2, db="3")
    url = rendezvous_url("redis", params)
    assert (url.hosts, url.username, url.password) == ((("127.0.0.1", 6379), ("::1", 7)), "u", "p@w")
    assert dict(url.params) == {"min_nodes": 1, "max_nodes": 2, "db": 3}
    params = RendezvousParameters(backend="rdzv-redis", endpoint="h:1/", run_id="job", min_nodes=1, max_nodes=1)
    assert rendezvous_url("redis", params).hosts == (("h", 1),)
    params = RendezvousParameters(backend="rdzv-redis", endpoint="h:1/x", run_id="job", min_nodes=1, max_nodes=1)
    with pytest.raises(InvalidURLError) as info:
        rendezvous_url("redis", params)
    assert info.value.field == "rdzv_endpoint"
    params = RendezvousParameters(backend="rdzv-file", endpoint="/tmp/a%20b/", run_id="job", min_nodes=1, max_nodes=1)
    assert rendezvous_url("file", params).path == "tmp/a%20b"  # the directory as given
    for endpoint in ("/tmp//x", "/tmp/../x"):
        params = RendezvousParameters(backend="rdzv-file", endpoint=endpoint, run_id="job", min_nodes=1, max_nodes=1)
        with pytest.raises(InvalidURLError) as info:
            rendezvous_url("file", params)
        assert info.value.field == "path"


WAITER = textwrap.dedent(
    """
    import os, pathlib, sys, time
    with open(sys.argv[1], "a") as f:
        f.write("started\\n")
    deadline = time.monotonic() + 300
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


@pytest.mark.slow
def test_torchrun_refused_for_its_settings_leaves_the_run_and_its_round_alone(tmp_path) -> None:
    """A torchrun node with ``--nnodes 1:1`` in a run created with ``1:2``: torch's launch_agent ends on the
    refusal (exit 1, torchrun's code for any error) and calls ``shutdown()``, which must not close the run;
    the member's workers are not restarted and its job ends with 0."""
    script, started, release = tmp_path / "waiter.py", tmp_path / "started", tmp_path / "release"
    script.write_text(WAITER)
    endpoint, run_id = str(tmp_path / "store"), f"tr{uuid.uuid4().hex[:8]}"

    def torchrun(nnodes: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
            "--rdzv-backend", "rdzv-file", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", "last_call_timeout=0.5,keep_alive_ttl=2,join_timeout=90", "--monitor-interval", "0.5",
            str(script), str(started), str(release),
        ]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    member = torchrun("1:2")
    procs = [member]
    try:
        eventually(started.exists, 120, "the member's worker to start", lambda: f"alive: {member.poll() is None}")
        refused = torchrun("1:1")
        procs.append(refused)
        _, err = refused.communicate(timeout=120)
        text = err.decode(errors="replace")
        assert refused.returncode == 1, text[-3000:]
        assert "max_nodes=1 differs from the run's max_nodes=2" in text, text[-3000:]
        assert not _run_is_closed("rdzv-file", endpoint, run_id)
        release.touch()
        _, err = member.communicate(timeout=120)
        assert member.returncode == 0, err.decode(errors="replace")[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    assert started.read_text() == "started\n"  # the member's workers ran once: no re-rendezvous
    assert _run_is_closed("rdzv-file", endpoint, run_id)  # the member closed it at its end, as always


def test_one_converter_serves_torchrun_and_rdzv_run() -> None:
    """``endpoint_url`` is the one flags-to-URL converter: a handler name or a scheme, the same endpoint and
    run-id rules; ``rdzv-run`` (no credentials on its command line) names its own options in the errors."""
    from rdzv_agent.launch.target import backend_url
    from rdzv_core.errors import ConfigError, InvalidURLError
    from rdzv_core.torch_api.torchrun import endpoint_url

    assert endpoint_url("rdzv-redis", "h:1", "job") == endpoint_url("redis", "h:1/", "job")
    assert endpoint_url("memory", "", "job").hosts[0][0] == "torchrun"
    assert endpoint_url("file", "/tmp/a b/", "job").path == "tmp/a b"
    assert backend_url("file", "/tmp/a b", "job") == "file:///tmp/a%20b/job"
    for backend, endpoint, run_id, field, flag in [
        ("Redis", "h:1", "job", "rdzv_backend", "--rdzv-backend"),
        ("redis", "h:1", "a?b", "rdzv_id", "--rdzv-id"),
        ("redis", "h:1/x", "job", "rdzv_endpoint", "--rdzv-endpoint"),
        ("file", "tmp/x", "job", "rdzv_endpoint", "--rdzv-endpoint"),
        ("redis", "h\x01:1", "job", "rdzv_endpoint", "--rdzv-endpoint"),
        ("redis", "h 1:1", "job", "host", "--rdzv-endpoint"),
    ]:
        with pytest.raises(InvalidURLError) as info:
            endpoint_url(backend, endpoint, run_id)
        assert info.value.field == field
        with pytest.raises(ConfigError) as flag_info:
            backend_url(backend, endpoint, run_id)
        assert flag_info.value.field == flag
    assert endpoint_url("redis", "u:pw@h:1", "job").password == "pw"
    with pytest.raises(InvalidURLError) as info:
        endpoint_url("redis", "u:pw@h:1", "job", credentials=False)
    assert info.value.field == "rdzv_endpoint" and "pw" not in str(info.value)
