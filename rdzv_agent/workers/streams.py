"""Worker output: torchrun's ``--redirects``/``--tee`` values, log pumps, error excerpts.

``Std`` values (torchrun's ``torch.distributed.elastic.multiprocessing.Std``)::

    0 NONE   1 OUT (stdout)   2 ERR (stderr)   3 ALL

given once for every local rank (``"3"``) or per local rank (``"0:3,1:0"``;
ranks not listed get NONE).

What happens to each stream of a worker (the files' places are the logs spec's,
:mod:`rdzv_agent.workers.log_specs`; docs/logs.md):

* stderr is always written to ``stderr.log`` (so the agent can report the
  error); it is also copied to the console with a ``[ROLE LOCAL_RANK]:`` prefix
  (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``'s) unless it is redirected
  (``ERR`` in ``--redirects``) or its rank is not in ``--local-ranks-filter``.
* stdout goes straight to the console by default; to ``stdout.log`` only when
  redirected; to both (prefixed on the console) when teed.
"""

from __future__ import annotations

import collections
import fcntl
import re
import sys
import termios
import threading
import time
from enum import IntFlag
from typing import IO, Callable, Mapping, Protocol

from rdzv_core.errors import ConfigError

__all__ = ["Std", "parse_std", "std_for_rank", "StreamPump", "error_excerpt", "strip_rank_prefix"]

_VALUE = re.compile(r"^[0-3]$")
_MAPPING = re.compile(r"^(\d+:[0-3],)*(\d+:[0-3])$")

#: Lines of stderr each pump keeps in memory for error reports.
TAIL_LINES = 200


