"""Worker side of progress reporting: ``rdzv_agent.progress.step(n)``, and stack dumps on request.

Under ``rdzv-run`` every worker gets two variables (``docs/operations.md``, "Progress and hangs"):

``RDZV_PROGRESS_FILE``
    a file of its own. :func:`step` overwrites it with the step number (decimal ASCII); a
    worker with nothing to import does the same (``echo 42 > "$RDZV_PROGRESS_FILE"``, or
    ``open(path, "w").write("42")``). The agent reads it every ``--monitor-interval``: any
    rewrite is progress, the time is the file's modification time. No backend access.
``RDZV_STACK_FILE``
    where this worker's Python stacks go when its agent asks: importing this module
    registers :func:`faulthandler.register` for :data:`DUMP_SIGNAL` (SIGUSR1) there
    (unless the program already handles SIGUSR1) and creates the file, which tells the
    agent the signal is safe to send. The agent prefers ``py-spy dump`` when it is installed.

Without these variables (not under ``rdzv-run``) :func:`step` does nothing.
"""

from __future__ import annotations

import faulthandler
import operator
import os
import signal
import threading
import warnings
from typing import IO

__all__ = ["step", "FILE_ENV", "STACK_ENV", "DUMP_SIGNAL", "RECORD_BYTES"]

FILE_ENV = "RDZV_PROGRESS_FILE"
STACK_ENV = "RDZV_STACK_FILE"
#: The signal the agent sends for a faulthandler dump.
DUMP_SIGNAL = signal.SIGUSR1
#: Bytes :func:`step` writes each time: the number padded with spaces, then a newline (a shorter number
#: written over a longer one leaves no digits behind).
RECORD_BYTES = 24

_lock = threading.Lock()
_fd: int | None = None
_BROKEN = -1  # _fd once the progress file could not be opened
_dump_file: IO[str] | None = None  # kept open: faulthandler writes to its descriptor


def step(n: int) -> None:
    """Report that this worker reached step ``n``: one ``pwrite`` of :data:`RECORD_BYTES` bytes.

    ``n`` is anything with ``__index__`` (an int, a numpy integer, an integer 0-d tensor). Not under
    ``rdzv-run``: does nothing. A progress file that cannot be opened is reported once as a warning
    and reporting stops: a progress hook never ends the training.

    Raises:
        TypeError: under ``rdzv-run``, ``n`` is not an integer (e.g. a float or a bool).
    """
    global _fd
    if _fd is None:
        path = os.environ.get(FILE_ENV)
        if not path:
            return
        with _lock:
            if _fd is None:
                try:
                    _fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                except OSError as exc:
                    _fd = _BROKEN
                    warnings.warn(f"rdzv_agent.progress: cannot open {FILE_ENV}={path!r} ({exc}); "
                                  "progress is not reported", RuntimeWarning, stacklevel=2)
                    return
    if _fd == _BROKEN:
        return
    if isinstance(n, bool):
        raise TypeError("step(n) takes an integer, got bool")
    try:
        value = operator.index(n)
    except TypeError:
        raise TypeError(f"step(n) takes an integer, got {type(n).__name__}") from None
    os.pwrite(_fd, str(value).encode("ascii").ljust(RECORD_BYTES - 1) + b"\n", 0)


def _register_stack_dump() -> None:
    """Register faulthandler on :data:`DUMP_SIGNAL` into ``$RDZV_STACK_FILE`` (see the module docstring)."""
    global _dump_file
    path = os.environ.get(STACK_ENV)
    if not path or _dump_file is not None or signal.getsignal(DUMP_SIGNAL) is not signal.SIG_DFL:
        return
    try:
        _dump_file = open(path, "a", encoding="utf-8")
    except OSError:
        return
    faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True, chain=False)


_register_stack_dump()
