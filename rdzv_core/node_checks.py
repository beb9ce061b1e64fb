"""Pre-flight node checks, run before a node joins a round (``docs/node-health.md``, "Checks before joining").

:func:`run_node_checks` runs the command (``/bin/sh -c``; exit 0 healthy, else its last output line is the
reason), the directories (writable, with free space) and the ``rdzv.node_checks`` plugins, in that order, each
bounded by the timeout; the first failure decides. A check that cannot run at all (no shell, exit 126/127, a
plugin that fails to import or raises) passes with a WARNING (fail-open).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping, cast

from .errors import ConfigError

__all__ = ["CheckSettings", "CheckOutcome", "run_node_checks", "ENTRY_POINT_GROUP", "COMMAND_ENV", "MARKER_ENV",
           "ACTIONS", "QUERY_KEYS"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rdzv.node_checks"  #: the entry-point group of check plugins
COMMAND_ENV = "PET_NODE_CHECK"  #: the command where the query has no ``node_check`` (plain torchrun)
MARKER_ENV = "RDZV_NODE_CHECK"  #: set to ``1`` in the command's environment
ACTIONS = ("wait", "exit")  #: what a node does while a check fails: re-check, or give up
#: URL query key -> :class:`CheckSettings` field.
QUERY_KEYS = {"node_check": "command", "node_check_timeout": "timeout", "node_check_dirs": "dirs",
              "node_check_min_free_mb": "min_free_mb", "node_check_action": "on_fail",
              "node_check_interval": "interval", "node_check_plugins": "entry_points"}

_SHELL = "/bin/sh"
_OUTPUT_CAP = 64 * 1024  # bytes of the command's output kept (the end)
_REASON_CHARS = 200
_OK, _FAIL, _OPEN = "ok", "fail", "open"  # passed; failed; could not run (passes, with a WARNING)
_hung: dict[str, threading.Thread] = {}  # check name -> its thread still running after a timeout
_hung_lock = threading.Lock()


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class CheckSettings:
    """What to check before joining (query keys in :data:`QUERY_KEYS`).

    Attributes:
        command: shell command (``/bin/sh -c``), ``None`` or blank: none. Exit status 0 is healthy.
        timeout: seconds each check may take (> 0); one that takes longer fails.
        dirs: directories that must be writable and have ``min_free_mb`` MiB free.
        min_free_mb: MiB (>= 0).
        on_fail: ``"wait"`` (check again every ``interval`` seconds) or ``"exit"``.
        interval: seconds between checks while waiting (> 0).
        entry_points: run the plugins of :data:`ENTRY_POINT_GROUP`.

    Raises:
        ConfigError: a value of the wrong type or out of range (names the field).
    """

    command: str | None = None
    timeout: float = 60.0
    dirs: tuple[str, ...] = ()
    min_free_mb: float = 1024.0
    on_fail: str = "wait"
    interval: float = 30.0
    entry_points: bool = True

    def __post_init__(self) -> None:
        command = self.command
        if command is not None and (not isinstance(command, str) or "\0" in command):
            raise ConfigError("command", command, "must be shell command text (no NUL) or None")
        if command is not None and not command.strip():
            object.__setattr__(self, "command", None)
        for name in ("timeout", "interval"):
            value = getattr(self, name)
            if not _number(value) or not 0 < value <= 1e7:
                raise ConfigError(name, value, "must be a number of seconds > 0 and <= 1e7")
        if not _number(self.min_free_mb) or self.min_free_mb < 0:
            raise ConfigError("min_free_mb", self.min_free_mb, "must be a finite number of MiB >= 0")
        dirs = self.dirs
        if isinstance(dirs, (str, bytes)) or not all(isinstance(d, str) and d and "\0" not in d for d in dirs):
            raise ConfigError("dirs", dirs, "must be a sequence of non-empty directory paths")
        object.__setattr__(self, "dirs", tuple(dirs))
        if self.on_fail not in ACTIONS:
            raise ConfigError("on_fail", self.on_fail, f"must be one of {', '.join(ACTIONS)}")
        if not isinstance(self.entry_points, bool):
            raise ConfigError("entry_points", self.entry_points, "must be True or False")

    @property
    def enabled(self) -> bool:
        """Whether there is anything to run (a command, a directory, or an installed plugin to run)."""
        return self.command is not None or bool(self.dirs) or (self.entry_points and bool(_plugins()))

    @classmethod
    def from_query(cls, query: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> CheckSettings:
        """The settings of a parsed URL query (``RendezvousURL.params``: converted values, canonical keys;
        other keys ignored). Without ``node_check`` the command is ``environ[PET_NODE_CHECK]`` (default
        ``os.environ``; unset or blank: none); ``node_check_dirs`` may be ``DIR[:DIR...]`` text.

        Raises:
            ConfigError: a bad value, naming its query key (or ``PET_NODE_CHECK``).
        """
        values = {field: query[key] for key, field in QUERY_KEYS.items() if key in query}
        if "command" not in values:
            values["command"] = (os.environ if environ is None else environ).get(COMMAND_ENV) or None
        if isinstance(values.get("dirs"), str):
            values["dirs"] = tuple(d for d in values["dirs"].split(":") if d)
        try:
            return cls(**values)
        except ConfigError as exc:
            key = next((k for k, f in QUERY_KEYS.items() if f == exc.field), exc.field)
            raise ConfigError(key if key in query else COMMAND_ENV, exc.value, exc.reason) from None


@dataclass(frozen=True)
class CheckOutcome:
    """What :func:`run_node_checks` found.

    Attributes:
        healthy: the node may join.
        check: the check that failed (``"command"``, ``"dir:PATH"``, ``"plugin:NAME"``), else the first that
            could not run (fail-open), else ``""``.
        reason: one line: why it failed, or why it could not run; ``""`` when every check passed.
        seconds: how long the checks took.
    """

    healthy: bool
    check: str
    reason: str
    seconds: float


def run_node_checks(settings: CheckSettings, deadline: float | None = None) -> CheckOutcome:
    """Run every configured check in order (command, dirs, plugins); stop at the first failure.

    ``deadline``: a ``time.monotonic()`` time no check runs past (each gets the smaller of ``settings.timeout``
    and the time left; one with none left fails unrun); ``None``: the timeout only. Raises nothing for a check:
    one that could not run passes with a WARNING (its reason in the outcome), one that failed or hung fails.
    """
    started = time.monotonic()
    checks: list[tuple[str, Callable[[], tuple[str, str]] | None]] = []  # None: the command
    command = settings.command
    if command is not None:
        checks.append(("command", None))
    checks += [(f"dir:{path}", functools.partial(_check_dir, path, settings.min_free_mb)) for path in settings.dirs]
    checks += [(f"plugin:{ep.name}", functools.partial(_run_plugin, ep))
               for ep in (_plugins() if settings.entry_points else [])]
    opened = ("", "")
    for name, check in checks:
        budget = settings.timeout if deadline is None else min(settings.timeout, deadline - time.monotonic())
        if budget <= 0:
            status, reason = _FAIL, "not run: the rendezvous deadline passed"
        elif check is None:
            status, reason = _run_command(command or "", budget)
        else:
            status, reason = _bounded(name, budget, check)
        reason = _one_line(reason)
        if status == _FAIL:
            log.info("node check %s failed after %.1f s: %s", name, time.monotonic() - started, reason)
            return CheckOutcome(False, name, reason, time.monotonic() - started)
        if status == _OPEN:
            log.warning("node check %s could not run, counted as passed: %s", name, reason)
            opened = opened if opened[0] else (name, reason)
    return CheckOutcome(True, opened[0], opened[1], time.monotonic() - started)


def _one_line(text: str) -> str:
    """The last non-empty line of ``text``, control characters as spaces, at most 200 characters."""
    lines = [" ".join("".join(c if c.isprintable() else " " for c in line).split()) for line in text.splitlines()]
    last = next((line for line in reversed(lines) if line), "")
    return last if len(last) <= _REASON_CHARS else last[:_REASON_CHARS - 3] + "..."


def _plugins() -> list[importlib.metadata.EntryPoint]:
    """The installed plugins of :data:`ENTRY_POINT_GROUP` by name (the first of a name wins)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return [found[name] for name in sorted(found)]