class Std(IntFlag):
    """Which standard streams a ``--redirects``/``--tee`` value selects."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR


def parse_std(field: str, text: str) -> Std | dict[int, Std]:
    """Parse ``"0".."3"`` or ``"LOCAL_RANK:VALUE,..."`` (torchrun's syntax).

    Raises:
        ConfigError: naming ``field`` and ``text``.
    """
    text = (text or "").strip()
    if _VALUE.match(text):
        return Std(int(text))
    if _MAPPING.match(text):
        mapping: dict[int, Std] = {}
        for item in text.split(","):
            rank, value = item.split(":")
            if int(rank) in mapping:
                raise ConfigError(field, text, f"local rank {rank} given more than once")
            mapping[int(rank)] = Std(int(value))
        return mapping
    raise ConfigError(field, text, "expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL_RANK:VALUE,...")


def std_for_rank(value: Std | Mapping[int, Std], local_rank: int) -> Std:
    """The :class:`Std` that ``value`` gives ``local_rank``."""
    if isinstance(value, Mapping):
        return Std(value.get(local_rank, Std.NONE))
    return Std(value)


class _LineSink(Protocol):
    def offer(self, prefix: str, line: str) -> None: ...


class StreamPump:
    """Copy a worker's pipe, line by line, to a log file and optionally the console.

    Runs one daemon thread; keeps the last :data:`TAIL_LINES` lines for
    :meth:`tail`. ``on_eof`` is called (from the thread) when the worker closes
    the pipe, usually because it exited.

    Args:
        pipe: the readable end (binary).
        log_path: file to append to (opened in binary mode here), or ``None``.
        console: text stream for the copy (``sys.stdout``/``sys.stderr``) or ``None``;
            looked up at write time when given as a callable.
        prefix: text put before each console line.
        on_eof: optional callback without arguments.
        duplicate: gets each line with ``prefix`` (``offer(prefix, line)``: the duplicate filters).
    """

    _console_lock = threading.Lock()

    def __init__(
        self,
        pipe: IO[bytes],
        log_path: str | None,
        console: Callable[[], IO[str]] | None,
        prefix: str,
        on_eof: Callable[[], None] | None = None,
        duplicate: _LineSink | None = None,
    ) -> None:
        self._pipe = pipe
        self._log = open(log_path, "ab") if log_path is not None else None
        self._duplicate = duplicate
        self._console = console
        self._prefix = prefix
        self._on_eof = on_eof
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lines = 0  # lines handled so far (the pump's progress, for drain())
        self.eof_at: float | None = None
        self._thread = threading.Thread(target=self._pump, name=f"pump{prefix}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for raw in iter(self._pipe.readline, b""):
                if self._log is not None:
                    self._log.write(raw)
                    self._log.flush()
                line = raw.decode("utf-8", errors="replace")
                self._tail.append(line.rstrip("\r\n"))
                whole = line if line.endswith("\n") else line + "\n"
                if self._console is not None:
                    self._write_console(whole)
                if self._duplicate is not None:
                    self._duplicate.offer(self._prefix, whole)
                self._lines += 1
        except (OSError, ValueError):  # pipe or log closed under us at shutdown
            pass
        finally:
            self.eof_at = time.monotonic()
            try:
                if self._log is not None:
                    self._log.close()
                self._pipe.close()
            except OSError:
                pass
            if self._on_eof is not None:
                self._on_eof()

    def _write_console(self, line: str) -> None:
        stream = self._console() if self._console is not None else None
        if stream is None:
            return
        with self._console_lock:
            try:
                stream.write(self._prefix + line)
                stream.flush()
            except (OSError, ValueError):  # console gone (closed pipe): keep logging to the file
                self._console = None

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the pipe to close; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _pending(self) -> int:
        """Bytes written to the pipe and not read yet (0 if that cannot be known: closed)."""
        buf = bytearray(4)
        try:
            fcntl.ioctl(self._pipe.fileno(), termios.FIONREAD, buf)
        except (OSError, ValueError):
            return 0
        return int.from_bytes(buf, sys.byteorder)

    def drain(self, timeout: float, quiet: float = 0.1) -> bool:
        """Wait up to ``timeout`` seconds until the pipe closed, or until everything written so far was handled.

        For a writer that exited while another process (a helper it started) still holds the pipe open: the
        pipe never closes while that process lives, but once nothing is left in it and the pump handled no
        new line for ``quiet`` seconds, everything the exited writer wrote is in the log and in :meth:`tail`
        (a last line without a line end excepted: it is handled when the pipe closes). The pump keeps
        copying whatever comes later until the pipe closes.

        Returns:
            True if the pipe closed (the pump is done), False otherwise.
        """
        deadline = time.monotonic() + timeout
        seen, since = self._lines, time.monotonic()
        while True:
            self._thread.join(min(0.02, max(0.0, deadline - time.monotonic())))
            if not self._thread.is_alive():
                return True
            now = time.monotonic()
            if self._lines != seen or self._pending():
                seen, since = self._lines, now
            elif now - since >= quiet:
                return False
            if now >= deadline:
                return False

    def tail(self) -> list[str]:
        """The last lines read (without line ends)."""
        return list(self._tail)


#: torch's ``init_process_group`` installs an excepthook that prefixes every line
#: of an uncaught exception's traceback with ``[rankN]: `` (``distributed_c10d.py``).
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


def strip_rank_prefix(line: str) -> str:
    """``line`` without torch's ``[rankN]: `` prefix (unchanged if it has none)."""
    return _RANK_PREFIX.sub("", line, count=1)


def error_excerpt(lines: list[str], max_lines: int = 5) -> str:
    """The first lines of the error in a worker's stderr ``lines``.

    If a Python traceback is present, the exception lines after the last one's
    stack frames (``ValueError: boom``, plus continuation lines); otherwise the
    last ``max_lines`` non-empty lines. A traceback printed by torch's
    excepthook carries a ``[rankN]: `` prefix on each line: the prefix is
    removed, and only lines with that prefix belong to it (what follows without
    it, e.g. a C++ warning at exit, is other output).
    """
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if strip_rank_prefix(lines[i]).startswith("Traceback (most recent call last):"):
            start = i
            break
    if start is not None:
        prefix = _RANK_PREFIX.match(lines[start])
        body = lines[start + 1 :]
        if prefix:
            own = []
            for ln in body:
                if ln.strip() and not ln.startswith(prefix.group(0).rstrip()):
                    break  # the hook writes blank lines without the prefix
                own.append(ln)
            body = own
        body = [strip_rank_prefix(ln) for ln in body]
        k = 0
        while k < len(body) and (body[k].startswith((" ", "\t")) or not body[k].strip()):
            k += 1
        exc_lines = [ln for ln in body[k:] if ln.strip()]
        if exc_lines:
            return "\n".join(exc_lines[:max_lines])
    non_empty = [strip_rank_prefix(ln) for ln in lines if ln.strip()]
    return "\n".join(non_empty[-max_lines:])


def stdout_console() -> IO[str]:
    """The launcher's current ``sys.stdout`` (looked up at write time)."""
    return sys.stdout


def stderr_console() -> IO[str]:
    """The launcher's current ``sys.stderr`` (looked up at write time)."""
    return sys.stderr
