"""``rdzv-run``: torchrun's launcher over any ``rdzv`` backend.

``main()`` parses the options (:mod:`rdzv_agent.launch.args`, :mod:`rdzv_agent.launch.config`:
the rendezvous URL is parsed once there), builds the handler with
:func:`rdzv_core.create_handler` (or torch's static rendezvous for
``--node-rank``/``--master-addr``/``--master-port``, :mod:`rdzv_agent.launch.static`),
runs a :class:`~rdzv_agent.local.LocalElasticAgent` and prints a one-screen
summary (:mod:`rdzv_agent.reporting.console`). ``python -m rdzv_agent`` runs the same ``main()``.

The workers die with the launcher: on Linux each gets SIGKILL from the kernel
if the launcher process dies without stopping them (``kill -9``), see
:mod:`rdzv_agent.workers.process`. So do the processes the workers start (helpers in new
sessions included): ``main()`` run as its own process (the ``rdzv-run`` command,
``python -m rdzv_agent``) makes the launcher their subreaper and starts a watch
process for ``kill -9`` (:mod:`rdzv_agent.workers.reaper`), unless ``--keep-orphans``.
``main(argv)`` called inside another program leaves that program's process
alone (it may have children of its own): there only the workers' trees are
stopped.

Exit status, and what happens to the run (as with ``torchrun``, whose
``launch_agent`` calls the handler's ``shutdown()`` unless a signal stopped it):

* 0 — the workers succeeded; as torchrun's agent, the node first waits at the
  *exit barrier* (``--exit-barrier-timeout``, 300 s) until every node of its round
  is done, then ``shutdown()`` closes the run (a new job needs a new run id). If
  the round ends meanwhile (another node failed and the others re-form) or the
  barrier times out, the node leaves the run open for the others instead;
* 0 — not included in the rendezvous (more nodes than ``max_nodes``):
  ``release()`` leaves it, the run stays open;
* 1 — the workers failed with no restarts left, the rendezvous timed out, the run
  was already closed, the backend failed, or a worker could not be started:
  ``shutdown()`` closes the run, so the job ends on every node;
* 2 — bad arguments or URL, a bad operations-hook variable or a taken health-check port
  (``docs/operations.md``; one line on stderr); the run is left open (``release()``);
* 2 — refused by the run: a setting every node must share (``min_nodes``/``max_nodes`` from
  ``--nnodes``, ``last_call_timeout``, ``keep_alive_ttl``, ``rank_policy``, ``closed_run_ttl``)
  differs from the one the run recorded when it was created (``RunConfigMismatchError``, one line
  on stderr naming the setting and both values); checked before the node joins anything, and the
  run is left open (``release()``): the other nodes carry on;
* 128 + N — stopped by signal N (``--signals-to-handle``, default SIGTERM, SIGINT, SIGHUP,
  SIGQUIT as torchrun; the workers get the list in ``TORCHELASTIC_SIGNALS_TO_HANDLE``): the signal is forwarded
  to the workers, they are stopped, and ``release()`` leaves the rendezvous
  *without* closing the run, so the other nodes re-form without this one.

Handlers without ``release()`` (torch's static rendezvous) are left alone where
``release()`` would be called, as torch does after a signal.

Secrets: the URL's password never reaches the workers' environment (``RDZV_URL``
and variables holding the password are dropped), their command lines, the logs
or the summary (the URL is shown redacted). If the password is on the
launcher's own command line, the launcher re-executes itself at once with the
URL moved into ``RDZV_URL`` (same pid), so ``ps`` no longer shows it; passing
the URL in ``RDZV_URL`` from the start keeps it off the command line entirely.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import urllib.parse
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from torch.distributed.elastic.metrics import api as metrics
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import _get_entrypoint_name

import rdzv_core
from rdzv_core.url import RendezvousURL

from ..api import SignalException, WorkerFailure, WorkerGroupFailureException, WorkerSpec
from ..elastic import elastic_handler
from ..local import LocalElasticAgent
from ..reporting.console import Reporter, Summary
from ..reporting.error_files import ERROR_FILE_ENV, launcher_error_data, write_error_file
from ..reporting.torch_events import METRIC_GROUP
from ..simple import AgentEvent
from ..supervision import health
from ..workers.log_specs import make_logs_specs
from ..workers.reaper import NodeReaper
from .args import URL_ENV, parse_args, strip_rdzv_options
from .config import LaunchConfig, Standalone, StaticRendezvous, build_config
from .worker_options import SIGNALS_ENV

if TYPE_CHECKING:
    from ..reporting.prometheus_metrics import AgentMetrics

__all__ = ["main", "worker_environment", "EXIT_FAILURE", "EXIT_USAGE"]

log = logging.getLogger(__name__)

EXIT_FAILURE = 1
EXIT_USAGE = 2


def _password_forms(password: str | None) -> list[str]:
    if not password:
        return []
    return sorted({password, urllib.parse.quote(password, safe=""), urllib.parse.quote(password)})


def worker_environment(environ: Mapping[str, str], password: str | None) -> dict[str, str]:
    """The workers' base environment: ``environ`` without the rendezvous URL or its password.

    Drops ``RDZV_URL`` and every variable whose value is the password or holds
    it as URL credentials (``:PASSWORD@``).
    """
    forms = _password_forms(password)

    def secret(value: str) -> bool:
        return any(value == f or f":{f}@" in value for f in forms)

    return {k: v for k, v in environ.items() if k != URL_ENV and not secret(v)}


def _configure_logging(level_arg: str | None) -> None:
    """Configure logging for the CLI only (the library installs no handlers).

    Raises:
        ConfigError: unknown level name.
    """
    level = (level_arg or os.environ.get("LOGLEVEL") or "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise rdzv_core.ConfigError("log_level", level, "expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _error(text: str) -> int:
    sys.stderr.write(f"rdzv-run: error: {text}\n")
    return EXIT_USAGE


def _reexec_without_password(raw_argv: Sequence[str], url: str, password: str | None) -> None:
    """If the password is on our command line, exec ourselves with the URL (``--rdzv``'s text) in
    ``RDZV_URL`` instead.

    ``/proc/PID/cmdline`` (what ``ps`` shows every user) then no longer holds it;
    ``/proc/PID/environ`` is readable by the owner only. Same pid, same signals.
    Does nothing if the password is not on the command line or stays there anyway.
    """
    forms = _password_forms(password)
    if not forms or not any(f in arg for f in forms for arg in raw_argv):
        return
    stripped = strip_rdzv_options(raw_argv)
    if any(f in arg for f in forms for arg in stripped):
        log.warning("the rendezvous password appears elsewhere on the command line; not hiding it")
        return
    env = {**os.environ, URL_ENV: url}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "rdzv_agent.launch.launcher", *stripped], env)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rdzv-run``; return the exit status (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``; only then may the launcher
            re-exec itself to take a password off its command line, and only then is
            it the reaper of its workers' processes, see the module docstring).
    """
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)  # exits 2 on bad options
    try:
        _configure_logging(args.log_level)
        config = build_config(args)
        if argv is None and config.url is not None:  # the URL's text as given: --rdzv, else RDZV_URL
            text = args.rdzv if args.rdzv is not None else os.environ.get(URL_ENV, "")
            _reexec_without_password(raw_argv, text, config.url.password)
    except ValueError as exc:
        return _error(str(exc))
    target = config.target
    heartbeat = health.Heartbeat()
    try:  # before the rendezvous, as torch's launch_agent
        server = health.start_server(config.ops.health_check_port, config.ops.health_check_timeout, heartbeat)
    except OSError as exc:
        return _error(str(exc))
    try:  # before the handler: its backend requests are then timed
        prom = _metrics_server(config.metrics_port)
    except OSError as exc:
        if server is not None:
            server.stop()
        return _error(f"--metrics-port {config.metrics_port}: {exc.strerror or exc}")
    standalone_dir = tempfile.mkdtemp(prefix="rdzv-standalone-") if isinstance(target, Standalone) else ""
    reaper = NodeReaper.start(config.shutdown_timeout) if argv is None and not config.keep_orphans else None
    try:
        return _launch(config, target.in_directory(standalone_dir) if isinstance(target, Standalone) else target,
                       heartbeat, prom, reaper)
    finally:
        if reaper is not None:
            reaper.close(config.shutdown_timeout + 10)
        if prom is not None:
            prom.stop()
        if server is not None:
            server.stop()
        if standalone_dir:
            shutil.rmtree(standalone_dir, ignore_errors=True)


