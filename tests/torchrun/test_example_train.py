"""The main example, ``examples/train_digits.py``: trains, checkpoints and resumes.

The fast tests run the script as one plain process (no ``WORLD_SIZE``, so no process group); the
slow one runs two workers under torch's own launcher with an injected failure and a restart.
They parse only the script's machine-readable lines (see its module docstring) and read the
checkpoint it wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
TIMEOUT = 180.0  # seconds per run; a run takes a few seconds, mostly importing torch
ACCURACY_LINE = re.compile(r"^accuracy=(\d\.\d{4})$")
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) world_size=(\d+) loss=\d+\.\d{4}$")

# Variables a launcher sets; removed so the script runs as a plain single process.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def run(args: list[str], cwd: Path, launcher: list[str] | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the script (under ``launcher`` if given) and return the finished process."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    base["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, *(launcher or []), str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=TIMEOUT)


def ints_after(tag: str, stdout: str) -> list[int]:
    """Values of the ``TAG <n>`` lines, in order."""
    return [int(m) for m in re.findall(rf"^{tag} (\d+)$", stdout, re.MULTILINE)]


def epochs_run(stdout: str) -> list[int]:
    """The 1-based epochs of the progress lines, in order."""
    return [int(m.group(1)) for line in stdout.splitlines() if (m := EPOCH_LINE.match(line))]


def final_accuracy(proc: subprocess.CompletedProcess[str]) -> float:
    """The accuracy on the last stdout line; fails the test if the run failed or the line is off."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = ACCURACY_LINE.match(last)
    assert match, f"last line is not an accuracy: {last!r}"
    return float(match.group(1))


def checkpoint_epoch(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])


def test_single_process_trains_and_a_second_run_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt" / "digits.pt"

    first = run(["--epochs", "3", "--checkpoint", str(ckpt)], tmp_path)
    assert final_accuracy(first) >= 0.90
    assert ints_after("WORLD_SIZE_SEEN", first.stdout) == [1]
    assert ints_after("RESUMED_FROM_EPOCH", first.stdout) == [0]
    assert epochs_run(first.stdout) == [1, 2, 3]
    assert checkpoint_epoch(ckpt) == 3

    second = run(["--epochs", "5", "--checkpoint", str(ckpt)], tmp_path)
    assert final_accuracy(second) >= 0.90
    assert ints_after("RESUMED_FROM_EPOCH", second.stdout) == [3]
    assert epochs_run(second.stdout) == [4, 5]  # the checkpoint's epochs are not trained again
    assert checkpoint_epoch(ckpt) == 5
    assert [p.name for p in ckpt.parent.iterdir()] == ["digits.pt"]  # no temporary files left


def test_injected_failure_exits_3_and_the_next_attempt_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "digits.pt"
    args = ["--epochs", "3", "--checkpoint", str(ckpt), "--fail-at-epoch", "2", "--fail-rank", "0"]

    failed = run(args, tmp_path)
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert epochs_run(failed.stdout) == [1]
    assert not any(ACCURACY_LINE.match(line) for line in failed.stdout.splitlines())
    assert checkpoint_epoch(ckpt) == 1

    retried = run(args, tmp_path, env={"TORCHELASTIC_RESTART_COUNT": "1"})  # not the first attempt
    assert final_accuracy(retried) >= 0.90
    assert ints_after("RESUMED_FROM_EPOCH", retried.stdout) == [1]
    assert epochs_run(retried.stdout) == [2, 3]


def test_bad_argument_exits_2(tmp_path: Path) -> None:
    proc = run(["--epochs", "0", "--checkpoint", str(tmp_path / "x.pt")], tmp_path)
    assert proc.returncode == 2
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.slow
def test_two_workers_under_torchrun_restart_after_a_failure_and_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "digits.pt"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "--monitor-interval", "0.5"]
    # torchrun's shared TCPStore keeps the first attempt's gloo addresses (pytorch#135712).
    proc = run(["--epochs", "6", "--checkpoint", str(ckpt), "--fail-at-epoch", "2", "--fail-rank", "1"],
               tmp_path, launcher=launcher, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert final_accuracy(proc) >= 0.90
    assert ints_after("WORLD_SIZE_SEEN", proc.stdout) == [2, 2]
    assert ints_after("RESUMED_FROM_EPOCH", proc.stdout) == [0, 1]
    assert epochs_run(proc.stdout) == [1, 2, 3, 4, 5, 6]
    assert checkpoint_epoch(ckpt) == 6
