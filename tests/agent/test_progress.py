"""Progress, hangs and metrics end to end: three real ``rdzv-run`` launchers over ``file://``.

One job (the fixture ``job`` starts it; one test drives it through three phases, each gated by files
the workers wait for):

1. nodes ``fast-a`` and ``fast-b`` report ~20 steps/s with nothing imported (they write the step to
   ``$RDZV_PROGRESS_FILE``); node ``slow`` reports a step every 0.5 s with ``rdzv_agent.progress.step``:
   ``rdzv status`` flags it a straggler (exit 0: healthy);
2. then ``slow`` stops in ``stuck_in_allreduce()``: ``rdzv status`` reports it hung (exit 1, degraded), its
   agent dumps the worker's stack (the dump names the function) and restarts it (a restart spent), and the
   other two re-form with it (a membership restart each);
3. in the second round every worker reports step 7: the Prometheus endpoints of two nodes, scraped over HTTP,
   show the rounds, the restarts by cause and the workers' last step; then every node exits 0.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import textwrap
import time
import urllib.request
from typing import Any, Iterator

import pytest

from tests.support.agent_workers.harness import Launcher
from tests.support.waiting import eventually
from conformance_tests.servers import free_port
from rdzv_admin import cli as admin_cli
from rdzv_core.rendezvous.progress_keys import NodeProgress
from rdzv_admin.progress_view import analyse, render

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

pytest.importorskip("torch")

ROLES = ("fast-a", "fast-b", "slow")
AGENT_HANG_TIMEOUT = 5.0
STATUS_HANG_TIMEOUT = 2.0

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    out, role = sys.argv[1], os.environ["NODE_ROLE"]
    rc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    def gate(name):
        return os.path.exists(os.path.join(out, name))

    with open(os.path.join(out, role + ".starts"), "a") as f:
        f.write(json.dumps({"rc": rc, "group_rank": int(os.environ["GROUP_RANK"]), "rank": int(os.environ["RANK"]),
                            "pid": os.getpid()}) + "\\n")
    if role == "slow":
        import rdzv_agent.progress
        report = rdzv_agent.progress.step
    else:  # nothing imported: the file protocol
        def report(n):
            with open(os.environ["RDZV_PROGRESS_FILE"], "w") as f:
                f.write(str(n))

    def stuck_in_allreduce():
        while True:
            time.sleep(0.5)

    starts = sum(1 for _ in open(os.path.join(out, role + ".starts")))
    if starts == 1:  # the first round
        n = 0
        while not (role == "slow" and gate("straggler_seen")):
            n += 1
            report(n)
            time.sleep(0.5 if role == "slow" else 0.05)
        stuck_in_allreduce()
    while not gate("finish"):  # later rounds: step 7, again and again (each rewrite is progress)
        report(7)
        time.sleep(0.2)
    """
)


def status(url: str, *options: str) -> tuple[int, Any]:
    """``rdzv status URL OPTIONS`` in this process: (exit code, stdout; parsed if JSON)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = admin_cli.main(["status", url, *options])
    text = out.getvalue()
    return code, json.loads(text) if "--json" in options and "--watch" not in options else text


def scrape(port: int) -> dict[str, float]:
    """The Prometheus text of ``http://127.0.0.1:PORT/metrics`` as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class Job:
    def __init__(self, tmp: str) -> None:
        self.out = tmp
        self.url = f"file://{tmp}/kv/progress-job?min_nodes=3&max_nodes=3&keep_alive_ttl=3&last_call_timeout=1"
        with open(os.path.join(tmp, "w.py"), "w") as f:
            f.write(WORKER)
        self.ports = {role: free_port() for role in ROLES}
        self.nodes = {role: Launcher(
            ["--rdzv", self.url, "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.2",
             "--hang-timeout", str(AGENT_HANG_TIMEOUT), "--metrics-port", str(self.ports[role]),
             "--log-dir", os.path.join(tmp, "logs", role), os.path.join(tmp, "w.py"), tmp],
            tmp, role, env={"NODE_ROLE": role, "RDZV_PROGRESS_INTERVAL": "0.3"}) for role in ROLES}

    def starts(self, role: str) -> list[dict]:
        path = os.path.join(self.out, f"{role}.starts")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def touch(self, name: str) -> None:
        open(os.path.join(self.out, name), "w").close()

    def tails(self) -> str:
        return "\n".join(node.tail() for node in self.nodes.values())


@pytest.fixture
def job(tmp_path) -> Iterator[Job]:
    running = Job(str(tmp_path))
    try:
        yield running
    finally:
        for node in running.nodes.values():
            node.kill_all()


