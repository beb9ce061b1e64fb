"""Warm workers (:mod:`rdzv_agent.workers.warm`, on by default) start the same workers a cold start does.

Real ``rdzv-run`` launchers (``--standalone``) run ``agent_workers/warm_probe.py`` cold and warm, from the same
directory with the same flags, and the tests compare what the workers saw (``sys.argv``, the environment but
for per-run values, ``__main__``, ``sys.path[0]``, cwd, pickling, signal dispositions, session, parent-death
signal, scheduling, fds), how they ended (the launcher's failure lines: exit codes 1 and 3, a signal), the
error file of ``@record``, tracebacks and output in the log files and on the console. Warm runs must have
run every attempt in a warm process, restarts included. No warm process may outlive its launcher: normal
exit, SIGTERM, ``kill -9``. A warm import that fails is a WARNING and a cold start. By default (no flag) a
script runs warm unless it changes what ``import torch`` reads before importing it
(:mod:`rdzv_agent.workers.warm_check`); then every attempt is cold.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import sys

import psutil
import pytest

from tests.support.agent_workers.harness import HERE, Launcher

from tests.support.waiting import eventually
from rdzv_agent.launch.args import parse_args
from rdzv_agent.launch.config import build_config
from rdzv_agent.workers.warm import WarmProcess, boot_argv
from rdzv_core.errors import ConfigError

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

PROBE = os.path.join(HERE, "warm_probe.py")
#: Environment variables whose values differ between two runs (ports, run ids, per-run paths).
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "RDZV_REAPER_TOKEN",
           "RDZV_PROGRESS_FILE", "RDZV_STACK_FILE", "TORCHELASTIC_TIMER_FILE", "WARM_PROBE_OUT"}
#: Report fields that differ between any two processes.
PER_PROCESS = {"pid", "create_time", "warm"}
#: Seconds a warm process may outlive its launcher.
GONE_WITHIN = 2.0
RUN_WITHIN = 120.0


def _run(tmp_path, name, argv, *, warm, env=None, wait=True):
    """A standalone launcher: ``warm`` True (``--warm-workers``), False (``--no-warm-workers``) or None (neither:
    the default); the next warm generation is started as soon as the workers run (``RDZV_WARM_AFTER=0``). Every
    launcher is the same node (``RDZV_NODE_NAME``): the workers' environments are compared."""
    out = tmp_path / f"out-{name}"
    out.mkdir()
    log_dir = tmp_path / f"logs-{name}"
    flags = {True: ["--warm-workers"], False: ["--no-warm-workers"], None: []}[warm]
    launcher = Launcher(["--standalone", "--monitor-interval", "0.1", "--log-dir", str(log_dir), *flags, *argv],
                        str(tmp_path), name,
                        env={"WARM_PROBE_OUT": str(out), "RDZV_WARM_AFTER": "0", "RDZV_NODE_NAME": "node",
                             **(env or {})})
    launcher.out, launcher.log_dir = str(out), str(log_dir)
    if wait:
        launcher.code = launcher.wait(RUN_WITHIN)
    return launcher


def _reports(launcher):
    found = {}
    for path in glob.glob(os.path.join(launcher.out, "*.json")):
        with open(path) as f:
            found[os.path.basename(path)[:-5]] = json.load(f)
    return found


def _comparable(report):
    report = {k: v for k, v in report.items() if k not in PER_PROCESS}
    report["env"] = {k: (v if k not in PER_RUN else "*") for k, v in report["env"].items()}
    return report


def _logs(launcher):
    """Log files by ``attempt/local rank/name``: their text."""
    found = {}
    for path in glob.glob(os.path.join(launcher.log_dir, "*", "attempt_*", "*", "*.log")):
        with open(path, encoding="utf-8", errors="replace") as f:
            found["/".join(path.split(os.sep)[-3:])] = f.read()
    return found


def _error_files(launcher, reports):
    found = {}
    for key, report in reports.items():
        path = report["env"].get("TORCHELASTIC_ERROR_FILE")
        if path and os.path.exists(path):
            with open(path) as f:
                message = json.load(f)["message"]
            found[key] = (message["message"], message["extraInfo"]["py_callstack"])
    return found


def _worker_lines(text):
    return sorted(line for line in text.splitlines() if line.startswith("[default"))


def _failure_lines(text):
    return [line.strip() for line in text.splitlines() if re.search(r"\(local rank \d+\) ", line)]


