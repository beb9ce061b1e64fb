"""Log specs: where each worker's output goes, as torchrun 2.13 decides it.

The agent places files through a torch ``LogsSpecs`` object (``--logs-specs NAME``
loads the ``torchrun.logs_specs`` entry point NAME, as torch's
``run._get_logs_specs_class``; the default is :class:`RdzvLogsSpecs`). Its
``reify(envs)`` gives, per local rank, the stdout/stderr files (``""``: the
console), the streams copied to the console (``tee``), the error file, and the
two files of the duplicate filters; :func:`worker_streams` turns that into what
one :class:`~rdzv_agent.workers.process.WorkerProcess` does. docs/logs.md has the details.
"""

from __future__ import annotations

import importlib.metadata
import os
import string
import threading
from dataclasses import dataclass
from typing import IO, Mapping, Sequence

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing import Std as TorchStd

from rdzv_core.errors import ConfigError

from .streams import Std

__all__ = [
    "LOGS_SPECS_GROUP", "PREFIX_TEMPLATE_ENV", "RdzvLogsSpecs", "LineFilter", "WorkerStreams",
    "load_logs_specs", "make_logs_specs", "parse_filters", "parse_local_ranks", "line_prefix", "worker_streams",
]

#: Entry point group of ``--logs-specs`` (torch's).
LOGS_SPECS_GROUP = "torchrun.logs_specs"
#: Variable holding the console line prefix template (``${role_name}``, ``${rank}``, ``${local_rank}``).
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def parse_local_ranks(text: str | None) -> set[int] | None:
    """``--local-ranks-filter``: ``"0,2"`` -> ``{0, 2}``; empty or ``None`` -> ``None`` (every rank).

    Raises:
        ConfigError: not a comma-separated list of integers >= 0 (torch raises ValueError).
    """
    if not text:
        return None
    try:
        ranks = {int(item) for item in text.split(",")}
    except ValueError:
        ranks = {-1}
    if min(ranks) < 0:
        raise ConfigError("--local-ranks-filter", text, "expected local ranks separated by commas, e.g. 0,1,2")
    return ranks


def parse_filters(text: str) -> list[str]:
    """A duplicate filter list: torch's ``comma_separated_list`` (``,,`` stands for a comma).

    Empty items are dropped: torch keeps them, and ``""`` matches every line, so
    ``--duplicate-stdout-filters ""`` (or a trailing comma) would copy everything,
    against its own help ("an empty filters list won't duplicate any lines").
    """
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in text.replace(",,", placeholder).split(",") if item]


def load_logs_specs(name: str | None) -> type[LogsSpecs]:
    """The ``LogsSpecs`` class of entry point ``name`` in :data:`LOGS_SPECS_GROUP`; ``None`` -> :class:`RdzvLogsSpecs`.

    torch's ``default`` entry point is torch's ``DefaultLogsSpecs`` itself.

    Raises:
        ConfigError: naming ``--logs-specs``: no such entry point, it fails to
            load, or it is not a ``LogsSpecs`` subclass.
    """
    if name is None:
        return RdzvLogsSpecs
    found = importlib.metadata.entry_points(group=LOGS_SPECS_GROUP)
    match = [ep for ep in found if ep.name == name]
    if not match:
        names = ", ".join(sorted({ep.name for ep in found})) or "none"
        raise ConfigError("--logs-specs", name, f"no {LOGS_SPECS_GROUP} entry point of that name (installed: {names})")
    try:
        cls = match[0].load()
    except Exception as exc:  # any import error of a third-party module: reported, not raised raw
        raise ConfigError("--logs-specs", name, f"entry point {match[0].value} failed to load: {exc!r}") from exc
    if not (isinstance(cls, type) and issubclass(cls, LogsSpecs)):
        raise ConfigError("--logs-specs", name, f"entry point {match[0].value} is not a LogsSpecs subclass")
    return cls


def _torch_std(value: Std | Mapping[int, Std]) -> TorchStd | dict[int, TorchStd]:
    if isinstance(value, Mapping):
        return {int(k): TorchStd(int(v)) for k, v in value.items()}
    return TorchStd(int(value))


def make_logs_specs(
    name: str | None,
    log_dir: str | None,
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
    local_ranks_filter: set[int] | None,
) -> LogsSpecs:
    """Build the logs spec as torchrun does (``cls(log_dir=, redirects=, tee=, local_ranks_filter=)``).

    Raises:
        ConfigError: a bad ``--logs-specs`` (see :func:`load_logs_specs`).
        OSError: ``log_dir`` cannot be created (``NotADirectoryError`` for a file).
    """
    cls = load_logs_specs(name)
    return cls(log_dir=log_dir, redirects=_torch_std(redirects), tee=_torch_std(tee),
               local_ranks_filter=local_ranks_filter)


