"""torch elastic's events and metrics for the agent: torch's shapes and names, at torch's points.

Events are torch ``Event``\\ s recorded with torch's ``events.record(event, spec.event_log_handler)``;
metrics go through torch's ``metrics.put_metric`` / ``@prof`` into the group
:data:`METRIC_GROUP`, so a handler set with ``metrics.configure(handler, "torchelastic")``
sees what it sees under torchrun. The source of each is torch's
``torch.distributed.elastic.agent.server.api.SimpleElasticAgent`` (``_construct_event``,
``record_duration``, ``_record_worker_events``, ``_record_metrics``,
``_record_flakiness_metric``, the ``put_metric`` calls of ``_invoke_run``) and
``torch.distributed.launcher.api.launch_agent`` (the agent's SUCCEEDED/FAILED event).
See docs/telemetry.md for the list.
"""

from __future__ import annotations

import importlib
import json
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, TypeVar, cast

from torch.distributed.elastic import events
from torch.distributed.elastic.events.api import Event, EventMetadataValue, EventSource
from torch.distributed.elastic.metrics import api as metrics
from torch.distributed.elastic.agent.server.api import _get_fq_hostname

from ..api import Worker, WorkerFailure, WorkerGroup, WorkerState
from .error_files import process_failure

__all__ = ["METRIC_GROUP", "AgentTelemetry", "prof", "profiled"]

#: The metric group torch's agent puts its metrics in (``put_metric``'s default).
METRIC_GROUP = "torchelastic"

F = TypeVar("F", bound=Callable[..., Any])


def prof(fn: F) -> F:
    """torch's ``metrics.prof``: ``QUALNAME.success``/``.failure``/``.duration.ms`` in :data:`METRIC_GROUP`."""
    return cast(F, metrics.prof(fn))