@pytest.fixture
def launchers():
    started = []
    yield started
    for launcher in started:
        launcher.kill_all()


def _assert_same(cold, warm):
    assert cold.code == warm.code, f"{cold.tail()}\n{warm.tail()}"
    cold_reports, warm_reports = _reports(cold), _reports(warm)
    assert cold_reports and sorted(cold_reports) == sorted(warm_reports), f"{cold.tail()}\n{warm.tail()}"
    assert not any(r["warm"] for r in cold_reports.values())
    cold_started = sorted(key for key, r in warm_reports.items() if not r["warm"])
    assert not cold_started, f"attempts of the warm run started cold: {cold_started}\n{warm.tail()}"
    for key in cold_reports:
        assert _comparable(warm_reports[key]) == _comparable(cold_reports[key]), key
    assert _logs(warm) == _logs(cold)
    assert _error_files(warm, warm_reports) == _error_files(cold, cold_reports)
    assert _worker_lines(warm.stdout()) == _worker_lines(cold.stdout())
    assert _worker_lines(warm.stderr()) == _worker_lines(cold.stderr())
    assert _failure_lines(warm.stderr()) == _failure_lines(cold.stderr())
    return cold_reports


@pytest.mark.slow
def test_a_script_and_its_restarts_run_warm_exactly_as_cold(tmp_path, launchers):
    """Two local ranks, four attempts: ``@record`` failure (1, error file), ``sys.exit(3)``, SIGUSR1, success."""
    os.makedirs(tmp_path / "sub")
    shutil.copy(PROBE, tmp_path / "sub" / "warm_probe.py")
    argv = ["--nproc-per-node", "2", "--max-restarts", "3", "--tee", "3", "--local-ranks-filter", "0",
            "sub/warm_probe.py", "record,exit3,signal,ok", "--flag=x"]
    runs = []
    for warm in (False, True):
        runs.append(_run(tmp_path, "warm" if warm else "cold", argv, warm=warm))
        launchers.append(runs[-1])
    reports = _assert_same(*runs)
    assert sorted(reports) == [f"{r}-{n}" for r in (0, 1) for n in range(4)]
    first = reports["0-0"]
    assert first["argv"] == ["sub/warm_probe.py", "record,exit3,signal,ok", "--flag=x"]
    assert first["name"] == "__main__" and first["main_is_this"] and first["pickle"] == 7
    assert first["path0"] == str(tmp_path / "sub") and first["cwd"] == str(tmp_path)
    assert first["env"]["OMP_NUM_THREADS"] == "1" and reports["1-0"]["env"]["LOCAL_RANK"] == "1"
    assert first["signals"]["SIGINT"] == "default_int_handler" and first["sched"] == os.SCHED_OTHER
    assert first["session_leader"] and first["pdeathsig"] == signal.SIGKILL
    failures = _failure_lines(runs[1].stderr())
    assert any("exited with code 1: RuntimeError: recorded failure" in line for line in failures), failures
    assert any("exited with code 3" in line for line in failures), failures
    assert any("SIGUSR1" in line for line in failures), failures


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["-m", "--run-path"])
def test_a_module_or_run_path_entry_runs_warm_exactly_as_cold(tmp_path, launchers, mode):
    """An uncaught exception (traceback through runpy, exit 1), stdout and stderr redirected to the log files."""
    shutil.copy(PROBE, tmp_path / "warm_probe_mod.py")
    entry = "warm_probe_mod" if mode == "-m" else "warm_probe_mod.py"
    argv = ["--nproc-per-node", "1", "--redirects", "3", mode, entry, "raise"]
    runs = []
    for warm in (False, True):
        runs.append(_run(tmp_path, "warm" if warm else "cold", argv, warm=warm))
        launchers.append(runs[-1])
    reports = _assert_same(*runs)
    assert runs[0].code == 1
    assert reports["0-0"]["name"] == "__main__" and reports["0-0"]["pickle"] == 7
    stderr_log = [text for path, text in _logs(runs[1]).items() if path.endswith("stderr.log")][0]
    assert "ValueError: plain failure" in stderr_log and "_warm_boot" not in stderr_log


