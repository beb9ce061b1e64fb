"""Log specs under real ``rdzv-run`` launchers: ``--local-ranks-filter``, the duplicate filters,
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, ``--logs-specs`` entry points and the
``attempt_N/LOCAL_RANK/`` layout, each checked on what reaches the console and the files."""

from __future__ import annotations

import glob
import json
import os
import re
import textwrap
import uuid

import pytest

from tests.support.agent_workers.harness import HERE, Launcher, kill_run

from tests.support.waiting import eventually

pytestmark = [pytest.mark.agent_scenario, pytest.mark.launchers]  # over file:// and redis:// only (tests/conftest.py)

LOG_WORKER = os.path.join(HERE, "log_worker.py")


@pytest.fixture
def run(tmp_path):
    """``run(*flags, nproc=2, env=None, worker_args=())`` -> (exit code, stdout, stderr) of a standalone
    ``rdzv-run`` of :data:`LOG_WORKER` with ``--log-dir TMP/logs``."""
    launchers: list[Launcher] = []

    def start(*flags: str, nproc: int = 2, env: dict[str, str] | None = None,
              worker_args: tuple[str, ...] = ()) -> tuple[int, str, str]:
        argv = ["--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1",
                "--log-dir", str(tmp_path / "logs"), *flags, LOG_WORKER, "--out", str(tmp_path / "out"), *worker_args]
        launcher = Launcher(argv, str(tmp_path), f"l{len(launchers)}", env=env)
        launchers.append(launcher)
        code = launcher.wait(180)
        return code, launcher.stdout(), launcher.stderr()

    yield start
    kill_run(launchers, [])


@pytest.fixture
def node_url(rdzv_base_url, rdzv_url):
    """``node_url(run_id)`` -> URL of a fresh run on the backend under test (launchers are processes)."""
    if rdzv_base_url.startswith("memory://"):
        pytest.skip("memory:// is in-process; launchers are separate processes")
    return lambda run_id: rdzv_url(run_id=run_id, last_call_timeout="0.5", keep_alive_ttl="2", timeout="60")


def _attempt(tmp_path, n: int = 0, root: str = "logs") -> str:
    (run_dir,) = glob.glob(str(tmp_path / root / "*_*"))
    return os.path.join(run_dir, f"attempt_{n}")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_local_ranks_filter_limits_the_console_not_the_files(run, tmp_path) -> None:
    code, out, err = run("--tee", "3", "--local-ranks-filter", "0,2", nproc=3)
    assert code == 0, err[-3000:]
    shown_out = set(re.findall(r"^\[default(\d)\]:out plain", out, re.MULTILINE))
    shown_err = set(re.findall(r"^\[default(\d)\]:err plain", err, re.MULTILINE))
    assert shown_out == shown_err == {"0", "2"}
    for lr in "012":  # tee'd files of every rank, the hidden one too
        assert f"out plain L={lr}" in _read(os.path.join(_attempt(tmp_path), lr, "stdout.log"))
        assert f"err plain L={lr}" in _read(os.path.join(_attempt(tmp_path), lr, "stderr.log"))


def test_local_ranks_filter_without_tee_hides_the_other_ranks(run, tmp_path) -> None:
    """Hidden ranks reach no console; their stderr is still kept in ``stderr.log`` (for error reports)."""
    code, out, err = run("--local-ranks-filter", "1", nproc=3)
    assert code == 0, err[-3000:]
    assert set(re.findall(r"out plain L=(\d)", out)) == {"1"}
    assert set(re.findall(r"err plain L=(\d)", err)) == {"1"}
    assert "err plain L=0" in _read(os.path.join(_attempt(tmp_path), "0", "stderr.log"))