@contextmanager
def profiled(name: str, returns: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """torch's ``@prof`` metrics for a block named ``name``.

    ``returns``: exceptions that torch's twin of the block returns instead of raising
    (e.g. torch's ``run()`` returns a failed result where ours raises), counted as success.
    """
    start = time.time()
    try:
        yield
        metrics.put_metric(f"{name}.success", 1, METRIC_GROUP)
    except returns:
        metrics.put_metric(f"{name}.success", 1, METRIC_GROUP)
        raise
    except Exception:
        metrics.put_metric(f"{name}.failure", 1, METRIC_GROUP)
        raise
    finally:
        metrics.put_metric(f"{name}.duration.ms", metrics.get_elapsed_time_ms(start), METRIC_GROUP)


def _entry_point(fn: Any) -> str:
    """torch's ``WorkerSpec.get_entrypoint_name``: the program's base name, or the function's name."""
    return fn.rsplit("/", 1)[-1] if isinstance(fn, str) else str(getattr(fn, "__name__", fn))


class AgentTelemetry:
    """Records one agent's events and metrics.

    Args:
        group: the agent's live worker group.
        restarts_used: returns the restarts spent on failures so far.
    """

    def __init__(self, group: WorkerGroup, restarts_used: Callable[[], int]) -> None:
        self._group = group
        self._restarts_used = restarts_used
        #: whole seconds the agent's ``run()`` took (torch's ``_total_execution_time``; 0 until it ends).
        self.total_run_time = 0
        self._hostname: str | None = None  # torch looks it up (DNS) for every event; once is enough

    def event(self, state: str, source: EventSource, worker: Worker | None = None,
              raw_error: str | None = None, duration_ms: float | None = None, exit_code: int | None = None,
              worker_pid: int | None = None) -> Event:
        """torch's ``SimpleElasticAgent._construct_event``: ``torchelastic.worker.status.STATE``."""
        group, spec = self._group, self._group.spec
        md: dict[str, Any] = {"group_world_size": group.group_world_size, "entry_point": _entry_point(spec.fn)}
        if worker is not None:  # torch's one-element tuples (JSON lists), kept for consumers of torch's events
            md.update(local_rank=(worker.local_rank,), role_rank=(worker.role_rank,),
                      role_world_size=(worker.role_world_size,), exit_code=(exit_code,), worker_pid=(worker_pid,))
        metadata: dict[str, EventMetadataValue] = {
            "run_id": spec.rdzv_handler.get_run_id(),
            "global_rank": worker.global_rank if worker is not None else None,
            "group_rank": group.group_rank,
            "worker_id": str(worker.id) if worker is not None else None,
            "role": spec.role,
            "hostname": self._hostname or self._set_hostname(),
            "state": state,
            "total_run_time": self.total_run_time,
            "rdzv_backend": spec.rdzv_handler.get_backend(),
            "raw_error": raw_error,
            "metadata": json.dumps(md),
            "agent_restarts": self._restarts_used(),
            "duration_ms": duration_ms,
        }
        return Event(f"torchelastic.worker.status.{state}", source=source, metadata=metadata)

    def _set_hostname(self) -> str:
        self._hostname = _get_fq_hostname()
        return self._hostname

    def record(self, event: Event) -> None:
        """torch's ``events.record`` to the spec's ``event_log_handler``."""
        events.record(event, self._group.spec.event_log_handler)

    @contextmanager
    def duration(self, state: str) -> Iterator[None]:
        """torch's ``record_duration``: an AGENT event ``STATE`` with ``duration_ms`` when the block ends."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(self.event(state, EventSource.AGENT, duration_ms=(time.perf_counter() - start) * 1000))

    def workers_started(self) -> None:
        """A WORKER ``START`` event per worker (torch's ``_initialize_workers``)."""
        for worker in self._group.workers:
            self.record(self.event("START", EventSource.WORKER, worker))

    def monitored(self, state: WorkerState, remaining_restarts: int) -> None:
        """The metrics of each monitor pass (torch's ``_invoke_run``)."""
        role = self._group.spec.role
        metrics.put_metric(f"workers.{role}.remaining_restarts", remaining_restarts, METRIC_GROUP)
        metrics.put_metric(f"workers.{role}.{state.name.lower()}", 1, METRIC_GROUP)

    def run_ended(self, started: float, failures: Mapping[int, Exception]) -> None:
        """At the end of ``run()`` (torch's ``_record_metrics`` then ``_record_worker_events``).

        Args:
            started: ``time.monotonic()`` when ``run()`` started (sets :attr:`total_run_time`).
            failures: global rank -> failure of the workers that failed (empty: they succeeded).
        """
        self.total_run_time = int(time.monotonic() - started)
        spec = self._group.spec
        role, used, failed = spec.role, self._restarts_used(), bool(failures)
        remaining = spec.max_restarts - used
        flakiness = 100.0 if failed else 100.0 - 100.0 * (remaining + 1) / (spec.max_restarts + 1)
        metrics.put_metric(f"workers.{role}.flakiness", int(flakiness), METRIC_GROUP)
        metrics.put_metric(f"workers.{role}.run_total", 1, METRIC_GROUP)
        for name, on in (("run_success_with_retries", not failed and used > 0),
                         ("run_success_no_retries", not failed and used == 0),
                         ("run_failed_with_retries", failed and used > 0),
                         ("run_failed_no_retries", failed and used == 0)):
            metrics.put_metric(f"workers.{role}.{name}", int(on), METRIC_GROUP)
        for worker in self._group.workers:
            failure = failures.get(int(worker.global_rank or 0)) if worker.global_rank is not None else None
            if isinstance(failure, WorkerFailure):
                raw = json.dumps(process_failure(failure).error_file_data)
                self.record(self.event("FAILED", EventSource.WORKER, worker, raw_error=raw,
                                       exit_code=failure.exit_code, worker_pid=failure.pid))
            else:  # torch: a worker the agent stopped because another failed is TERMINATED
                self.record(self.event("TERMINATED" if failed else "SUCCEEDED", EventSource.WORKER, worker))

    def agent_ended(self, error: BaseException | None) -> None:
        """The launcher's AGENT event: ``SUCCEEDED`` when ``run()`` ended (even with failed workers, as torch's
        ``launch_agent`` records it), else ``FAILED`` with the traceback in ``raw_error``."""
        if error is None:
            self.record(self.event("SUCCEEDED", EventSource.AGENT))
        else:
            raw = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self.record(self.event("FAILED", EventSource.AGENT, raw_error=raw))


def metric_handler(spec: str) -> metrics.MetricHandler:
    """The handler ``--metrics-handler SPEC`` names: ``console``, ``null`` or ``MODULE:ATTR``.

    ``MODULE:ATTR`` is a torch ``MetricHandler`` instance, or a class or function that returns one when
    called without arguments.

    Raises:
        ValueError: ``spec`` names no importable handler (the reason).
    """
    if spec in ("console", "null"):
        return metrics.ConsoleMetricHandler() if spec == "console" else metrics.NullMetricHandler()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected console, null or MODULE:ATTR, got {spec!r}")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {type(exc).__name__}: {exc}") from None
    handler = found() if callable(found) and not isinstance(found, metrics.MetricHandler) else found
    if not isinstance(handler, metrics.MetricHandler):
        raise ValueError(f"{spec!r} is not a torch.distributed.elastic.metrics.MetricHandler (got {handler!r})")
    return handler