def _open_rendezvous(config: LaunchConfig, target: RendezvousURL | StaticRendezvous, reporter: Reporter,
                     heartbeat: health.Heartbeat) -> tuple[Any, str, dict[str, Any]]:
    """The handler, the rendezvous as shown to a person, and the node counts/timeout (and the run's incarnation,
    ``None`` for a static rendezvous) shown.

    Raises:
        ValueError: a bad option (exit status 2).
        rdzv_core.RdzvError, RendezvousError: the backend cannot be opened (exit status 1).
    """
    if isinstance(target, StaticRendezvous):
        from .static import create_static_handler  # imports torch's static rendezvous only when used

        static = target
        shown: dict[str, Any] = {"min_nodes": static.nnodes, "max_nodes": static.nnodes, "timeout": static.timeout}
        return create_static_handler(static), static.describe(), shown
    url = target
    options: dict[str, Any] = {"on_progress": health.rendezvous_progress(heartbeat, reporter.progress)}
    if config.local_addr:
        options["local_addr"] = config.local_addr
    try:
        handler = rdzv_core.create_handler(url, **options)
    except (rdzv_core.RdzvError, RendezvousError) as exc:
        if isinstance(exc, ValueError):
            raise
        raise _OpenError(f"cannot open the rendezvous {url.redacted()}: {exc}") from exc
    elastic = elastic_handler(handler)
    settings = None if elastic is None else elastic.params  # the settings the handler runs with
    shown = {k: (None if settings is None else getattr(settings, k)) or url.params.get(k)
             for k in ("min_nodes", "max_nodes", "timeout")}
    shown["incarnation"] = None if settings is None else settings.incarnation  # URL, else SLURM_RESTART_COUNT
    return handler, url.redacted(), shown