@pytest.mark.slow
def test_straggler_then_hang_reported_dumped_restarted_and_scraped(job: Job) -> None:
    """The three phases of the module docstring, in order, on one job (one test: xdist keeps it whole)."""
    a_slow_node_is_flagged_as_a_straggler_and_the_view_is_worst_first(job)
    a_hung_worker_is_reported_dumped_and_restarted(job)
    metrics_endpoint_shows_rounds_restarts_and_last_steps(job)


def a_slow_node_is_flagged_as_a_straggler_and_the_view_is_worst_first(job: Job) -> None:
    eventually(lambda: all(job.starts(r) for r in ROLES), 120, "every node started its first worker")
    slow = job.starts("slow")[0]["group_rank"]
    options = ("--json", "--hang-timeout", str(STATUS_HANG_TIMEOUT), "--straggler-steps", "20",
               "--straggler-seconds", "1000")

    def straggling() -> Any:
        code, state = status(job.url, *options)
        summary = state.get("progress", {}).get("summary", {})
        return (code, state) if summary.get("reporting") == 3 and summary.get("stragglers") == [slow] else None

    code, state = eventually(straggling, 60, "the slow node flagged as a straggler")
    assert code == 0 and state["verdict"] == "healthy"  # a straggler is not a failure
    rows = state["progress"]["ranks"]
    assert rows[0]["rank"] == slow and rows[0]["straggler"] and not rows[0]["hung"]  # worst first
    assert all(row["step"] > rows[0]["step"] + 20 for row in rows[1:])
    assert {row["host"] for row in rows} == {os.uname().nodename}
    assert all(row["keep_alive_age"] is not None and row["keep_alive_age"] <= 3 for row in rows)
    # --watch: one JSON object per view, as many views as --count
    code, text = status(job.url, "--watch", "--count", "2", "--interval", "0.1", "--json", *options[1:])
    views = [json.loads(line) for line in text.splitlines()]
    assert code == 0 and len(views) == 2 and all(v["progress"]["summary"]["stragglers"] == [slow] for v in views)
    job.touch("straggler_seen")


def a_hung_worker_is_reported_dumped_and_restarted(job: Job) -> None:
    slow = job.starts("slow")[0]["group_rank"]

    def hung() -> Any:
        code, state = status(job.url, "--json", "--hang-timeout", str(STATUS_HANG_TIMEOUT))
        return (code, state) if state.get("progress", {}).get("summary", {}).get("hung") == [slow] else None

    code, state = eventually(hung, 30, "rdzv status reporting the slow node hung", every=0.1)
    assert code == 1 and state["verdict"] == "degraded"
    assert state["progress"]["ranks"][0]["rank"] == slow and state["progress"]["ranks"][0]["hung"]
    # its agent (--hang-timeout 5) dumps the stack and spends a restart; the other two re-form with it
    eventually(lambda: len(job.starts("slow")) == 2, 90, "the slow node's second worker")
    assert job.starts("slow")[1]["rc"] == 1  # TORCHELASTIC_RESTART_COUNT: a restart was spent
    dumps = glob.glob(os.path.join(job.out, "logs", "slow", "*", "attempt_0", "0", "stacks.log"))
    assert len(dumps) == 1, glob.glob(os.path.join(job.out, "logs", "slow", "**"), recursive=True)
    with open(dumps[0]) as f:
        dump = f.read()
    # the hung function and its file, in faulthandler's ("File ".../w.py", line 22 in stuck_in_allreduce")
    # or py-spy's ("stuck_in_allreduce (w.py:22)") format, whichever the agent found
    assert re.search(r"w\.py.*\bstuck_in_allreduce\b|\bstuck_in_allreduce \(w\.py:\d+\)", dump), dump
    for role in ("fast-a", "fast-b"):  # membership restarts: none spent
        eventually(lambda role=role: len(job.starts(role)) == 2, 90, f"{role}'s second worker")
        assert job.starts(role)[1]["rc"] == 0
        assert not glob.glob(os.path.join(job.out, "logs", role, "*", "*", "*", "stacks.log"))


