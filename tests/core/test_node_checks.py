"""Pre-flight node checks (rdzv_core.node_checks): real commands, directories and entry-point plugins."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rdzv_core import ConfigError, parse_backend_url
from rdzv_core import node_checks
from rdzv_core.node_checks import CheckOutcome, CheckSettings, run_node_checks
from rdzv_core.url import NODE_CHECK_ACTIONS
from tests.support.waiting import eventually


def command(cmd: str, **kw: object) -> CheckOutcome:
    return run_node_checks(CheckSettings(command=cmd, entry_points=False, **kw))  # type: ignore[arg-type]


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of group ``pgid`` that are not zombies."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


# -- the command ------------------------------------------------------------------------------------------------
def test_a_command_that_exits_0_is_healthy_and_sees_the_marker_variable() -> None:
    outcome = command('test "$RDZV_NODE_CHECK" = 1')
    assert (outcome.healthy, outcome.check, outcome.reason) == (True, "", "")
    assert 0 <= outcome.seconds < 10


def test_a_failing_commands_reason_is_its_last_output_line_stdout_and_stderr_alike() -> None:
    outcome = command("printf 'first\\nsecond line\\n\\n'; echo '  GPU 3: ECC errors  ' >&2; exit 3")
    assert (outcome.healthy, outcome.check, outcome.reason) == (False, "command", "GPU 3: ECC errors")
    assert command("echo only stdout; exit 1").reason == "only stdout"


def test_a_failing_command_without_output_or_killed_by_a_signal_names_its_status() -> None:
    assert command("exit 5").reason == "exit status 5"
    outcome = command("kill -TERM $$")
    assert (outcome.healthy, outcome.reason) == (False, "killed by SIGTERM")


def test_a_long_last_line_is_cut_to_one_short_line() -> None:
    outcome = command("head -c 300000 /dev/zero | tr '\\0' a; printf '\\n\\tb\\033c %0500d\\n' 7; exit 1")
    assert not outcome.healthy and len(outcome.reason) <= 200 and outcome.reason.endswith("...")
    assert outcome.reason.startswith("b c 000") and "\n" not in outcome.reason


def test_a_hung_command_fails_at_its_timeout_and_its_whole_process_group_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    started = time.monotonic()
    outcome = command(f"echo $$ > {pid_file}; sleep 300 & sleep 300", timeout=1.0)
    assert (outcome.healthy, outcome.check, outcome.reason) == (False, "command", "timed out after 1 s")
    assert time.monotonic() - started < 1.0 + 2.0
    pgid = int(pid_file.read_text())
    eventually(lambda: not group_members(pgid), 5, "the check's process group gone",
               lambda: str(group_members(pgid)))


def test_what_a_passing_command_leaves_running_in_its_group_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    outcome = command(f"echo $$ > {pid_file}; sleep 300 & exit 0", timeout=10.0)
    assert outcome.healthy and outcome.seconds < 5
    pgid = int(pid_file.read_text())
    eventually(lambda: not group_members(pgid), 5, "the check's leftover process gone",
               lambda: str(group_members(pgid)))


def test_the_deadline_bounds_a_check_and_one_past_it_does_not_run(tmp_path: Path) -> None:
    started = time.monotonic()
    outcome = run_node_checks(CheckSettings(command="sleep 300", entry_points=False), deadline=started + 0.5)
    assert not outcome.healthy and outcome.reason.startswith("timed out after 0.")
    assert time.monotonic() - started < 0.5 + 2.0
    marker = tmp_path / "ran"
    outcome = run_node_checks(CheckSettings(command=f"touch {marker}", entry_points=False), deadline=started)
    assert (outcome.healthy, outcome.check) == (False, "command") and "deadline" in outcome.reason
    assert not marker.exists()


@pytest.mark.parametrize("status", [127, 126])
def test_a_command_that_cannot_run_passes_with_a_warning(status: int, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    if status == 127:
        cmd = "rdzv-no-such-command-" + uuid.uuid4().hex
    else:
        script = tmp_path / "check.sh"
        script.write_text("#!/bin/sh\nexit 1\n")
        script.chmod(0o644)  # no execute bit: refused even to root
        cmd = str(script)
    with caplog.at_level(logging.WARNING, logger="rdzv_core.node_checks"):
        outcome = command(cmd)
    assert (outcome.healthy, outcome.check) == (True, "command")
    assert outcome.reason.startswith(f"could not run (exit status {status}"), outcome.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "command" in warnings[0].getMessage() and outcome.reason in warnings[0].getMessage()


def test_a_shell_that_cannot_start_passes_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(node_checks, "_SHELL", "/nonexistent/sh")
    with caplog.at_level(logging.WARNING, logger="rdzv_core.node_checks"):
        outcome = command("exit 1")
    assert outcome.healthy and outcome.reason.startswith("could not start /nonexistent/sh")
    assert "could not start" in caplog.text


# -- directories ------------------------------------------------------------------------------------------------
def test_a_writable_directory_with_room_passes_and_keeps_no_file(tmp_path: Path) -> None:
    outcome = run_node_checks(CheckSettings(dirs=(str(tmp_path),), min_free_mb=0, entry_points=False))
    assert (outcome.healthy, outcome.reason) == (True, "")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_take_a_file_fails_even_for_root(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    under_a_file, missing = str(tmp_path / "file" / "sub"), str(tmp_path / "missing")
    outcome = run_node_checks(CheckSettings(dirs=(str(tmp_path), under_a_file, missing), min_free_mb=0,
                                            entry_points=False))
    assert (outcome.healthy, outcome.check) == (False, f"dir:{under_a_file}")
    assert outcome.reason == "not writable: Not a directory"
    outcome = run_node_checks(CheckSettings(dirs=(missing,), min_free_mb=0, entry_points=False))
    assert (outcome.healthy, outcome.reason) == (False, "not writable: No such file or directory")


def test_a_directory_low_on_space_fails(tmp_path: Path) -> None:
    outcome = run_node_checks(CheckSettings(dirs=(str(tmp_path),), min_free_mb=1e12, entry_points=False))
    assert (outcome.healthy, outcome.check) == (False, f"dir:{tmp_path}")
    assert outcome.reason.endswith("MiB free, less than 1e+12 MiB"), outcome.reason


def test_checks_run_in_order_and_the_first_failure_decides(tmp_path: Path) -> None:
    bad = str(tmp_path / "missing")
    marker = tmp_path / "ran"
    assert run_node_checks(CheckSettings(command="exit 1", dirs=(bad,), entry_points=False)).check == "command"
    outcome = run_node_checks(CheckSettings(command=f"touch {marker}", dirs=(bad,), entry_points=False))
    assert marker.exists() and outcome.check == f"dir:{bad}"


# -- plugins ----------------------------------------------------------------------------------------------------
@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``install({name: "module-level code defining check()"})``: a distribution on ``sys.path`` whose entry
    points of ``rdzv.node_checks`` are those checks (a module each, of a unique name). Yields ``install``."""
    modules: list[str] = []

    def install(checks: dict[str, str]) -> dict[str, str]:
        root = tmp_path / f"site{len(modules)}"
        dist = root / f"rdzv_nc_test_{uuid.uuid4().hex[:8]}-0.1.dist-info"
        dist.mkdir(parents=True)
        names, lines = {}, ["[rdzv.node_checks]"]
        for name, code in checks.items():
            module = f"rdzv_nc_{name.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
            if code:  # "" : an entry point whose module does not exist
                (root / f"{module}.py").write_text(textwrap.dedent(code))
            lines.append(f"{name} = {module}:check")
            names[name] = module
            modules.append(module)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.name.split('-')[0]}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(root))
        return names

    yield install
    for module in modules:  # let a hung check's thread end
        release = getattr(sys.modules.get(module), "release", None)
        if release is not None:
            release.set()


