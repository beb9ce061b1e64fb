"""The workers' watchdog: torch's ``FileTimerServer`` (``torch.distributed.elastic.timer``), as torchrun runs it.

With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` the agent runs torch's own server on a
named pipe for each start of the group and gives every worker its path in
``TORCHELASTIC_TIMER_FILE``, so worker code written for torchrun
(``timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))``,
``with timer.expires(after=...)``) works unchanged: an expired scope gets the worker
the client's signal (SIGKILL) and the agent sees a failed worker (restarted while
restarts last). Semantics of torch's ``LocalElasticAgent._setup_local_watchdog``:
the pipe is ``TORCHELASTIC_TIMER_FILE`` if set, else a new
``$TMPDIR/watchdog_timer_<uuid4>`` per start; started after the rendezvous, before
the workers; stopped before they are stopped; ``max_interval`` 0.1 s.

Two differences from torch, both torch bugs: after killing a worker, torch's server
SIGKILLs its own process -- the whole torchrun agent, leaving the other workers
behind and ignoring ``--max-restarts``; here it kills the worker only. And stopping
a server whose pipe no client ever opened leaks its thread (blocked in ``open()``);
here :meth:`WorkerWatchdog.stop` unblocks it first.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
import uuid
from typing import Iterable, Mapping, MutableMapping

from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest, FileTimerServer

from rdzv_core.errors import ConfigError

__all__ = ["WorkerWatchdog", "ENABLE_ENV", "FILE_ENV", "settings_from_env"]

log = logging.getLogger(__name__)

ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
FILE_ENV = "TORCHELASTIC_TIMER_FILE"


def settings_from_env(environ: Mapping[str, str]) -> tuple[bool, str | None]:
    """``(enabled, pipe path or None)`` from ``TORCHELASTIC_ENABLE_FILE_TIMER`` / ``TORCHELASTIC_TIMER_FILE``.

    ``1`` enables (torch's test), ``0`` or empty disables.

    Raises:
        ConfigError: any other value (torch silently disables; ``true`` would then be a trap).
    """
    raw = environ.get(ENABLE_ENV)
    if raw is not None and raw.strip() not in ("0", "1", ""):
        raise ConfigError(ENABLE_ENV, raw, "expected 1 (enable torch's file timer) or 0")
    path = environ.get(FILE_ENV) or None
    return raw is not None and raw.strip() == "1", path


class _AgentTimerServer(FileTimerServer):
    """torch's ``FileTimerServer`` that reaps workers but never its own process."""

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():  # torch's server kills itself (the agent) after reaping a worker
            return True
        return bool(super()._reap_worker(worker_pid, signal))

    def stop(self) -> None:
        self._stop_signaled = True
        thread = self._watchdog_thread
        deadline = time.monotonic() + 2.0
        # a thread blocked opening the pipe (no client yet) wakes when a writer opens it, then sees the stop;
        # ENXIO: it has not reached open() yet, try again
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            try:
                os.close(os.open(self._file_path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    break
            thread.join(0.02)
        super().stop()


class WorkerWatchdog:
    """Starts and stops torch's timer server around each start of the worker group.

    Args:
        enabled: run the server (``TORCHELASTIC_ENABLE_FILE_TIMER=1``).
        file_path: the pipe's path (``TORCHELASTIC_TIMER_FILE``), or ``None`` for a new one per start.
    """

    def __init__(self, enabled: bool = False, file_path: str | None = None) -> None:
        self._enabled = enabled
        self._file_path = file_path
        self._server: _AgentTimerServer | None = None
        self.reaped: dict[int, str] = {}  #: pid -> scope of the expired timer torch's server reaped it for

    @property
    def enabled(self) -> bool:
        """Whether the server runs."""
        return self._enabled

    def start(self, run_id: str, envs: Iterable[MutableMapping[str, str]]) -> None:
        """Start a server (when enabled) and set ``TORCHELASTIC_TIMER_FILE`` in each worker's ``envs``.

        Raises:
            OSError: the pipe cannot be created.
        """
        self.stop()
        self.reaped.clear()  # the previous start's workers were judged already
        path = self._file_path
        if self._enabled:
            if path is None:
                path = os.path.join(tempfile.gettempdir(), "watchdog_timer_" + str(uuid.uuid4()))
            self._server = _AgentTimerServer(path, run_id, max_interval=0.1, daemon=True, log_event=self._event)
            self._server.start()
            log.info("watchdog (torch's FileTimerServer) started on %s", path)
        if path is not None:
            for env in envs:
                env[FILE_ENV] = path

    def stop(self) -> None:
        """Stop the server and remove its pipe (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def _event(self, name: str, request: FileTimerRequest | None) -> None:
        if name == "kill worker process" and request is not None:
            self.reaped[request.worker_pid] = request.scope_id
            log.warning("watchdog: timer %r of worker pid %d expired; killed it with signal %d",
                        request.scope_id, request.worker_pid, request.signal)