def test_prefix_template_replaces_the_role_prefix(run) -> None:
    template = "<${role_name}|${rank}|${local_rank}|${other}> "
    code, out, err = run("--tee", "3", "--role", "trainer", nproc=2,
                         env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": template})
    assert code == 0, err[-3000:]
    for lr in "01":  # one node: global rank == local rank; unknown fields stay as written
        assert f"<trainer|{lr}|{lr}|${{other}}> out plain L={lr}" in out.splitlines()
        assert f"<trainer|{lr}|{lr}|${{other}}> err plain L={lr}" in err.splitlines()
    assert "[trainer" not in out + err


def test_duplicate_filters_copy_matching_teed_lines(run, tmp_path) -> None:
    """As torch: lines of tee'd ranks shown on the console that contain a needle, with their prefix,
    in ``attempt_N/filtered_std{out,err}.log``; ``,,`` is a literal comma."""
    code, _, err = run("--tee", "3", "--local-ranks-filter", "0,1", "--duplicate-stdout-filters", "apple,kiwi",
                       "--duplicate-stderr-filters", "orange,,never,orange", nproc=3)
    assert code == 0, err[-3000:]
    lines = sorted(_read(os.path.join(_attempt(tmp_path), "filtered_stdout.log")).splitlines())
    assert lines == [f"[default{lr}]:out apple R={lr} L={lr} C=0" for lr in "01"]
    lines = sorted(_read(os.path.join(_attempt(tmp_path), "filtered_stderr.log")).splitlines())
    assert lines == [f"[default{lr}]:err orange L={lr}" for lr in "01"]


def test_attempt_directories_follow_the_restart_count(run, tmp_path) -> None:
    """``LOG_DIR/RUN_ID_xxxx/attempt_N/LOCAL_RANK/``, N = TORCHELASTIC_RESTART_COUNT; the error
    file each worker is given lies there."""
    code, _, err = run("--redirects", "3", "--max-restarts", "1", nproc=2, worker_args=("--fail-first",))
    assert code == 0, err[-3000:]
    (run_dir,) = glob.glob(str(tmp_path / "logs" / "*_*"))
    assert sorted(os.listdir(run_dir)) == ["attempt_0", "attempt_1"]
    for path in glob.glob(str(tmp_path / "out" / "*.json")):
        with open(path) as f:
            rec = json.load(f)
        lr = os.path.basename(path).split("-")[0]
        assert rec["error_file"] == os.path.join(run_dir, f"attempt_{rec['count']}", lr, "error.json")
        assert f"C={rec['count']}" in _read(os.path.join(run_dir, f"attempt_{rec['count']}", lr, "stdout.log"))


_SPEC_MODULE = textwrap.dedent(
    """
    import os
    from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

    class FlatLogsSpecs(LogsSpecs):
        '''Every file of every attempt flat in LOG_DIR/flat/, named by rank and restart count.'''

        @property
        def root_log_dir(self):
            return str(self._root_log_dir)

        def reify(self, envs):
            flat = os.path.join(self._root_log_dir, "flat")
            os.makedirs(flat, exist_ok=True)
            dest = LogsDest()
            for lr, env in envs.items():
                name = os.path.join(flat, f"r{env['RANK']}.c{env['TORCHELASTIC_RESTART_COUNT']}")
                dest.stdouts[lr], dest.stderrs[lr] = name + ".out", name + ".err"
                dest.tee_stdouts[lr] = name + ".out"
                dest.error_files[lr] = name + ".json"
                env["TORCHELASTIC_ERROR_FILE"] = name + ".json"
            dest.filtered_stdout = os.path.join(flat, "filtered.out")
            dest.filtered_stderr = os.path.join(flat, "filtered.err")
            return dest
    """
)


def test_logs_specs_entry_point_places_the_files(run, tmp_path) -> None:
    """A ``torchrun.logs_specs`` entry point of a distribution on the path is what places the files."""
    site = tmp_path / "site"
    dist_info = site / "flatlogs-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (site / "flatlogs.py").write_text(_SPEC_MODULE)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: flatlogs\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[torchrun.logs_specs]\nflat = flatlogs:FlatLogsSpecs\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    code, out, err = run("--logs-specs", "flat", "--duplicate-stdout-filters", "apple", nproc=2, env=env)
    assert code == 0, err[-3000:]
    flat = tmp_path / "logs" / "flat"
    assert sorted(os.listdir(flat)) == ["filtered.out", "r0.c0.err", "r0.c0.out", "r1.c0.err", "r1.c0.out"]
    assert _read(str(flat / "r1.c0.err")) == "err orange L=1\nerr plain L=1\n"
    assert "[default1]:out plain L=1" in out.splitlines()  # the spec tees stdout
    assert sorted(_read(str(flat / "filtered.out")).splitlines()) == [
        f"[default{r}]:out apple R={r} L={r} C=0" for r in "01"]
    errors = {json.loads(_read(p))["error_file"] for p in glob.glob(str(tmp_path / "out" / "*.json"))}
    assert errors == {str(flat / "r0.c0.json"), str(flat / "r1.c0.json")}
    assert not glob.glob(str(tmp_path / "logs" / "*_*"))  # no default layout beside it


def test_logs_specs_default_is_torchs(run, tmp_path) -> None:
    code, _, err = run("--logs-specs", "default", "--redirects", "1", nproc=1)
    assert code == 0, err[-3000:]
    assert "out plain L=0" in _read(os.path.join(_attempt(tmp_path), "0", "stdout.log"))


@pytest.mark.parametrize("flags, env, named", [
    (["--local-ranks-filter", "0,x"], {}, "--local-ranks-filter"),
    (["--local_ranks_filter", ""], {"PET_LOCAL_RANKS_FILTER": "1;2"}, None),  # the flag wins: no error
    ([], {"PET_LOCAL_RANKS_FILTER": "-1"}, "PET_LOCAL_RANKS_FILTER"),
    (["--logs-specs", f"missing{uuid.uuid4().hex[:6]}"], {}, "--logs-specs"),
    # a local rank this node does not have (torch accepts it: the typo hides every worker's output)
    (["--local-ranks-filter", "5"], {}, "--local-ranks-filter"),
    (["--tee", "5:1"], {}, "--tee"),
    (["--redirects", "0:1,3:2"], {}, "--redirects"),
    ([], {"PET_LOCAL_RANKS_FILTER": "4"}, "PET_LOCAL_RANKS_FILTER"),
])
def test_bad_log_options_fail_fast_naming_the_option(run, flags, env, named) -> None:
    code, _, err = run(*flags, nproc=1, env=env)
    if named is None:
        assert code == 0, err[-3000:]
        return
    assert code == 2 and named in err and "unrecognized" not in err, err  # known option, bad value


def test_membership_restart_keeps_the_earlier_logs(node_url, tmp_path) -> None:
    """A second node joins a running one: its workers restart with the same restart count, and the
    first start's logs survive as ``attempt_0.1`` (torch's ``DefaultLogsSpecs`` deletes them)."""
    run_id = f"logs{uuid.uuid4().hex[:8]}"
    url = node_url(run_id)
    gate = str(tmp_path / "go")
    common = ["--rdzv", url, "--nnodes", "1:2", "--nproc-per-node", "1", "--monitor-interval", "0.1",
              "--redirects", "3", LOG_WORKER, "--out", str(tmp_path / "out"), "--wait-for", gate]
    first = Launcher(["--log-dir", str(tmp_path / "a"), *common], str(tmp_path), "a")
    second = None
    try:
        eventually(lambda: glob.glob(str(tmp_path / "a" / "*_*" / "attempt_0" / "0")), 240, "node a's first workers")
        second = Launcher(["--log-dir", str(tmp_path / "b"), *common], str(tmp_path), "b")
        eventually(lambda: glob.glob(str(tmp_path / "a" / "*_*" / "attempt_0.1")), 240, "node a's restart")
        open(gate, "w").close()
        assert first.wait(240) == 0, first.tail()
        assert second.wait(240) == 0, second.tail()
    finally:
        kill_run([first] + ([second] if second else []), [run_id])
    (run_dir,) = glob.glob(str(tmp_path / "a" / "*_*"))
    assert sorted(os.listdir(run_dir)) == ["attempt_0", "attempt_0.1"]
    assert os.path.isfile(os.path.join(run_dir, "attempt_0.1", "0", "stdout.log"))
    assert "C=0" in _read(os.path.join(run_dir, "attempt_0", "0", "stdout.log"))


def test_files_land_where_torchrun_puts_them(tmp_path) -> None:
    """The same job under ``torchrun`` and ``rdzv-run``: every file torchrun writes under its run
    directory (``attempt_N/LOCAL_RANK/std*.log``, ``attempt_N/filtered_stdout.log``) is written by
    ``rdzv-run`` at the same relative path with the same lines (``rdzv-run`` adds its own
    ``stderr.log`` copies, for its error reports)."""
    flags = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", "--max-restarts", "1",
             "--redirects", "0:3", "--tee", "1:1", "--local-ranks-filter", "1", "--duplicate-stdout-filters", "apple"]
    trees = {}
    for name, module in (("torchrun", "torch.distributed.run"), ("rdzv", "rdzv_agent.launch.launcher")):
        logs = tmp_path / f"logs-{name}"
        launcher = Launcher([*flags, "--log-dir", str(logs), LOG_WORKER, "--out", str(tmp_path / f"out-{name}"),
                             "--fail-first"], str(tmp_path), name, module=module)
        try:
            assert launcher.wait(180) == 0, launcher.tail()
        finally:
            kill_run([launcher], [])
        (run_dir,) = glob.glob(str(logs / "*_*"))
        trees[name] = {os.path.relpath(p, run_dir): sorted(_read(p).splitlines())
                       for p in glob.glob(os.path.join(run_dir, "**", "*"), recursive=True) if os.path.isfile(p)}
    assert "attempt_1/filtered_stdout.log" in trees["torchrun"]
    assert {k: trees["rdzv"].get(k) for k in trees["torchrun"]} == trees["torchrun"]