def test_a_plugin_that_returns_a_reason_fails_and_none_passes(plugins) -> None:
    plugins({"a-ok": "def check():\n    return None\n",
             "b-gpu": "def check():\n    return 'GPU 3: 12 uncorrectable ECC errors'\n",
             "c-never": "def check():\n    raise AssertionError('not reached')\n"})
    outcome = run_node_checks(CheckSettings())
    assert (outcome.healthy, outcome.check, outcome.reason) == (False, "plugin:b-gpu",
                                                                "GPU 3: 12 uncorrectable ECC errors")
    assert CheckSettings().enabled and not CheckSettings(entry_points=False).enabled
    assert run_node_checks(CheckSettings(entry_points=False)).healthy


def test_a_plugin_that_raises_or_cannot_be_imported_passes_with_a_warning(plugins,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    plugins({"broken": "def check():\n    raise RuntimeError('no NVML')\n", "missing": ""})
    with caplog.at_level(logging.WARNING, logger="rdzv_core.node_checks"):
        outcome = run_node_checks(CheckSettings())
    assert (outcome.healthy, outcome.check, outcome.reason) == (True, "plugin:broken", "raised RuntimeError: no NVML")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "plugin:broken" in warnings[0] and "plugin:missing" in warnings[1], warnings
    assert "could not load" in warnings[1] and "ModuleNotFoundError" in warnings[1]


def test_a_hung_plugin_fails_at_the_timeout_and_is_not_started_again_while_it_hangs(plugins) -> None:
    plugins({"hang": "import threading\nrelease = threading.Event()\ndef check():\n    release.wait()\n"})
    started = time.monotonic()
    outcome = run_node_checks(CheckSettings(timeout=0.5))
    assert (outcome.healthy, outcome.check, outcome.reason) == (False, "plugin:hang", "timed out after 0.5 s")
    assert time.monotonic() - started < 0.5 + 2.0
    again = run_node_checks(CheckSettings(timeout=0.5))
    assert not again.healthy and "still running" in again.reason and again.seconds < 0.5


# -- settings, URL keys, torchrun -------------------------------------------------------------------------------
def test_url_keys_round_trip_into_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PET_NODE_CHECK", raising=False)
    _, url = parse_backend_url("memory://x/run?node_check=nvidia-smi%20-L%20%7C%20grep%20-q%20GPU&node_check_timeout=5"
                               "&node_check_dirs=/scratch:/tmp&node_check_min_free_mb=100&node_check_action=exit"
                               "&node_check_interval=2&node_check_plugins=no")
    want = CheckSettings("nvidia-smi -L | grep -q GPU", 5.0, ("/scratch", "/tmp"), 100.0, "exit", 2.0, False)
    assert CheckSettings.from_query(url.params) == want
    assert parse_backend_url(url.redacted())[1].params == url.params  # its text parses back to the same
    changed = url.with_params({"node_check_timeout": 7, "node_check_plugins": True, "node_check_dirs": "/a"})
    assert CheckSettings.from_query(changed.params).timeout == 7.0
    assert CheckSettings.from_query(changed.params).entry_points is True
    assert CheckSettings.from_query(changed.params).dirs == ("/a",)
    assert CheckSettings.from_query(parse_backend_url("memory://x/run")[1].params) == CheckSettings()
    assert NODE_CHECK_ACTIONS == node_checks.ACTIONS


@pytest.mark.parametrize("query", ["node_check=a%07b", "node_check_timeout=0", "node_check_timeout=-1",
                                   "node_check_timeout=soon", "node_check_dirs=/a::/b", "node_check_min_free_mb=-1",
                                   "node_check_min_free_mb=1e999", "node_check_action=retry",
                                   "node_check_interval=0", "node_check_plugins=maybe"])
def test_a_bad_url_value_is_a_config_error_naming_its_key(query: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_backend_url(f"memory://x/run?{query}")
    assert info.value.field == query.partition("=")[0]


def test_pet_node_check_gives_the_command_where_the_query_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NODE_CHECK", "/opt/check-node")
    assert CheckSettings.from_query({}).command == "/opt/check-node"
    assert CheckSettings.from_query({"node_check": "from-url"}).command == "from-url"
    assert CheckSettings.from_query({"node_check": ""}).command is None  # the URL says: no command
    assert CheckSettings.from_query({}, environ={"PET_NODE_CHECK": "  "}).command is None
    assert CheckSettings.from_query({}, environ={}).command is None


@pytest.mark.parametrize("kwargs, field", [
    ({"timeout": 0}, "timeout"), ({"interval": float("inf")}, "interval"), ({"timeout": True}, "timeout"),
    ({"min_free_mb": -1}, "min_free_mb"), ({"on_fail": "retry"}, "on_fail"), ({"dirs": "/tmp"}, "dirs"),
    ({"dirs": ("",)}, "dirs"), ({"command": 3}, "command"), ({"entry_points": "yes"}, "entry_points"),
])
def test_bad_settings_are_config_errors_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        CheckSettings(**kwargs)
    assert info.value.field == field
    if field == "on_fail":
        with pytest.raises(ConfigError) as info:
            CheckSettings.from_query({"node_check_action": "retry"})
        assert info.value.field == "node_check_action"


def test_torchruns_rdzv_conf_carries_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    rendezvous = pytest.importorskip("torch.distributed.elastic.rendezvous")
    from rdzv_core.torch_api.torchrun import rendezvous_url

    monkeypatch.delenv("PET_NODE_CHECK", raising=False)
    params = rendezvous.RendezvousParameters(backend="rdzv-memory", endpoint="", run_id="job", min_nodes=1,
                                             max_nodes=2, node_check="/opt/check --gpus=all",
                                             node_check_timeout="20", node_check_action="exit")
    settings = CheckSettings.from_query(rendezvous_url("memory", params).params)
    assert (settings.command, settings.timeout, settings.on_fail) == ("/opt/check --gpus=all", 20.0, "exit")