class _OpenError(Exception):
    """The backend could not be opened (the message is safe to show)."""


def _metrics_server(port: int | None) -> AgentMetrics | None:
    """``--metrics-port``'s Prometheus server (:mod:`rdzv_agent.reporting.prometheus_metrics`), or ``None``.

    Raises:
        OSError: the port cannot be bound.
    """
    if port is None:
        return None
    from ..reporting.prometheus_metrics import AgentMetrics  # prometheus_client only when asked for

    prom = AgentMetrics()
    prom.serve(port)
    return prom


def _launch(config: LaunchConfig, target: RendezvousURL | StaticRendezvous, heartbeat: health.Heartbeat,
            prom: AgentMetrics | None = None, reaper: NodeReaper | None = None) -> int:
    reporter = Reporter()
    try:
        handler, shown_url, shown = _open_rendezvous(config, target, reporter, heartbeat)
    except ValueError as exc:
        return _error(str(exc))
    except _OpenError as exc:
        reporter.say(str(exc))
        _write_error_file([], exc.__cause__ or exc)
        return EXIT_FAILURE

    try:
        spec = WorkerSpec(
            config.role, config.nproc_per_node, config.program, config.program_args, handler,
            max_restarts=config.max_restarts, restart_window=config.restart_window,
            monitor_interval=config.monitor_interval,
            # static: the workers reuse node rank 0's store, whose address the handler gives
            master_port=config.master_port if config.static is None else None,
            local_addr=(config.master_addr or config.local_addr) if config.static is None else None,
            event_log_handler=config.event_log_handler,
        )

        def listener(event: AgentEvent) -> None:
            if prom is not None:
                prom.on_event(event)
            if event.kind == "rendezvous":
                reporter.waiting(handler.get_run_id(), shown["min_nodes"], shown["max_nodes"], shown["timeout"],
                                 event.data["attempt"], shown.get("incarnation"))
                if isinstance(target, StaticRendezvous):  # torch's handler reports no progress: bounded by its timeout
                    heartbeat.hold()
            else:
                if event.kind == "rendezvous_done":
                    heartbeat.beat(round=health.round_version(handler))
                reporter.event(event)

        logs_specs = make_logs_specs(config.logs_specs, config.log_dir, config.redirects, config.tee,
                                     config.local_ranks_filter)
        env = worker_environment(os.environ, target.password if isinstance(target, RendezvousURL) else None)
        env[SIGNALS_ENV] = config.signals_to_handle.text  # torch's launch_agent sets it; the workers inherit it
        agent = LocalElasticAgent(
            spec, logs_specs=logs_specs, log_line_prefix_template=config.log_line_prefix_template,
            duplicate_stdout_filters=config.duplicate_stdout_filters,
            duplicate_stderr_filters=config.duplicate_stderr_filters,
            env=env,
            listener=listener,
            stop_grace=config.shutdown_timeout, exit_barrier_timeout=config.exit_barrier_timeout,
            virtual_local_rank=config.virtual_local_rank, numa_cpus=config.numa_cpus,
            ops=config.ops, heartbeat=heartbeat,
            hang_timeout=config.hang_timeout, progress_interval=config.progress_interval, reaper=reaper,
            warm_imports=config.warm_imports, warm_checked=config.warm_checked, warm_after=config.warm_after,
        )
        if prom is not None:
            prom.attach(handler.get_run_id(), handler.get_backend(), lambda: agent.progress)
    except (ValueError, OSError) as exc:  # a bad field, or a --log-dir that cannot be created
        _release(handler)  # a usage error here must not end the job for the other nodes
        if isinstance(exc, OSError) and config.log_dir is not None:
            return _error(f"--log-dir {config.log_dir!r}: {exc.strerror or exc}")
        return _error(str(exc))

    if config.metrics_handler is not None:
        metrics.configure(config.metrics_handler, METRIC_GROUP)
    summary = _run(agent, handler, config.signals_to_handle.signals)
    summary.run_id, summary.url = handler.get_run_id(), shown_url
    summary.entry_point = _get_entrypoint_name(config.program, config.program_args)
    sys.stderr.write(summary.render() + "\n")
    sys.stderr.flush()
    if summary.exit_code != 0:
        _write_error_file(summary.failures, summary.error)
    return summary.exit_code