def _run_command(command: str, budget: float) -> tuple[str, str]:
    """Run ``command`` with ``/bin/sh -c`` in a session of its own, at most ``budget`` seconds.

    Whatever is left of its process group when it exits or times out is killed (SIGKILL); the group is
    killed before the shell is reaped, so its id cannot have been reused.
    """
    try:
        proc = subprocess.Popen([_SHELL, "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, MARKER_ENV: "1"})
    except OSError as exc:
        return _OPEN, f"could not start {_SHELL}: {exc.strerror or exc}"
    out = cast(IO[bytes], proc.stdout)  # stdout=PIPE
    fd, tail, eof, exited, lost = out.fileno(), bytearray(), False, False, False
    end, pause = time.monotonic() + budget, 0.001
    try:
        while time.monotonic() < end:
            try:  # exited, not reaped (WNOWAIT): the pid, and so the group id, is still this one's
                exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            except ChildProcessError:  # reaped by someone else: its status is lost
                exited = lost = True
            if exited:
                break
            wait = min(0.05, max(0.0, end - time.monotonic()))
            if eof:  # output closed, the shell not yet gone
                time.sleep(min(wait, pause))
                pause = min(2 * pause, 0.05)
            else:
                eof = _read(fd, tail, wait)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = proc.wait()
        drain_end = time.monotonic() + 1.0  # a process outside the group may still hold the pipe
        while not eof and time.monotonic() < drain_end:
            eof = _read(fd, tail, max(0.0, drain_end - time.monotonic()))
        out.close()
    last = _one_line(tail.decode("utf-8", "replace"))
    if not exited:
        return _FAIL, f"timed out after {budget:.3g} s"
    if lost:
        return _OPEN, "its exit status was collected by another part of this process"
    status = f"exit status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    log.debug("node check command: %s, last line %r", status, last)
    if code == 0:
        return _OK, ""
    if code in (126, 127):
        why = "command not found" if code == 127 else "not executable"
        return _OPEN, f"could not run ({status}, {why})" + (f": {last}" if last else "")
    return _FAIL, last or status


def _read(fd: int, tail: bytearray, wait: float) -> bool:
    """Read what ``fd`` has within ``wait`` seconds into ``tail`` (its last 64 KiB kept); ``True`` at EOF."""
    ready, _, _ = select.select([fd], [], [], wait)
    if not ready:
        return False
    chunk = os.read(fd, 65536)
    tail += chunk
    del tail[:-_OUTPUT_CAP]
    return not chunk


def _bounded(name: str, budget: float, check: Callable[[], tuple[str, str]]) -> tuple[str, str]:
    """Run ``check`` in a daemon thread, waiting at most ``budget`` seconds. A check still running from an
    earlier call that timed out is not started again (it fails)."""
    with _hung_lock:
        earlier = _hung.get(name)
        if earlier is not None and earlier.is_alive():
            return _FAIL, "still running since an earlier check of it timed out"
    result: list[tuple[str, str]] = []

    def target() -> None:
        try:
            result.append(check())
        except BaseException as exc:  # noqa: BLE001 -- a plugin's SystemExit too: it could not run
            result.append((_OPEN, f"raised {type(exc).__name__}: {exc}"))

    thread = threading.Thread(target=target, name=f"rdzv-node-check {name}", daemon=True)
    thread.start()
    thread.join(budget)
    if thread.is_alive():
        with _hung_lock:
            _hung[name] = thread
        return _FAIL, f"timed out after {budget:.3g} s"
    return result[0]


def _check_dir(path: str, min_free_mb: float) -> tuple[str, str]:
    """``path`` has ``min_free_mb`` MiB free (for unprivileged users) and takes a file (create, fsync, delete)."""
    try:
        stat = os.statvfs(path)
        free_mb = stat.f_bavail * stat.f_frsize / 2**20
        if free_mb < min_free_mb:
            return _FAIL, f"{free_mb:.0f} MiB free, less than {min_free_mb:g} MiB"
        fd, name = tempfile.mkstemp(prefix=".rdzv-node-check-", dir=path)
        try:
            os.write(fd, b"rdzv node check\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return _FAIL, f"not writable: {exc.strerror or exc}"
    return _OK, ""


def _run_plugin(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """Load and call one plugin: ``None`` or ``""`` passes, a str is the reason it failed."""
    try:
        check = ep.load()
    except BaseException as exc:  # noqa: BLE001 -- any import failure: it could not run
        return _OPEN, f"could not load {ep.value}: {type(exc).__name__}: {exc}"
    if not callable(check):
        return _OPEN, f"{ep.value} is not callable"
    result = check()  # an exception: _bounded makes it a fail-open
    if result is None or result == "":
        return _OK, ""
    if not isinstance(result, str):
        return _OPEN, f"returned {type(result).__name__}, not a str or None"
    return _FAIL, result.strip() or "failed"
