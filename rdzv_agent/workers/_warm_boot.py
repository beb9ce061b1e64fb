"""The program a warm worker runs (:mod:`rdzv_agent.workers.warm`): import ahead, wait, then be the worker.

Stdlib only; run by file path in a separate namespace (``python -u -c LOADER THIS_FILE ...``,
:data:`rdzv_agent.workers.warm.LOADER`), so neither ``rdzv_agent`` nor this module is in ``sys.modules``.
Arguments after this file's path: the socket's fd, the entry kind (``script``, ``module``
or ``code``), the entry (a path, a module name or code), the modules to import ahead
(comma-separated) and the worker's arguments.

Before the imports it sets ``sys.argv`` and ``sys.path[0]`` as a cold ``python -u ENTRY ARGS``
would have them while it imports (at ``SCHED_IDLE``, set by the launcher until the round needs
it). After the imports it writes ``R`` (ready) or ``F`` + the error on the socket, then blocks
on it. The activation message (an 8-byte length, JSON ``{"env", "cwd"}``, the stdout and stderr
fds) makes it replace ``os.environ``, change directory, move its stdout/stderr onto the given
fds (replaying what the imports wrote), restore the signal dispositions it started with, reset
``__main__`` and run the entry as CPython would. The socket closing first (the launcher dropped
it, or died) ends it with status 0.
"""

import json
import os
import signal
import socket
import sys
import types
from typing import Any

_HEADER = 8
_MAIN_KEYS = ("__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__", "__builtins__")


def _recv_activation(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The activation message and its fds; exits 0 if the launcher closed the socket first."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
    if not data:
        os._exit(0)
    while len(data) < _HEADER or len(data) < _HEADER + int.from_bytes(data[:_HEADER], "big"):
        more = sock.recv(1 << 16)
        if not more:
            os._exit(0)
        data += more
    return json.loads(data[_HEADER:].decode("utf-8")), list(fds)


def _captured(fd: int) -> bytes:
    """What was written to ``fd`` (a temporary file from the launcher) since the start."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return b""


def _strip_boot_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without its leading frames of this file (the traceback as a cold start prints it)."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _run(kind: str, entry: str, main_globals: dict[str, Any]) -> None:
    """Run the entry in ``__main__`` as ``python -u ENTRY`` / ``-m ENTRY`` / ``-c ENTRY`` does."""
    if kind == "script":
        path = entry if os.path.isabs(entry) else os.path.join(os.getcwd(), entry)  # CPython's: joined, not normalized
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as exc:  # gone or unreadable since the warm process started: CPython's words and status
            sys.stderr.write(f"{sys.orig_argv[0]}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None
        from importlib.machinery import SourceFileLoader

        main_globals.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))
        exec(compile(source, path, "exec"), main_globals)
    elif kind == "module":
        import runpy

        runpy._run_module_as_main(entry, alter_argv=True)  # type: ignore[attr-defined]  # what `python -m` calls
    else:
        exec(compile(entry, "<string>", "exec"), main_globals)


def main() -> None:
    """The warm worker (see the module)."""
    sock_fd, kind, entry, imports = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    args = sys.argv[6:]
    signals = {}
    for sig in signal.valid_signals():
        try:
            signals[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
    main_module = sys.modules["__main__"]
    fresh_main = {k: main_module.__dict__[k] for k in _MAIN_KEYS if k in main_module.__dict__}
    if kind == "script":
        sys.argv = [entry, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(entry))
    elif kind == "module":
        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = ["-c", *args]
        sys.path[0] = ""
    sock = socket.socket(fileno=sock_fd)
    status = b"R\n"
    for name in ["torch", *filter(None, imports.split(","))]:
        try:
            __import__(name)
        except BaseException as exc:  # noqa: BLE001 -- any failure of an import ahead: the worker still runs
            status = f"F{name}: {type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n"
            break
    try:
        sock.sendall(status)
    except OSError:  # the launcher activated this process already (and closed its end), or is gone
        pass
    message, fds = _recv_activation(sock)
    sock.close()
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    sys.stdout.flush()
    sys.stderr.flush()
    early = [_captured(1), _captured(2)]
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for target, data in zip((1, 2), early, strict=True):
        if data:
            os.write(target, data)
    for sig, handler in signals.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
    main_globals = main_module.__dict__
    main_globals.clear()
    main_globals.update(fresh_main)
    sys.modules["__main__"] = main_module
    del message, fds, early, sock, status
    try:
        _run(kind, entry, main_globals)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 -- printed as the interpreter prints an uncaught exception
        tb = _strip_boot_frames(exc.__traceback__)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        del exc, tb
        sys.exit(1)
