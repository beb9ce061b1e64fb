"""The root cause of a failed job, and the launcher's own error file, in torch elastic's formats.

A worker that uses torch's ``@record`` writes its error file at its ``TORCHELASTIC_ERROR_FILE``
(``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``).
:func:`root_cause_text` shows the failures as torch's ``ChildFailedError`` does (its own
formatting, torch's ``ProcessFailure`` reading the files), and :func:`launcher_error_data`
is what torchrun's ``@record``-decorated ``main`` writes at the *launcher's*
``TORCHELASTIC_ERROR_FILE`` (torch's ``ErrorHandler.dump_error_file`` / ``record_exception``).

Better than torch (``torch.distributed.elastic.multiprocessing.errors``):

* the root cause is the first worker to *exit* (sub-second, as the agent saw it); torch picks
  the smallest error-file timestamp, in whole seconds, so within one second the lowest
  rank wins, whichever failed first;
* a root cause without an error file (no ``@record``, or killed by a signal) still gives the
  launcher an error file (torch's shape, the message and the end of the worker's stderr);
  torchrun then writes none. The summary shows that stderr instead of torch's link;
* the launcher's copy says which worker it was: ``extraInfo`` gains ``rank``,
  ``local_rank`` and ``hostname`` (torch copies the worker's file with ``errorCode`` only).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import time
import traceback
from typing import Any, Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure

from ..api import WorkerFailure, describe_exit

__all__ = ["ERROR_FILE_ENV", "process_failure", "root_cause_text", "launcher_error_data", "write_error_file"]

log = logging.getLogger(__name__)

#: Where torch's ``@record`` (and so torchrun's ``main``) writes its error file.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: Traceback lines of each failure shown in the summary (the end of it; the file has all).
SUMMARY_TRACEBACK_LINES = 12


def process_failure(failure: WorkerFailure) -> ProcessFailure:
    """torch's ``ProcessFailure`` of ``failure`` (reads its error file); the time is the exit's if it has none.

    An error file that is not JSON counts as none (torch's raises).
    """
    path = failure.error_file or ""
    code = failure.exit_code if failure.exit_code is not None else 1
    try:
        pf = ProcessFailure(failure.local_rank, failure.pid or 0, code, path)
    except (ValueError, KeyError, TypeError, OSError):  # unreadable, not JSON, or not torch's shape
        pf = ProcessFailure(failure.local_rank, failure.pid or 0, code, "")
    if pf.error_file != path and failure.timestamp is not None:  # no error file: torch stamps "now"
        pf.timestamp = int(failure.timestamp)
    pf.error_file_data = copy.deepcopy(pf.error_file_data)  # torch shares one dict among file-less failures
    return pf


class _RootFirst(ChildFailedError):
    """torch's ``ChildFailedError`` whose root cause is the first entry (the first to exit), not the lowest
    whole-second timestamp."""

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        rank = next(iter(self.failures))
        return rank, self.failures[rank]


def _excerpt(pf: ProcessFailure, failure: WorkerFailure, lines: int) -> ProcessFailure:
    """A copy of ``pf`` whose traceback is its last ``lines`` lines, or the worker's stderr if it has no file."""
    shown = copy.copy(pf)
    message = pf.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        stack = str(extra.get("py_callstack", message.get("message", ""))).rstrip().splitlines()
        text = "\n".join((["..."] if len(stack) > lines else []) + stack[-lines:])
        shown.message = {**message, "extraInfo": {**extra, "py_callstack": text}}
    elif failure.error.strip() and pf.exitcode >= 0:  # torch would show a link to its docs here
        shown.message = "\n  ".join(failure.error.strip().splitlines()[-lines:])
    return shown


def root_cause_text(failures: Sequence[WorkerFailure], name: str, max_failures: int = 4) -> str:
    """The failures (first to exit first) as torch's ``ChildFailedError`` message, tracebacks cut short.

    Args:
        failures: the failed workers, the first to exit first (non-empty).
        name: the entry point's name (torch's title: ``NAME FAILED``).
        max_failures: failures shown (the root cause and the next ones).
    """
    shown = {f.global_rank: _excerpt(process_failure(f), f, SUMMARY_TRACEBACK_LINES)
             for f in list(failures)[:max_failures]}
    return str(_RootFirst(name, shown)).strip("\n")


def _exception_data(error: BaseException) -> dict[str, Any]:
    """torch's ``ErrorHandler.record_exception`` data for ``error``."""
    return {"message": {
        "message": f"{type(error).__name__}: {error}",
        "extraInfo": {"py_callstack": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
                      "timestamp": str(int(time.time()))},
    }}


def launcher_error_data(failures: Sequence[WorkerFailure], error: BaseException | None) -> dict[str, Any] | None:
    """What the launcher writes at its ``TORCHELASTIC_ERROR_FILE``, or ``None`` (nothing failed).

    The root cause's (``failures[0]``) error file with ``errorCode`` set to its exit status, as torch's
    ``dump_error_file`` does, plus ``extraInfo.rank``/``local_rank``/``hostname``; a root cause without
    one gets torch's shape with its exit status and stderr; no failed worker: torch's
    ``record_exception`` data of ``error``.
    """
    if not failures:
        return _exception_data(error) if error is not None else None
    root = failures[0]
    pf = process_failure(root)
    where = {"rank": root.global_rank, "local_rank": root.local_rank, "hostname": socket.getfqdn()}
    if pf.error_file == root.error_file:
        data = copy.deepcopy(pf.error_file_data)
        if pf.exitcode:
            ErrorHandler().override_error_code_in_rootcause_data(pf.error_file, data, pf.exitcode)
        if isinstance(data.get("message"), dict):
            data["message"].setdefault("extraInfo", {}).update(where)
        return data
    stderr = root.error.strip() or "(no error output)"
    message = f"rank {root.global_rank} (local rank {root.local_rank}, pid {root.pid}) {describe_exit(root.exit_code)}"
    return {"message": {"message": message, "errorCode": pf.exitcode,
                        "extraInfo": {"py_callstack": stderr, "timestamp": str(pf.timestamp), **where}}}


def write_error_file(path: str, data: dict[str, Any]) -> bool:
    """Write ``data`` as JSON at ``path``, replacing a file already there (torch does the same); False on error."""
    try:
        if os.path.isfile(path):
            os.remove(path)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError as exc:
        log.warning("could not write the error file %s=%s: %s", ERROR_FILE_ENV, path, exc)
        return False
    return True