@pytest.mark.slow
def test_a_script_path_through_dotdot_keeps_its_file_and_traceback_paths(tmp_path, launchers):
    """``sub/../warm_probe.py``: ``__file__`` and the traceback's file name are the path joined to the cwd, not
    normalized, as CPython gives them cold."""
    shutil.copy(PROBE, tmp_path / "warm_probe.py")
    (tmp_path / "sub").mkdir()
    argv = ["--nproc-per-node", "1", "--redirects", "3", "sub/../warm_probe.py", "raise"]
    runs = [_run(tmp_path, name, argv, warm=warm) for name, warm in (("cold", False), ("warm", True))]
    launchers.extend(runs)
    reports = _assert_same(*runs)
    assert reports["0-0"]["file"] == str(tmp_path / "sub" / ".." / "warm_probe.py")


@pytest.mark.slow
def test_a_script_gone_before_a_warm_restart_fails_as_python_does(tmp_path, launchers):
    """The script renames itself and fails; its restart cannot open it: ``python: can't open file ...``, exit 2,
    warm as cold (a warm process read the file only when activated)."""
    script = "import os, sys, torch\nif os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n" \
             "    os.rename(__file__, __file__ + '.moved')\n    sys.exit(3)\n"
    runs = []
    for name, warm in (("cold", False), ("warm", True)):
        (tmp_path / "gone.py").write_text(script)
        runs.append(_run(tmp_path, name, ["--max-restarts", "1", "--redirects", "3", "gone.py"], warm=warm))
        launchers.append(runs[-1])
    assert runs[0].code == runs[1].code == 1, runs[1].tail()
    assert _failure_lines(runs[0].stderr()) == _failure_lines(runs[1].stderr()), runs[0].tail() + runs[1].tail()
    logs = [{k: v for k, v in _logs(run).items() if k.startswith("attempt_1/")} for run in runs]
    assert logs[0] == logs[1] and "can't open file" in logs[0]["attempt_1/0/stderr.log"], logs