def metrics_endpoint_shows_rounds_restarts_and_last_steps(job: Job) -> None:
    eventually(lambda: all(len(job.starts(r)) == 2 for r in ROLES), 90, "every node in the second round")
    expected = {"slow": {"hang": 1, "failure": 0, "membership": 0},
                "fast-a": {"hang": 0, "failure": 0, "membership": 1}}
    for role, causes in expected.items():
        rank = job.starts(role)[1]["rank"]
        step = f'rdzv_worker_last_step{{global_rank="{rank}",local_rank="0"}}'
        values = eventually(lambda: (v := scrape(job.ports[role])).get(step) == 7 and v, 30,
                            f"{role}'s metrics with step 7")
        assert values["rdzv_rounds_total"] == 2
        assert values["rdzv_rendezvous_duration_seconds_count"] == 2
        assert values["rdzv_group_world_size"] == 3 and values["rdzv_world_size"] == 3
        for cause, count in causes.items():
            assert values[f'rdzv_restarts_total{{cause="{cause}"}}'] == count, (role, cause)
        assert values['rdzv_backend_request_seconds_count{op="put"}'] > 0
        assert values["rdzv_keepalive_refresh_seconds_count"] > 0
        assert "rdzv_keepalive_lapses_total" in values and "rdzv_keepalive_refresh_errors_total" in values
        assert time.time() - 30 < values[f'rdzv_worker_last_progress_timestamp_seconds{{global_rank="{rank}",'
                                         f'local_rank="0"}}'] <= time.time()

    def all_at_seven() -> Any:
        code, state = status(job.url, "--json", "--hang-timeout", str(STATUS_HANG_TIMEOUT))
        return (code, state) if [r["step"] for r in state.get("progress", {}).get("ranks", [])] == [7, 7, 7] else None

    code, state = eventually(all_at_seven, 30, "every node at step 7 in rdzv status")
    assert code == 0 and state["verdict"] == "healthy" and state["progress"]["summary"]["hung"] == []
    job.touch("finish")
    for node in job.nodes.values():
        assert node.wait(60) == 0, job.tails()


def test_the_text_view_of_a_thousand_nodes_is_summarised_worst_first() -> None:
    now = 1_000_000.0
    records = [NodeProgress(r, f"node{r}", f"n{r}", now, 60.0, {8 * r: (500 + r % 3, now - 1.0)})
               for r in range(1000)]
    records[417] = NodeProgress(417, "node417", "n417", now, 60.0, {3336: (480, now - 90.0)})  # hung
    records[42] = NodeProgress(42, "node42", "n42", now, 60.0, {336: (300, now - 2.0)})  # behind
    members = [{"rank": r, "host": f"node{r}", "keep_alive_age": 1.0} for r in range(1001)]  # 1000: silent
    view = analyse(records, members, 1001, steps=10, seconds=30, now=now)
    assert view["summary"]["hung"] == [417] and view["summary"]["stragglers"] == [42]
    assert view["summary"]["not_reporting"] == [1000] and view["summary"]["median_step"] == 501
    lines = render(view, limit=10)
    assert len(lines) <= 16  # summary, HUNG, STRAGGLERS, silent, header, 10 rows, "... more"
    rows = [line.split() for line in lines if line.startswith("  ") and line.split()[0].isdigit()]
    assert [row[0] for row in rows[:2]] == ["417", "42"] and len(rows) == 10
    assert "990 more" in lines[-1]


def test_a_hang_timeout_shorter_than_the_publish_interval_flags_only_nodes_that_made_no_progress() -> None:
    """Agents publish every RDZV_PROGRESS_INTERVAL (5 s): between publications a record ages. With
    ``--hang-timeout 3`` a node stepping every 0.2 s was flagged HUNG (exit 1) for part of every interval
    (fresh-user trial); the hang is judged at the publication: no progress for longer than the timeout
    *then*."""
    now = 1_000_000.0
    busy = NodeProgress(0, "a", "a", now - 4.5, 3.0, {0: (98, now - 4.6)})  # stepping when published 4.5 s ago
    stuck = NodeProgress(1, "b", "b", now - 0.5, 3.0, {1: (40, now - 4.0)})  # silent 3.5 s when published
    members = [{"rank": r, "host": h, "keep_alive_age": 1.0} for r, h in ((0, "a"), (1, "b"))]
    view = analyse([busy, stuck], members, 2, now=now)
    assert view["summary"]["hung"] == [1]
    assert analyse([busy, stuck], members, 2, hang_timeout=5.0, now=now)["summary"]["hung"] == []


@pytest.mark.parametrize("argv, env, named", [
    (["--hang-timeout", "0"], {}, "--hang-timeout"),
    (["--metrics-port", "70000"], {}, "--metrics-port"),
    ([], {"RDZV_METRICS_PORT": "http"}, "RDZV_METRICS_PORT"),
    ([], {"RDZV_PROGRESS_INTERVAL": "-1"}, "RDZV_PROGRESS_INTERVAL"),
])
def test_bad_values_are_usage_errors_naming_them(monkeypatch, capsys, tmp_path, argv: list[str], env: dict[str, str],
                                                  named: str) -> None:
    from rdzv_agent.launch import launcher

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "ok.py").write_text("")
    try:
        code = launcher.main(["--standalone", *argv, str(tmp_path / "ok.py")])
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2 and named in capsys.readouterr().err


def test_a_taken_metrics_port_is_a_usage_error(capsys, tmp_path) -> None:
    import socket

    from rdzv_agent.launch import launcher

    (tmp_path / "ok.py").write_text("")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert launcher.main(["--standalone", "--metrics-port", str(port), str(tmp_path / "ok.py")]) == 2
    assert f"--metrics-port {port}" in capsys.readouterr().err


