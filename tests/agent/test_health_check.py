"""The health check on ``TORCHELASTIC_HEALTH_CHECK_PORT``: real ``rdzv-run`` launchers, real workers, HTTP answers.

torch's own server is a no-op in open source, so nothing here can pass before
:mod:`rdzv_agent.supervision.health`: every test needs an answer on the port (or an exit 2 naming
the variable).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tests.support.agent_workers.harness import Launcher

from tests.support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.launchers]
pytest.importorskip("torch")

PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"
TIMEOUT_ENV = "RDZV_HEALTH_CHECK_TIMEOUT"

# attempt = TORCHELASTIC_RESTART_COUNT; writes ready_<attempt>_<local rank>, then waits for go_<attempt>.
# Attempt 0: local rank 1 exits 3 once `fail` exists; local rank 0 ignores SIGTERM (a stop that hangs).
WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    out = sys.argv[1]
    attempt, lr = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
    if os.environ.get("IGNORE_TERM") == lr and attempt == "0":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(out, f"ready_{attempt}_{lr}"), "w").close()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(out, f"go_{attempt}")):
            sys.exit(0)
        if lr == "1" and attempt == "0" and os.path.exists(os.path.join(out, "fail")):
            sys.exit(3)
        time.sleep(0.05)
    sys.exit(4)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe(port: int) -> tuple[int, dict] | None:
    """``(status, JSON body)`` of ``GET /healthz``, or ``None`` if nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return None


def answered(port: int, code: int, **fields: object):
    """A predicate: the probe answers ``code`` with ``fields``; returns the body."""

    def check() -> dict | None:
        got = probe(port)
        if got is None or got[0] != code or any(got[1].get(k) != v for k, v in fields.items()):
            return None
        return got[1]

    return check


@pytest.fixture
def launch(tmp_path):
    started: list[Launcher] = []

    def start(argv: list[str], env: dict[str, str]) -> Launcher:
        launcher = Launcher(argv, str(tmp_path), f"node{len(started)}", env=env)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill_all()


def test_200_while_training_with_state_and_gone_after_exit(launch, tmp_path) -> None:
    port = free_port()
    (tmp_path / "w.py").write_text(WORKER)
    node = launch(["--standalone", "--nproc-per-node", "1", "--monitor-interval", "0.2",
                   str(tmp_path / "w.py"), str(tmp_path)], {PORT_ENV: str(port), TIMEOUT_ENV: "5"})
    eventually(lambda: (tmp_path / "ready_0_0").exists(), 120, "the worker", node.tail)
    body = eventually(answered(port, 200, state="HEALTHY", step="monitor"), 30, "200 from the health check",
                      node.tail)
    assert body["status"] == "ok" and body["group_rank"] == 0 and body["restart_count"] == 0
    assert body["rendezvous_count"] == 1 and body["round"] >= 1 and body["timeout"] == 5.0
    assert 0 <= body["seconds_since_progress"] < 5
    # HEAD and any path: what a liveness probe sends
    req = urllib.request.Request(f"http://127.0.0.1:{port}/", method="HEAD")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
    (tmp_path / "go_0").touch()
    assert node.wait(120) == 0, node.tail()
    assert probe(port) is None  # the port is closed with the launcher


def test_503_while_a_stop_hangs_then_200_after_the_restart(launch, tmp_path) -> None:
    """The monitor loop is stuck stopping a worker that ignores SIGTERM (--shutdown-timeout 15):
    no progress for longer than the 1.5 s timeout -> 503; after the SIGKILL and the restart, 200 again."""
    port = free_port()
    (tmp_path / "w.py").write_text(WORKER)
    node = launch(["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.2", "--max-restarts", "1",
                   "--shutdown-timeout", "15", str(tmp_path / "w.py"), str(tmp_path)],
                  {PORT_ENV: str(port), TIMEOUT_ENV: "1.5", "IGNORE_TERM": "0"})
    eventually(lambda: (tmp_path / "ready_0_0").exists() and (tmp_path / "ready_0_1").exists(), 120,
               "the workers", node.tail)
    eventually(answered(port, 200, state="HEALTHY"), 30, "200 while training", node.tail)
    (tmp_path / "fail").touch()
    failed_at = time.monotonic()
    body = eventually(answered(port, 503), 14, "503 while the stop hangs", node.tail)
    assert body["status"] == "stalled" and body["step"] == "restarting" and body["seconds_since_progress"] > 1.5
    assert time.monotonic() - failed_at < 15  # still inside the hung stop
    assert not (tmp_path / "ready_1_0").exists()
    eventually(lambda: (tmp_path / "ready_1_0").exists() and (tmp_path / "ready_1_1").exists(), 120,
               "the restarted workers", node.tail)
    body = eventually(answered(port, 200, restart_count=1, state="HEALTHY"), 30, "200 after the restart", node.tail)
    assert body["rendezvous_count"] == 2
    (tmp_path / "go_1").touch()
    assert node.wait(120) == 0, node.tail()


def test_503_while_the_rendezvous_backend_does_not_answer(launch, tmp_path) -> None:
    """A backend that accepts connections and never answers (a listening socket nobody reads):
    the server is up before the rendezvous and turns 503 once nothing progressed for 1.5 s."""
    port = free_port()
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        url = f"redis://127.0.0.1:{hole.getsockname()[1]}/bh{uuid.uuid4().hex[:8]}?operation_timeout=120"
        (tmp_path / "w.py").write_text(WORKER)
        node = launch(["--rdzv", url, "--nnodes", "1", "--nproc-per-node", "1", str(tmp_path / "w.py"),
                       str(tmp_path)], {PORT_ENV: str(port), TIMEOUT_ENV: "1.5"})
        body = eventually(answered(port, 503), 90, "503 while the backend is silent", node.tail)
        assert body["status"] == "stalled" and body["state"] == "INIT" and body["rendezvous_count"] == 0
        assert node.proc.poll() is None  # the launcher is still waiting on the backend
        assert not (tmp_path / "ready_0_0").exists()


def run_launcher(env: dict[str, str], tmp_path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "ok.py").write_text("pass\n")
    return subprocess.run([sys.executable, "-m", "rdzv_agent.launch.launcher", "--standalone", str(tmp_path / "ok.py")],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("value", ["abc", "0", "70000", "-"])
def test_bad_port_is_a_usage_error_naming_the_variable(tmp_path, value) -> None:
    done = run_launcher({PORT_ENV: value}, tmp_path)
    assert done.returncode == 2, done.stderr
    assert PORT_ENV in done.stderr and repr(value) in done.stderr


def test_an_empty_port_is_no_health_check_as_in_torch(tmp_path) -> None:
    """An empty ``TORCHELASTIC_HEALTH_CHECK_PORT`` means unset (torchrun ignores it too), like the empty
    ``TORCHELASTIC_ENABLE_FILE_TIMER`` and stuck-check timeout; it was exit 2."""
    done = run_launcher({PORT_ENV: ""}, tmp_path)
    assert done.returncode == 0, done.stderr


def test_bad_timeout_is_a_usage_error_naming_the_variable(tmp_path) -> None:
    done = run_launcher({PORT_ENV: str(free_port()), TIMEOUT_ENV: "-1"}, tmp_path)
    assert done.returncode == 2, done.stderr
    assert TIMEOUT_ENV in done.stderr and "'-1'" in done.stderr


def test_port_taken_is_a_usage_error_naming_the_variable_and_port(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = run_launcher({PORT_ENV: str(port)}, tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"{PORT_ENV}={port}" in done.stderr