def _warm_processes(marker):
    """Live warm processes (their command line names the warm boot) whose environment holds ``marker``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if any(a.endswith("_warm_boot.py") for a in proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE \
                    and proc.environ().get("WARM_PROBE_OUT") == marker:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit", "SIGTERM", "kill -9"])
def test_no_warm_process_outlives_the_launcher(tmp_path, launchers, end):
    shutil.copy(PROBE, tmp_path / "warm_probe.py")
    launcher = _run(tmp_path, "warm", ["--nproc-per-node", "2", "warm_probe.py", "ok" if end == "exit" else "hang"],
                    warm=True, wait=False)
    launchers.append(launcher)
    if end != "exit":
        eventually(lambda: len(_reports(launcher)) == 2, RUN_WITHIN, "the workers' reports", launcher.tail)
        workers = {r["pid"] for r in _reports(launcher).values()}
        eventually(lambda: set(_warm_processes(launcher.out)) - workers, RUN_WITHIN, "the next warm generation",
                   launcher.tail)
        sig = signal.SIGKILL if end == "kill -9" else signal.SIGTERM
        os.kill(launcher.pid, sig)
        assert launcher.wait(60) == (-sig if sig == signal.SIGKILL else 128 + sig), launcher.tail()
    else:
        assert launcher.wait(RUN_WITHIN) == 0, launcher.tail()
    eventually(lambda: not _warm_processes(launcher.out), GONE_WITHIN, "no warm process left",
               lambda: f"left: {_warm_processes(launcher.out)}\n{launcher.tail()}")


@pytest.mark.slow
@pytest.mark.parametrize("prelude, entry, warm", [
    ("", [], True),
    ("", ["--run-path"], True),
    ("import os\nos.environ.setdefault('PROBE_SET_BEFORE_TORCH', '1')\n", [], False),
], ids=["imports-first", "run-path", "sets-env-before-torch"])
def test_by_default_a_script_runs_warm_unless_it_changes_what_the_torch_import_reads(tmp_path, launchers,
                                                                                      prelude, entry, warm):
    """No flag: every attempt (the first and a restart) is warm (``--run-path``: the script it runs is read), or,
    for a script that sets a variable before its ``import torch``, cold; the script runs and ends the same."""
    with open(PROBE) as f:
        (tmp_path / "warm_probe.py").write_text(f.read().replace("import ctypes\n", prelude + "import ctypes\n", 1))
    launcher = _run(tmp_path, "default", ["--max-restarts", "1", *entry, "warm_probe.py", "exit3,ok"], warm=None)
    launchers.append(launcher)
    assert launcher.code == 0, launcher.tail()
    reports = _reports(launcher)
    assert sorted(reports) == ["0-0", "0-1"], launcher.tail()
    assert [reports[k]["warm"] for k in ("0-0", "0-1")] == [warm, warm], launcher.tail()
    assert ("PROBE_SET_BEFORE_TORCH" in reports["0-1"]["env"]) == (not warm)


@pytest.mark.slow
def test_a_warm_import_that_fails_is_a_warning_and_a_cold_start(tmp_path, launchers):
    shutil.copy(PROBE, tmp_path / "warm_probe.py")
    (tmp_path / "bad_warm_mod.py").write_text("raise RuntimeError('not importable here')\n")
    launcher = _run(tmp_path, "warm", ["--warm-imports", "bad_warm_mod", "warm_probe.py", "ok"], warm=True)
    launchers.append(launcher)
    assert launcher.code == 0, launcher.tail()
    assert "--warm-imports bad_warm_mod" in launcher.stderr() and "not importable here" in launcher.stderr()
    assert [r["warm"] for r in _reports(launcher).values()] == [False]


def _config(argv, environ=None):
    return build_config(parse_args(argv), environ=environ if environ is not None else dict(os.environ))


def test_warm_flags(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "helper_mod.py").write_text("")
    monkeypatch.delenv("PET_WARM_WORKERS", raising=False)
    default = _config(["--standalone", str(script)])
    assert (default.warm_imports, default.warm_checked, default.warm_after) == ([], True, 10.0)  # on, checked
    asked = _config(["--standalone", "--warm-workers", str(script)])
    assert (asked.warm_imports, asked.warm_checked) == ([], False)
    assert _config(["--standalone", str(script)], {"RDZV_WARM_AFTER": "2.5"}).warm_after == 2.5
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ConfigError, match=f"RDZV_WARM_AFTER.*{bad}"):
            _config(["--standalone", str(script)], {"RDZV_WARM_AFTER": bad})
    assert _config(["--standalone", "--warm-imports", "helper_mod,json", str(script)]).warm_imports == \
        ["helper_mod", "json"]  # found next to the script, as the workers' sys.path[0] will have it
    monkeypatch.setenv("PET_WARM_WORKERS", "0")
    assert _config(["--standalone", str(script)]).warm_imports is None
    monkeypatch.setenv("PET_WARM_WORKERS", "1")
    on = _config(["--standalone", str(script)])
    assert (on.warm_imports, on.warm_checked) == ([], False)
    assert _config(["--standalone", "--no-warm-workers", str(script)]).warm_imports is None
    with pytest.raises(ConfigError, match="--warm-imports.*no_such_mod_xyz"):
        _config(["--standalone", "--warm-imports", "no_such_mod_xyz", str(script)])
    with pytest.raises(ConfigError, match="--no-warm-workers"):
        _config(["--standalone", "--no-warm-workers", "--warm-imports", "json", str(script)])
    with pytest.raises(SystemExit):
        parse_args(["--standalone", "--warm-imports", "a b", str(script)])


class _SlowSender:
    """A warm process's socket whose ``sendmsg`` returns only after the worker took the message and closed
    its end (the interleaving a busy launcher meets)."""

    def __init__(self, sock):
        self._sock = sock

    def sendmsg(self, *args):
        sent = self._sock.sendmsg(*args)
        self._sock.settimeout(60)
        assert self._sock.recv(1, socket.MSG_PEEK) == b"", "the worker did not close its end"
        self._sock.settimeout(None)
        return sent

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.slow
def test_a_worker_that_took_its_activation_at_once_is_started_not_failed(tmp_path):
    """The activation is delivered before the worker closes its end; a launcher that only then finishes its
    send must not take the started worker for a failed one (it would kill it and start it again cold)."""
    script = tmp_path / "w.py"
    script.write_text("import os, sys\nsys.exit(int(os.environ['CODE']))\n")
    argv = boot_argv(sys.executable, ["-u", str(script)], [])
    warm = WarmProcess(argv, dict(os.environ))
    try:
        assert warm.wait_ready(120) == "ready"
        warm._sock = _SlowSender(warm._sock)
        warm.activate({**os.environ, "CODE": "7"}, 1, 2)
        assert warm.popen.wait(60) == 7
    finally:
        warm.discard()