def test_rdzv_status_bad_thresholds_are_usage_errors(capsys) -> None:
    for option in ("--hang-timeout", "--straggler-steps", "--count"):
        with pytest.raises(SystemExit) as exit_info:
            admin_cli.main(["status", "memory://x/run", option, "-1"])
        assert exit_info.value.code == 2 and option in capsys.readouterr().err


STOPPED_WORKER = textwrap.dedent(
    """\
    import json, os, sys, time
    spawned = time.time()  # before the imports: rdzv_agent imports torch (seconds of CPU on a loaded host)
    from rdzv_agent import progress

    out = sys.argv[1]
    with open(os.path.join(out, f"start.{os.environ['LOCAL_RANK']}.{os.getpid()}"), "w") as f:
        json.dump({"restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "t": spawned}, f)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        sys.exit(0)
    n = 0
    while True:
        n += 1
        progress.step(n)
        time.sleep(0.05)
    """
)


def test_stopped_workers_are_restarted_within_the_hang_timeout_not_a_dump_wait_each(tmp_path) -> None:
    """Both workers of a node frozen by SIGSTOP (as a frozen cgroup): the agent cannot get their stacks; it
    must say so and restart the group about ``--hang-timeout`` after their last step. Before, it waited 10 s
    for each stopped worker's faulthandler dump in turn (23 s for two, 80 s for eight; fresh-user trial)."""
    import signal

    out = str(tmp_path)
    script = os.path.join(out, "w.py")
    with open(script, "w") as f:
        f.write(STOPPED_WORKER)
    url = f"file://{out}/kv/stopped?min_nodes=1&max_nodes=1&keep_alive_ttl=3"
    node = Launcher(["--rdzv", url, "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
                     "--hang-timeout", "2", "--shutdown-timeout", "1", "--log-dir", os.path.join(out, "logs"),
                     script, out], out, "node", env={"RDZV_PROGRESS_INTERVAL": "0.3"})

    def starts(restart: int) -> dict[int, float]:
        found = {}
        for name in os.listdir(out):
            if name.startswith("start."):
                _, lr, pid = name.split(".")
                with open(os.path.join(out, name)) as f:
                    record = json.load(f)
                if record["restart"] == restart:
                    found[int(pid)] = record["t"]
        return found

    try:
        first = eventually(lambda: len(starts(0)) == 2 and starts(0), 60, "both workers started")
        time.sleep(0.5)  # a few steps each
        for pid in first:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        second = eventually(lambda: len(starts(1)) == 2 and starts(1), 60, "the restarted workers", every=0.05)
        # hang timeout + shutdown + the new workers' spawn (their "t" is taken before their imports); the 10 s wait
        # for each stopped worker's dump this guards against gave 26.5 s
        assert min(second.values()) - stopped < 2 + 10, f"restarted {min(second.values()) - stopped:.1f} s after"
        assert node.wait(30) == 0, node.tail()
    finally:
        node.kill_all()


def test_step_takes_numpy_and_tensor_integers_and_a_bad_progress_file_does_not_end_the_training(tmp_path) -> None:
    """``step(global_step)`` with a numpy integer or an integer 0-d tensor counts (it raised TypeError); a
    float is refused only under rdzv-run; a progress file that cannot be opened is one warning, not a crash
    (it raised FileNotFoundError into the training loop). Fresh-user trial."""
    import subprocess
    import sys

    code = textwrap.dedent("""\
        import sys, numpy
        from rdzv_agent import progress
        progress.step(numpy.int64(5)); print(open(sys.argv[1]).read().split()[0] if sys.argv[1] else "-")
        if sys.argv[1]:  # torch only where the value is read back (its import is slow)
            import torch
            progress.step(torch.tensor(6)); print(open(sys.argv[1]).read().split()[0])
        else:
            progress.step(6); print("-")
        try:
            progress.step(5.0)
            print("float taken")
        except TypeError:
            print("float refused")
        """)
    path = str(tmp_path / "progress")

    def run(progress_file: str, shown: str) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "RDZV_PROGRESS_FILE"}
        if progress_file:
            env["RDZV_PROGRESS_FILE"] = progress_file
        done = subprocess.run([sys.executable, "-W", "always", "-c", code, shown], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split("\n")[:3] + [done.stderr]

    assert run(path, path)[:3] == ["5", "6", "float refused"]
    assert run("", "")[:3] == ["-", "-", "float taken"]  # not under rdzv-run: nothing happens
    broken = run(str(tmp_path / "missing" / "progress"), "")
    assert broken[:3] == ["-", "-", "float taken"] and "RuntimeWarning" in broken[3]