class RdzvLogsSpecs(DefaultLogsSpecs):
    """torch's ``DefaultLogsSpecs`` (``LOG_DIR/RUN_ID_xxxx/attempt_N/LOCAL_RANK/``, ``N`` =
    ``TORCHELASTIC_RESTART_COUNT``), except that a second start with the same ``N``
    (after a membership change, which spends no restart) keeps the earlier logs as
    ``attempt_N.K`` (K = 1, 2, ...) where torch's ``reify`` deletes them (``shutil.rmtree``).
    """

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        run_dir = self._run_log_dir
        if run_dir and envs:
            attempt = os.path.join(run_dir, f"attempt_{envs[0].get('TORCHELASTIC_RESTART_COUNT', '0')}")
            if os.path.isdir(attempt):
                k = 1
                while os.path.exists(f"{attempt}.{k}"):
                    k += 1
                os.rename(attempt, f"{attempt}.{k}")
        return super().reify(envs)


def line_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """The console prefix of a worker's lines: ``[ROLELOCAL_RANK]:`` (torch's ``TailLog`` header), or
    ``template`` with ``${role_name}``, ``${rank}`` (global), ``${local_rank}`` substituted (torch's
    ``string.Template.safe_substitute``: unknown fields stay as written)."""
    if not template:
        return f"[{role}{local_rank}]:"
    return string.Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)


class LineFilter:
    """One ``filtered_stdout.log``/``filtered_stderr.log``: lines of every rank that contain one of
    ``needles``, each after its rank's prefix (torch's ``TailLog`` with ``log_line_filter``). Thread-safe."""

    def __init__(self, path: str, needles: Sequence[str]) -> None:
        self._file: IO[str] | None = open(path, "w", errors="replace", buffering=1)
        self._needles = list(needles)
        self._lock = threading.Lock()

    def offer(self, prefix: str, line: str) -> None:
        """Write ``prefix + line`` if ``line`` contains a needle (``line`` ends with a newline)."""
        if not any(n in line for n in self._needles):
            return
        with self._lock:
            if self._file is not None:
                self._file.write(prefix + line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclass(frozen=True)
class WorkerStreams:
    """What one worker's output does.

    Attributes:
        stdout: file for stdout (may be ``os.devnull``), or ``None``: the launcher's stdout, unprefixed.
        stdout_console: copy stdout's lines to the console with ``prefix`` (needs ``stdout``: tee).
        stderr: file for stderr, or ``None`` for none (the agent still keeps its tail for reports).
        stderr_console: copy stderr's lines to the console with ``prefix``.
        prefix: console (and filter file) line prefix.
        error_file: ``TORCHELASTIC_ERROR_FILE``.
        stdout_filter, stderr_filter: duplicate filters fed by this worker (tee'd streams only, as torch).
    """

    stdout: str | None
    stdout_console: bool
    stderr: str | None
    stderr_console: bool
    prefix: str
    error_file: str
    stdout_filter: LineFilter | None = None
    stderr_filter: LineFilter | None = None


def worker_streams(
    dest: LogsDest, local_rank: int, prefix: str, filters: tuple[LineFilter | None, LineFilter | None]
) -> WorkerStreams:
    """Map a ``LogsSpecs.reify`` result onto local rank ``local_rank``.

    torch prints a stderr that is neither redirected nor tee'd straight to the
    console (``os.devnull`` for a rank the filter hides); the agent pipes it (to
    report the error), prints it with the prefix unless hidden, and writes it to
    ``stderr.log`` beside the error file as well.
    """
    out, err = dest.stdouts.get(local_rank, ""), dest.stderrs.get(local_rank, "")
    error_file = dest.error_files.get(local_rank, os.devnull)
    tee_out, tee_err = local_rank in dest.tee_stdouts, local_rank in dest.tee_stderrs
    err_file: str | None = err
    if err in ("", os.devnull):  # the console, or hidden by the ranks filter: the agent's own copy
        err_file = None if error_file == os.devnull else os.path.join(os.path.dirname(error_file), "stderr.log")
    return WorkerStreams(
        stdout=out or None,
        stdout_console=tee_out,
        stderr=err_file,
        stderr_console=tee_err or not err,
        prefix=prefix,
        error_file=error_file,
        stdout_filter=filters[0] if tee_out else None,
        stderr_filter=filters[1] if tee_err else None,
    )
