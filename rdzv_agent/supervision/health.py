"""A real health-check endpoint on ``TORCHELASTIC_HEALTH_CHECK_PORT`` (torch's is a no-op in open source).

torch's contract (``torch.distributed.elastic.agent.server.health_check_server``):
``alive_callback()`` gives the agent's last progress time (Unix seconds) and the
agent counts as alive while ``now - alive_callback() <= timeout`` (torch passes 60 s).
:class:`HttpHealthCheckServer` keeps that contract and serves it over HTTP: every
``GET`` or ``HEAD`` (any path) answers ``200`` while alive and ``503`` once progress
stalled past the timeout, with a small JSON body (:meth:`HttpHealthCheckServer.answer`).
Progress is a :class:`Heartbeat` that the agent's monitor loop, the rendezvous's
progress callback and the round setup waits beat. See ``docs/operations.md``.

The server is the standard library's ``http.server`` in a daemon thread: a liveness
probe needs one ``GET``, not a dependency.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, cast

from torch.distributed.elastic.agent.server.health_check_server import HealthCheckServer

from rdzv_core.errors import ConfigError

from ..elastic import elastic_handler

__all__ = ["Heartbeat", "HttpHealthCheckServer", "PORT_ENV", "TIMEOUT_ENV", "DEFAULT_TIMEOUT",
           "port_from_env", "timeout_from_env", "rendezvous_progress", "round_version",
           "start_server"]

log = logging.getLogger(__name__)

#: torch's variable (``local_elastic_agent.TORCHELASTIC_HEALTH_CHECK_PORT``).
PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"
#: Seconds without progress before the answer turns 503 (torch hard-codes 60; rdzv's own variable).
TIMEOUT_ENV = "RDZV_HEALTH_CHECK_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


def port_from_env(environ: Mapping[str, str]) -> int | None:
    """The port in ``TORCHELASTIC_HEALTH_CHECK_PORT``, or ``None`` when unset or empty (as torch: no server).

    Raises:
        ConfigError: not an integer 1..65535 (torch logs and serves nothing instead).
    """
    raw = environ.get(PORT_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        port = int(raw.strip())
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(PORT_ENV, raw, "expected a TCP port 1..65535")
    return port


def timeout_from_env(environ: Mapping[str, str]) -> float:
    """``RDZV_HEALTH_CHECK_TIMEOUT`` in seconds (default 60, torch's value).

    Raises:
        ConfigError: not a finite number > 0.
    """
    raw = environ.get(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT if raw is None else positive_seconds(TIMEOUT_ENV, raw)


def positive_seconds(name: str, raw: str) -> float:
    """The value ``raw`` of variable ``name`` as seconds.

    Raises:
        ConfigError: not a finite number > 0 (names the variable and the value).
    """
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ConfigError(name, raw, "expected a finite number of seconds > 0")
    return value


class Heartbeat:
    """The agent's last progress (thread-safe) and what it was doing.

    :meth:`beat` records progress now and updates the fields shown by the health
    check; :meth:`hold` marks a wait that is bounded elsewhere (the exit barrier,
    a handler that reports no progress), alive until the next :meth:`beat`, as
    torch's ``LocalElasticAgent._get_alive_time`` does during the exit barrier.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._held = False
        self._fields: dict[str, Any] = {"state": "INIT", "step": "starting", "round": None, "restart_count": 0,
                                        "rendezvous_count": 0, "group_rank": None}

    def beat(self, **fields: Any) -> None:
        """Progress now; ``fields`` (JSON values) replace the shown ones of the same name."""
        with self._lock:
            self._last, self._held = self._clock(), False
            self._fields.update(fields)

    def hold(self, **fields: Any) -> None:
        """Progress now, and alive until the next :meth:`beat` (a wait with its own bound)."""
        self.beat(**fields)
        with self._lock:
            self._held = True

    def last_progress(self) -> float:
        """Unix time of the last progress (now while held): torch's ``alive_callback``."""
        with self._lock:
            return self._clock() if self._held else self._last

    def fields(self) -> dict[str, Any]:
        """A copy of the shown fields."""
        with self._lock:
            return dict(self._fields)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: HttpHealthCheckServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _answer(self, with_body: bool) -> None:
        code, body = self.server.owner.answer()
        data = (json.dumps(body, sort_keys=True) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if with_body:
            self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("health check %s: " + format, self.client_address[0], *args)


class HttpHealthCheckServer(HealthCheckServer):
    """torch's ``HealthCheckServer`` interface, serving HTTP on ``port`` (all IPv4 interfaces).

    Args:
        alive_callback: the last progress time, Unix seconds (e.g. :meth:`Heartbeat.last_progress`).
        port: TCP port 1..65535.
        timeout: seconds without progress before answers turn 503 (> 0).
        status: extra JSON fields for the body (e.g. :meth:`Heartbeat.fields`); optional.

    Raises (from :meth:`start`):
        OSError: the port cannot be bound (e.g. ``EADDRINUSE``).
    """

    def __init__(self, alive_callback: Callable[[], float], port: int, timeout: float,
                 status: Callable[[], Mapping[str, Any]] | None = None) -> None:
        super().__init__(cast(Callable[[], int], alive_callback), port, math.ceil(timeout))
        self._limit = float(timeout)
        self._status = status
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    def answer(self) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, body)``: 200 while ``now - alive_callback() <= timeout``, else 503.

        The body has ``status`` (``"ok"`` or ``"stalled"``), ``last_progress`` (Unix s),
        ``seconds_since_progress``, ``timeout`` and the ``status`` callback's fields.
        """
        last = float(self._alive_callback())
        age = max(0.0, time.time() - last)
        alive = age <= self._limit
        body = dict(self._status() if self._status is not None else {})
        body.update(status="ok" if alive else "stalled", last_progress=round(last, 3),
                    seconds_since_progress=round(age, 3), timeout=self._limit)
        return (200 if alive else 503), body

    def start(self) -> None:
        """Bind the port and serve in a daemon thread (idempotent)."""
        if self._httpd is not None:
            return
        httpd = _Server(("", self._port), _Handler)
        httpd.owner = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"rdzv-health-{self._port}", daemon=True)
        self._thread.start()
        log.info("health check serving on port %d (timeout %.1f s)", self._port, self._limit)

    def stop(self) -> None:
        """Stop serving and close the port (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)


def rendezvous_progress(heartbeat: Heartbeat, forward: Callable[[Any], None]) -> Callable[[Any], None]:
    """An ``on_progress`` callback for rdzv's handler: beats ``heartbeat`` (``round``, ``phase``), then ``forward``."""

    def on_progress(progress: Any) -> None:
        heartbeat.beat(step="rendezvous", phase=getattr(progress, "phase", None),
                       round=getattr(progress, "version", None))
        forward(progress)

    return on_progress


def round_version(handler: Any) -> int | None:
    """The version of the round rdzv's ``handler`` is in (``None`` for other handlers, e.g. torch's static)."""
    elastic = elastic_handler(handler)
    return None if elastic is None else elastic.round_version()


def start_server(port: int | None, timeout: float, heartbeat: Heartbeat) -> HttpHealthCheckServer | None:
    """Serve ``heartbeat`` on ``port`` (``None``: no server).

    Raises:
        OSError: the port cannot be bound; the message names ``TORCHELASTIC_HEALTH_CHECK_PORT`` and the port.
    """
    if port is None:
        return None
    server = HttpHealthCheckServer(heartbeat.last_progress, port, timeout, heartbeat.fields)
    try:
        server.start()
    except OSError as exc:
        raise OSError(exc.errno, f"{PORT_ENV}={port}: cannot serve the health check: {exc.strerror or exc}") from exc
    return server