def _write_error_file(failures: Sequence[WorkerFailure], error: BaseException | None) -> None:
    """Write the launcher's error file if ``TORCHELASTIC_ERROR_FILE`` is set (see :mod:`.errors_report`)."""
    path = os.environ.get(ERROR_FILE_ENV)
    data = launcher_error_data(failures, error) if path else None
    if path and data is not None:
        write_error_file(path, data)


def _run(agent: LocalElasticAgent, handler: Any, signals: Sequence[signal.Signals]) -> Summary:
    """Run the agent, stopping on ``signals`` (``--signals-to-handle``); close or leave the rendezvous (see the
    module docstring); summarize."""
    pending: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if pending:  # already stopping: note it, do not interrupt the cleanup
            log.warning("received %s while stopping; still stopping", signal.Signals(signum).name)
            return
        pending.append(signum)
        raise SignalException(signum)

    def raise_lost_signal() -> None:
        """A handled signal's exception can be lost: raised in a callback whose exceptions Python prints and
        drops (an at-fork hook while the launcher forks a worker, a finalizer). The agent's loop still
        running with a signal pending means it was: raise it again there."""
        if pending and pending[0] != 0:
            raise SignalException(pending[0])

    agent.check_interrupted = raise_lost_signal
    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    failures: list[WorkerFailure] = []
    raised: BaseException | None = None
    close = True  # torchrun: shutdown() (closes the run) unless stopped by a signal
    finished = False  # release() as a member that finished (the others carry on in the round)
    try:
        try:
            try:
                agent.run()
            except BaseException as exc:
                raised = exc
                raise
            finally:
                pending.append(0)  # from here on, signals no longer interrupt the cleanup
            code, outcome = 0, "SUCCEEDED"
            if agent.exit_barrier == "left":  # the others re-form without this node: the job goes on
                close, outcome = False, "SUCCEEDED (the other nodes re-formed without this one: run left open)"
            elif agent.exit_barrier == "timeout":  # the others still train: leave them the round and the run
                close, finished = False, True
                outcome = "SUCCEEDED (the other nodes did not finish within --exit-barrier-timeout: run left open)"
            elif agent.exit_barrier == "unreachable":  # nobody knows whether the others finished: leave the run
                close, finished = False, True
                outcome = ("SUCCEEDED (the rendezvous backend did not answer at the exit barrier for "
                           "--exit-barrier-timeout: run left open)")
        except WorkerGroupFailureException as exc:
            failures = [e for e in exc.get_worker_exceptions().values() if isinstance(e, WorkerFailure)]
            code, outcome = EXIT_FAILURE, f"FAILED: {exc}"
        except RendezvousGracefulExitError as exc:
            close = False
            code, outcome = 0, f"not included in the rendezvous, exiting: {exc}"
        except RendezvousTimeoutError as exc:
            code, outcome = EXIT_FAILURE, f"rendezvous timed out: {exc}"
        except RendezvousClosedError as exc:
            code, outcome = EXIT_FAILURE, f"the run is closed (finished or closed by another node): {exc}"
        except rdzv_core.RunConfigMismatchError as exc:  # before joining: the others are not disturbed
            close = False
            code, outcome = EXIT_USAGE, f"refused by the run: {exc}"
            sys.stderr.write(f"rdzv-run: error: {exc}\n")
        except (RendezvousError, rdzv_core.RdzvError) as exc:
            code, outcome = EXIT_FAILURE, f"rendezvous failed: {type(exc).__name__}: {exc}"
        except SignalException as exc:
            close = False
            code, outcome = 128 + exc.signum, f"interrupted: {exc}; workers stopped, the run left open for the others"
        except OSError as exc:
            code, outcome = EXIT_FAILURE, f"cannot start the workers: {exc}"
    finally:  # also when something unexpected propagates (then the run is closed, as torchrun does)
        # torch's launch_agent: SUCCEEDED when run() ended, failed workers included; FAILED when it raised
        ended = isinstance(raised, (WorkerGroupFailureException, RendezvousGracefulExitError))
        agent.telemetry.agent_ended(None if raised is None or ended else raised)
        _finish_rendezvous(handler, close, finished)
        for sig, old in previous.items():
            signal.signal(sig, old)

    group = agent.get_worker_group()
    return Summary(
        outcome=outcome,
        exit_code=code,
        restarts_used=agent.restart_count,
        max_restarts=group.spec.max_restarts,
        membership_restarts=agent.membership_restarts,
        group_rank=group.group_rank,
        group_world_size=group.group_world_size,
        world_size=group.workers[0].world_size if group.workers else None,
        workers=agent.worker_exit_codes(),
        failures=failures,
        log_dir=agent.log_dir,
        error=raised if code != 0 else None,
    )


def _finish_rendezvous(handler: Any, close: bool, finished: bool = False) -> None:
    """End the rendezvous as ``torchrun`` does: ``shutdown()`` (closes the run) or, if not ``close``, ``release()``.

    ``shutdown()`` of rdzv's handler marks the run closed, leaves the round and
    releases the backend, returning ``False`` (after logging a WARNING) if it could
    not close the run; ``release()`` leaves the round, the run stays open
    (``finished``: as a member whose work is done, so the others carry on in the round).
    """
    if not close:
        _release(handler, finished)
        return
    try:
        handler.shutdown()
    except (RendezvousError, rdzv_core.RdzvError) as exc:
        log.warning("could not shut the rendezvous down cleanly: %s", exc)


def _release(handler: Any, finished: bool = False) -> None:
    """``handler.release()`` if it has one (rdzv's); torch's handlers are left alone, as torch does after a signal."""
    elastic = elastic_handler(handler)
    if elastic is None:
        return
    try:
        elastic.release(finished=True) if finished else elastic.release()
    except (RendezvousError, rdzv_core.RdzvError) as exc:
        log.warning("could not leave the rendezvous cleanly: %s", exc)


if __name__ == "__main__":
    sys.exit(main())
