"""``LocalElasticAgent``: run the workers as subprocesses of this node.

Each worker is ``[spec.fn, *spec.args]`` (a Python interpreter with a script or
``-m module``, or any executable), started in its own session with torchrun's
environment variables:

=============================  =====================================================
``LOCAL_RANK``                 rank among this node's workers
``RANK``                       global rank: group rank order, then local rank (torch's rule)
``ROLE_RANK``                  rank among the workers of this role
``GROUP_RANK``                 this node's rank in the round
``WORLD_SIZE``                 workers in the round (the sum over nodes of their local world size)
``ROLE_WORLD_SIZE``            workers of this role in the round
``LOCAL_WORLD_SIZE``           workers on this node
``GROUP_WORLD_SIZE``           nodes in the round
``ROLE_NAME``                  the spec's role
``MASTER_ADDR``/``MASTER_PORT``  published by group rank 0 (:mod:`rdzv_agent.master_address`)
``TORCHELASTIC_RESTART_COUNT`` restarts spent on failures so far
``TORCHELASTIC_MAX_RESTARTS``  the spec's ``max_restarts``
``TORCHELASTIC_RUN_ID``        ``handler.get_run_id()``
``TORCHELASTIC_ERROR_FILE``    per worker; torch's ``@record`` writes the error there
``TORCHELASTIC_USE_AGENT_STORE``  ``True`` if the handler shares its store with the
                               workers (``use_agent_store``, e.g. static), else ``False``
``OMP_NUM_THREADS``            ``1`` if unset and more than one local worker
``PYTHONUNBUFFERED``           ``1``
``TORCH_NCCL_ASYNC_ERROR_HANDLING``  the parent's, else ``1`` (torch's default)
``CUDA_VISIBLE_DEVICES``       with ``virtual_local_rank``: the worker's own device, and
                               ``LOCAL_RANK`` is 0 (:func:`~rdzv_agent.launch.worker_options.local_rank_env`)
``TORCHELASTIC_TIMER_FILE``    the watchdog's pipe, with ``ops.file_timer`` (:mod:`rdzv_agent.supervision.watchdog`)
``RDZV_PROGRESS_FILE``         where the worker reports its step (:mod:`rdzv_agent.progress`)
``RDZV_STACK_FILE``            where its Python stacks go on a hang (:mod:`rdzv_agent.supervision.hang_watch`)
``RDZV_REAPER_TOKEN``          with a ``reaper``: marks what the worker starts (:mod:`rdzv_agent.workers.reaper`)
=============================  =====================================================

With ``warm_imports`` (``rdzv-run --warm-workers``) each start of the workers uses the warm
processes kept ready for it where they can start the worker exactly (:mod:`rdzv_agent.workers.warm`).

With ``numa_cpus`` each worker runs under ``numactl --physcpubind`` (``--numa-binding``).

With a ``reaper`` (``rdzv-run``: :mod:`rdzv_agent.workers.reaper`), every stop of the group
-- restart, membership change, failure, signal, and the end of :meth:`run` after a
success -- also stops the processes the workers left behind.

Operations hooks (``ops``, :mod:`rdzv_agent.supervision.ops_hooks`): torch's file-timer watchdog and the
stuck-process check (:mod:`rdzv_agent.supervision.stuck`).

Logs: placed by a torch ``LogsSpecs`` (:mod:`rdzv_agent.workers.log_specs`); by default
``LOG_DIR/RUN_ID_xxxx/attempt_N/LOCAL_RANK/{stderr,stdout}.log``, ``N`` =
``TORCHELASTIC_RESTART_COUNT`` as in torch (a membership-change restart keeps the
earlier logs as ``attempt_N.K``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

from rdzv_core.errors import ConfigError

from . import master_address
from .api import DEFAULT_ROLE, MonitorResult, WorkerFailure, WorkerGroup, WorkerSpec, WorkerState
from .launch import worker_options
from .launch.args import RUN_PATH_CODE
from .reporting.torch_events import prof
from .simple import DEFAULT_EXIT_BARRIER_TIMEOUT, AgentEvent, SimpleElasticAgent
from .supervision.hang_watch import DEFAULT_INTERVAL as PROGRESS_INTERVAL
from .supervision.hang_watch import HangWatch
from .supervision.health import Heartbeat
from .supervision.ops_hooks import OpsHooks
from .supervision.stuck import TIMEOUT_ENV as STUCK_ENV
from .supervision.stuck import UninterruptibleCheck
from .supervision.watchdog import WorkerWatchdog
from .workers.log_specs import LineFilter, WorkerStreams, line_prefix, make_logs_specs, worker_streams
from .workers.process import WorkerProcess, parent_death_hook, stop_processes
from .workers.reaper import NodeReaper
from .workers.streams import Std
from .workers.warm import WARM_AFTER, WarmPool, boot_argv, entry_of, entry_path0
from .workers.warm_check import entry_sources, reason_to_start_cold

__all__ = ["LocalElasticAgent", "DEFAULT_STOP_GRACE"]

log = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL when stopping workers (torchrun's ``--shutdown-timeout`` default).
DEFAULT_STOP_GRACE = 30.0


class LocalElasticAgent(SimpleElasticAgent):
    """Runs ``spec.local_world_size`` worker subprocesses on this node.

    Args:
        spec: ``spec.fn`` is the program (str), ``spec.args`` its arguments.
        log_dir: parent directory of this agent's logs; a new temporary directory
            (kept after exit) when ``None``.
        redirects: streams written to the log files only (:class:`Std` or per local rank).
        tee: streams written to the log files and the console.
        env: base environment of the workers (default ``os.environ``); the
            launcher passes one without secrets.
        stop_grace: seconds between SIGTERM and SIGKILL when stopping (>= 0; torchrun's
            ``--shutdown-timeout``, default 30): workers hung in a collective may ignore SIGTERM.
        listener, exit_barrier_timeout, heartbeat: see :class:`SimpleElasticAgent`.
        logs_specs: a torch ``LogsSpecs`` placing the files (then ``log_dir``, ``redirects``,
            ``tee`` and ``local_ranks_filter`` are its own); default
            :class:`~rdzv_agent.workers.log_specs.RdzvLogsSpecs`.
        local_ranks_filter: local ranks whose output reaches the console (``None``: all).
        log_line_prefix_template: console prefix template (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``).
        duplicate_stdout_filters, duplicate_stderr_filters: tee'd lines containing one of these
            are also written to the attempt's ``filtered_stdout.log``/``filtered_stderr.log``.
        virtual_local_rank: torch's ``WorkerSpec.virtual_local_rank`` (``LOCAL_RANK=0``, own device).
        numa_cpus: local rank -> CPUs to bind its worker to (:func:`~rdzv_agent.launch.worker_options.numa_plan`).
        ops: the watchdog and stuck-process settings (default: both off); the launcher
            reads them from torch's variables (:func:`rdzv_agent.supervision.ops_hooks.ops_from_env`).
        hang_timeout: seconds a worker that reported progress may go without before it counts as
            hung (stacks dumped, a failure: :mod:`rdzv_agent.supervision.hang_watch`); ``None``: no check.
        progress_interval: seconds between two writes of the workers' progress to the backend.
        reaper: this process is the subreaper of the workers' processes (:mod:`rdzv_agent.workers.reaper`): every stop
            of the group also stops what the workers left behind; ``None``: only the workers' trees.
        warm_imports: keep warm workers (:mod:`rdzv_agent.workers.warm`: started ahead, ``torch`` and these modules
            imported; start them from a thread that outlives them, as cold workers); ``None``: off.
        warm_checked: warm only if the entry point imports torch at module level and changes nothing the import
            reads before it (:mod:`rdzv_agent.workers.warm_check`: warm workers on by default, not asked for).
        warm_after: seconds the workers run before the next warm generation is started (the first is started
            with the agent).

    Raises:
        ConfigError: ``spec.fn`` is not a program name, ``stop_grace`` is invalid, or ``virtual_local_rank``
            with fewer devices in ``CUDA_VISIBLE_DEVICES`` than workers.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        env: Mapping[str, str] | None = None,
        stop_grace: float = DEFAULT_STOP_GRACE,
        listener: Callable[[AgentEvent], None] | None = None,
        exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT,
        logs_specs: LogsSpecs | None = None,
        local_ranks_filter: set[int] | None = None,
        log_line_prefix_template: str | None = None,
        duplicate_stdout_filters: Sequence[str] = (),
        duplicate_stderr_filters: Sequence[str] = (),
        virtual_local_rank: bool = False,
        numa_cpus: Mapping[int, frozenset[int]] | None = None,
        ops: OpsHooks | None = None,
        heartbeat: Heartbeat | None = None,
        hang_timeout: float | None = None,
        progress_interval: float = PROGRESS_INTERVAL,
        reaper: NodeReaper | None = None,
        warm_imports: Sequence[str] | None = None,
        warm_checked: bool = False,
        warm_after: float = WARM_AFTER,
    ) -> None:
        if not isinstance(spec.fn, str):
            raise ConfigError("fn", spec.fn, "LocalElasticAgent runs programs: give the executable (str)")
        if isinstance(stop_grace, bool) or not isinstance(stop_grace, (int, float)) or not 0 <= stop_grace < math.inf:
            raise ConfigError("stop_grace", stop_grace, "must be a finite number of seconds >= 0")
        if virtual_local_rank:
            worker_options.check_virtual_local_rank(os.environ if env is None else env, spec.local_world_size)
        super().__init__(spec, listener, exit_barrier_timeout, heartbeat)
        ops = ops or OpsHooks()
        self._watchdog = WorkerWatchdog(ops.file_timer, ops.timer_file)
        self._stuck = UninterruptibleCheck(ops.uninterruptible_state_timeout)
        self._base_env = dict(os.environ if env is None else env)
        self._stop_grace = float(stop_grace)
        self._logs_specs = logs_specs if logs_specs is not None else make_logs_specs(
            None, log_dir, redirects, tee, local_ranks_filter)
        self._prefix_template = log_line_prefix_template
        self._dup_filters = (list(duplicate_stdout_filters), list(duplicate_stderr_filters))
        self._line_filters: list[LineFilter] = []
        self._attempt_dir: str | None = None
        self._procs: dict[int, WorkerProcess] = {}
        self._global_ranks: dict[int, int] = {}
        self._exited = threading.Event()
        self._virtual_local_rank = virtual_local_rank
        self._numa_cpus = dict(numa_cpus or {})
        self._hangs = HangWatch(spec.rdzv_handler, hang_timeout, progress_interval)
        self._reaper = reaper
        self._warm = WarmPool(warm_imports, reaper) if warm_imports is not None else None
        self._warm_checked = warm_checked
        self._warm_after = float(warm_after)
        self._warm_due: float | None = None  # time.monotonic() at which the next warm generation is started

    @property
    def log_dir(self) -> str:
        """This agent's log directory: ``LOG_DIR/RUN_ID_xxxx`` once the workers started (torch's
        ``DefaultLogsSpecs``), else the logs spec's ``root_log_dir``."""
        return getattr(self._logs_specs, "_run_log_dir", None) or self._logs_specs.root_log_dir

    def attempt_log_dir(self) -> str | None:
        """Log directory of the latest start of the group, or ``None`` before the first."""
        return self._attempt_dir

    def worker_exit_codes(self) -> dict[int, tuple[int, int | None, bool]]:
        """Latest workers: global rank -> (local rank, exit status or None, stopped by the agent).

        "Stopped by the agent" means the worker died of the signal the agent sent
        it (restart, re-rendezvous, shutdown); a worker that exited with its own
        code or signal is not, even if the agent was stopping it at the time
        (see :attr:`WorkerProcess.stopped_by_agent`).
        """
        return {
            self._global_ranks[lr]: (lr, proc.poll(), proc.stopped_by_agent)
            for lr, proc in sorted(self._procs.items())
        }

    def _slot_env(self, local_rank: int) -> dict[str, str]:
        """The part of a worker's environment fixed per local slot, the same every round (a warm worker's)."""
        spec = self._worker_group.spec
        env = dict(self._base_env)
        env.update(
            ROLE_NAME=spec.role,
            LOCAL_WORLD_SIZE=str(spec.local_world_size),
            TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
            TORCHELASTIC_RUN_ID=spec.rdzv_handler.get_run_id(),
            PYTHONUNBUFFERED="1",
        )
        if self._reaper is not None:
            env.update(self._reaper.env)
        env.update(worker_options.torch_defaults(self._base_env))
        env.update(worker_options.local_rank_env(self._base_env, local_rank, self._virtual_local_rank))
        if spec.local_world_size > 1 and "OMP_NUM_THREADS" not in self._base_env:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def _worker_env(self, group: WorkerGroup, local_rank: int) -> dict[str, str]:
        worker = group.workers[local_rank]
        env = self._slot_env(local_rank)
        env.update(
            RANK=str(worker.global_rank),
            GROUP_RANK=str(group.group_rank),
            ROLE_RANK=str(worker.role_rank),
            WORLD_SIZE=str(worker.world_size),
            GROUP_WORLD_SIZE=str(group.group_world_size),
            ROLE_WORLD_SIZE=str(worker.role_world_size),
            MASTER_ADDR=str(group.master_addr),
            MASTER_PORT=str(group.master_port),
            TORCHELASTIC_RESTART_COUNT=str(self.restart_count),
            TORCHELASTIC_USE_AGENT_STORE=str(bool(group.use_agent_store)),
        )
        return env

    def _spawn_warm(self) -> None:
        """Start the next warm generation: a warm process for every local slot without one (:mod:`.warm`)."""
        if self._warm is None or not self._warm.enabled:
            return
        spec = self._worker_group.spec
        args = [str(a) for a in spec.args]
        boot = boot_argv(str(spec.fn), args, self._warm.imports)
        reason = f"{spec.fn} {' '.join(args[:2])} is not a Python script or module" if boot is None \
            else self._not_exact(args)
        if boot is None or reason is not None:
            log.info("warm workers: off, the workers start cold: %s", reason)
            self._warm.enabled = False
            return
        self._warm.spawn({lr: (worker_options.numa_argv(boot, self._numa_cpus.get(lr)), self._slot_env(lr))
                          for lr in range(spec.local_world_size)}, parent_death_hook())

    def _not_exact(self, args: Sequence[str]) -> str | None:
        """Why a warm start of the entry point would not be exact, or ``None`` (checked once, if warm by default)."""
        if not self._warm_checked:
            return None
        self._warm_checked = False
        entry = entry_of(args)
        if entry is None:
            return None
        kind, name, rest = entry
        if kind == "code" and name == RUN_PATH_CODE and rest:  # --run-path: the script runpy runs
            kind, name = "script", rest[0]
        sources = entry_sources(kind, name, [entry_path0(args) or "", *sys.path[1:]])
        if sources is None:
            return f"the source of {name!r} cannot be read"
        found = reason_to_start_cold(sources)
        return None if found is None else f"{found} (--warm-workers: warm anyway)"

    def _start_worker(self, argv: Sequence[str], env: dict[str, str], streams: WorkerStreams,
                      local_rank: int) -> WorkerProcess:
        """Local rank's worker: its warm process if it has a usable one, else a cold start."""
        warm = self._warm.take(local_rank, self._slot_env(local_rank)) if self._warm is not None else None
        if warm is not None:
            try:
                return WorkerProcess(argv, env, streams, on_exit=self._exited, warm=warm)
            except OSError as exc:
                log.info("local rank %d starts cold: its warm process failed (%s)", local_rank, exc)
                warm.discard()
        return WorkerProcess(argv, env, streams, on_exit=self._exited)

    @prof
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start one subprocess per local rank; return local rank -> pid.

        Raises:
            OSError: a worker could not be started (the others are stopped).
        """
        spec = worker_group.spec
        self._exited.clear()
        self._procs = {}
        self._global_ranks = {w.local_rank: int(w.global_rank or 0) for w in worker_group.workers}
        argv = [str(spec.fn), *map(str, spec.args)]
        envs = {w.local_rank: self._worker_env(worker_group, w.local_rank) for w in worker_group.workers}
        network = master_address.worker_network_env(self._base_env, spec.local_addr, spec.rdzv_handler)
        for env in envs.values():
            env.update(network)
        self._watchdog.start(spec.rdzv_handler.get_run_id(), envs.values())
        dest = self._logs_specs.reify(envs)
        self._attempt_dir = os.path.dirname(dest.filtered_stdout) or None
        self._hangs.prepare(envs, {lr: os.path.dirname(path) if path and path != os.devnull else None
                                   for lr, path in dest.error_files.items()})
        filters = self._open_line_filters(dest)
        try:
            for worker in worker_group.workers:
                lr = worker.local_rank
                prefix = line_prefix(self._prefix_template, spec.role, self._global_ranks[lr], lr)
                self._procs[lr] = self._start_worker(worker_options.numa_argv(argv, self._numa_cpus.get(lr)),
                                                     envs[lr], worker_streams(dest, lr, prefix, filters), lr)
        except OSError:
            self._stop_workers(worker_group)
            raise
        self._hangs.started({lr: (self._global_ranks[lr], proc.pid) for lr, proc in self._procs.items()}, envs)
        self._warm_due = time.monotonic() + self._warm_after  # the next generation, once the workers ran a while
        if self._warm_after <= 0:
            self._spawn_due_warm()
        return {lr: proc.pid for lr, proc in self._procs.items()}

    def _spawn_due_warm(self) -> None:
        """Start the next warm generation if the workers have run :data:`warm_after` seconds."""
        if self._warm_due is not None and time.monotonic() >= self._warm_due:
            self._warm_due = None
            self._spawn_warm()

    def _open_line_filters(self, dest: LogsDest) -> tuple[LineFilter | None, LineFilter | None]:
        """This start's duplicate filter files (the previous start's are closed)."""
        for old in self._line_filters:
            old.close()
        made = tuple(LineFilter(path, needles) if needles else None
                     for path, needles in zip((dest.filtered_stdout, dest.filtered_stderr), self._dup_filters,
                                              strict=True))
        self._line_filters = [f for f in made if f is not None]
        return made[0], made[1]

    @prof
    def _stop_workers(self, worker_group: WorkerGroup, sig: int = signal.SIGTERM) -> None:
        """Stop every worker and its process tree (``sig``, then SIGKILL after the grace period).

        The watchdog stops first, as torch's ``LocalElasticAgent._shutdown``.
        """
        self._watchdog.stop()
        self._hangs.stopping()
        stop_processes(list(self._procs.values()), sig, self._stop_grace, self._reaper)

    def _shutdown(self, death_sig: int = signal.SIGTERM) -> None:
        self._stop_workers(self._worker_group, death_sig)
        for line_filter in self._line_filters:
            line_filter.close()

    def run(self, role: str = DEFAULT_ROLE) -> dict[int, Any]:
        try:
            self._spawn_warm()  # they import while the rendezvous runs
            results = super().run(role)  # stops the workers when it raises
            if self._reaper is not None:  # succeeded: what the workers left behind ends with the node too
                stop_processes(list(self._procs.values()), signal.SIGTERM, self._stop_grace, self._reaper)
            return results
        finally:  # the workers are done: remove the watchdog's pipe and the progress files
            if self._warm is not None:
                self._warm.close()
            self._watchdog.stop()
            self._hangs.close()

    def _wait(self, seconds: float) -> None:
        self._exited.wait(seconds)
        self._exited.clear()

    @prof
    def _monitor_workers(self, worker_group: WorkerGroup) -> MonitorResult:
        """FAILED if any worker exited non-zero, SUCCEEDED if all exited 0, else HEALTHY."""
        if self._reaper is not None:  # adopted processes that exited on their own: no zombies
            self._reaper.reap([proc.pid for proc in self._procs.values()])
        codes = {lr: proc.poll() for lr, proc in self._procs.items()}
        failed = {lr: code for lr, code in codes.items() if code not in (None, 0)}
        if failed:
            failures: dict[int, Exception] = {}
            for lr in sorted(failed, key=lambda r: self._procs[r].exited_at):
                proc = self._procs[lr]
                error = proc.error()
                if proc.pid in self._watchdog.reaped:
                    error = f"killed by the watchdog: timer {self._watchdog.reaped[proc.pid]!r} expired\n{error}"
                failures[self._global_ranks[lr]] = WorkerFailure(
                    global_rank=self._global_ranks[lr],
                    local_rank=lr,
                    exit_code=failed[lr],
                    error=error,
                    log_path=proc.stderr_path,
                    pid=proc.pid,
                    master_port_in_use=self._global_ranks[lr] == 0 and master_address.is_port_in_use_error(error),
                    error_file=proc.error_file,
                    timestamp=proc.exited_wall_time,
                )
            return MonitorResult(WorkerState.FAILED, exceptions=failures)
        if codes and all(code == 0 for code in codes.values()):
            return MonitorResult(WorkerState.SUCCEEDED, ret_vals={self._global_ranks[lr]: 0 for lr in codes})
        stuck = self._check_stuck()
        result = stuck if stuck.state != WorkerState.HEALTHY else self._check_hung()
        if result.state == WorkerState.HEALTHY:
            self._spawn_due_warm()
        return result

    def _check_hung(self) -> MonitorResult:
        """FAILED, restartable, if a worker made no progress for ``hang_timeout`` s (:mod:`.hang`: stacks dumped)."""
        running = {lr: proc for lr, proc in self._procs.items() if proc.poll() is None}
        hung = self._hangs.check(set(running))
        if not hung:
            return MonitorResult(WorkerState.HEALTHY)
        workers = {lr: (self._global_ranks[lr], proc.pid, proc.stderr_path) for lr, proc in running.items()}
        return MonitorResult(WorkerState.FAILED, exceptions=self._hangs.failures(hung, workers,
                                                                                 self._worker_group.spec.role))

    @property
    def progress(self) -> dict[int, tuple[int, int, float]]:
        """The workers' reported progress: global rank -> ``(local rank, step, Unix seconds)`` (:mod:`.hang`)."""
        return self._hangs.monitor.snapshot()

    def _check_stuck(self) -> MonitorResult:
        """UNHEALTHY, not restartable, if a running worker stayed in ``D`` state too long (:mod:`.stuck`)."""
        running = {lr: proc.pid for lr, proc in self._procs.items() if proc.poll() is None}
        stuck = self._stuck.check(running)
        if not stuck:
            return MonitorResult(WorkerState.HEALTHY)
        failures: dict[int, Exception] = {}
        for lr, seconds in stuck.items():
            rank, proc = self._global_ranks[lr], self._procs[lr]
            failures[rank] = WorkerFailure(
                global_rank=rank, local_rank=lr, exit_code=None, log_path=proc.stderr_path, pid=proc.pid,
                error=f"in uninterruptible sleep (D state) for {seconds:.1f} s >= "
                      f"{STUCK_ENV}={self._stuck.timeout:g} s; restarts disabled",
            )
            log.error("[%s] worker pid %d %s", self._worker_group.spec.role, proc.pid, failures[rank])
        return MonitorResult(WorkerState.UNHEALTHY, exceptions=failures, restart=False)
