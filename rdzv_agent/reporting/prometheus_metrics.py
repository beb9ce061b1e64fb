"""``rdzv-run --metrics-port``: the agent's Prometheus metrics, served with ``prometheus_client``.

One registry per launcher (not ``prometheus_client``'s global one), served over HTTP on all
interfaces by ``prometheus_client.start_http_server`` (any path answers ``/metrics``). The values
come from the agent's events (:class:`~rdzv_agent.simple.AgentEvent`: rounds, restarts), the
process-wide observers of :mod:`rdzv_core.observe` (backend requests, keep-alive refreshes) and, at
each scrape, the workers' progress (:attr:`LocalElasticAgent.progress`). Names and labels:
``docs/telemetry.md`` ("Prometheus metrics").
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rdzv_core import observe

from ..simple import AgentEvent

__all__ = ["AgentMetrics", "RESTART_CAUSES"]

#: ``AgentEvent`` ``restarting`` reason -> the ``cause`` label of ``rdzv_restarts_total``.
RESTART_CAUSES = {"failed": "failure", "hang": "hang", "membership": "membership", "port_in_use": "setup",
                  "no_master": "setup"}
#: Histogram buckets (seconds) of backend requests and keep-alive refreshes.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Histogram buckets (seconds) of a rendezvous.
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class _Progress(Collector):
    """The workers' last step and its time, read at each scrape."""

    def __init__(self, progress: Callable[[], Mapping[int, tuple[int, int, float]]]) -> None:
        self._progress = progress

    def collect(self) -> Iterator[GaugeMetricFamily]:
        step = GaugeMetricFamily("rdzv_worker_last_step", "The last step a worker reported",
                                 labels=["global_rank", "local_rank"])
        when = GaugeMetricFamily("rdzv_worker_last_progress_timestamp_seconds",
                                 "When a worker last reported progress (Unix seconds)",
                                 labels=["global_rank", "local_rank"])
        for rank, (local_rank, last_step, wall) in sorted(self._progress().items()):
            step.add_metric([str(rank), str(local_rank)], last_step)
            when.add_metric([str(rank), str(local_rank)], wall)
        yield step
        yield when


class AgentMetrics:
    """The metrics of one agent, and their HTTP server.

    :meth:`serve` starts it before the rendezvous handler is made (so that the handler's backend
    requests are timed), :meth:`attach` adds the agent once it exists.
    """

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.info = Gauge("rdzv_agent_info", "This agent: run id, backend, host", ["run_id", "backend", "host"],
                          registry=reg)
        self.rounds = Counter("rdzv_rounds", "Rendezvous rounds this agent completed", registry=reg)
        self.rendezvous = Histogram("rdzv_rendezvous_duration_seconds", "Seconds each rendezvous took (per round)",
                                    buckets=ROUND_BUCKETS, registry=reg)
        self.restarts = Counter("rdzv_restarts", "Restarts of the worker group, by cause", ["cause"], registry=reg)
        for cause in sorted(set(RESTART_CAUSES.values())):
            self.restarts.labels(cause)
        self.group_world_size = Gauge("rdzv_group_world_size", "Nodes in the current round", registry=reg)
        self.world_size = Gauge("rdzv_world_size", "Workers in the current round", registry=reg)
        self.group_rank = Gauge("rdzv_group_rank", "This node's rank in the current round", registry=reg)
        self.keepalive = Histogram("rdzv_keepalive_refresh_seconds", "Seconds each keep-alive refresh took",
                                   buckets=LATENCY_BUCKETS, registry=reg)
        self.keepalive_errors = Counter("rdzv_keepalive_refresh_errors", "Keep-alive refreshes that failed",
                                        registry=reg)
        self.keepalive_lapses = Counter("rdzv_keepalive_lapses", "Keep-alive keys found gone at their refresh",
                                        registry=reg)
        self.requests = Histogram("rdzv_backend_request_seconds", "Seconds each backend request took, by operation",
                                  ["op"], buckets=LATENCY_BUCKETS, registry=reg)
        self.request_errors = Counter("rdzv_backend_request_errors", "Backend requests that raised, by operation "
                                      "and error", ["op", "error"], registry=reg)
        self.attributed = Counter("rdzv_failures_attributed", "This node's worker failures, by the node the "
                                  "ledger charged: this node, another node, or nobody (a lost peer)", ["to"],
                                  registry=reg)
        for to in ("self", "other", "nobody"):
            self.attributed.labels(to)
        self.quarantined_until = Gauge("rdzv_node_quarantined_until_timestamp_seconds", "Until when the ledger "
                                       "quarantines this node (Unix seconds; 0: not quarantined)", registry=reg)
        self._progress: Callable[[], Mapping[int, tuple[int, int, float]]] = dict
        reg.register(_Progress(lambda: self._progress()))
        self._rendezvous_started: float | None = None
        self._lock = threading.Lock()
        self._server: Any = None

    def attach(self, run_id: str, backend: str, progress: Callable[[], Mapping[int, tuple[int, int, float]]]) -> None:
        """The agent: ``rdzv_agent_info``'s labels, and its workers' progress (global rank -> ``(local rank,
        step, Unix seconds)``)."""
        self.info.labels(run_id, backend, socket.gethostname()).set(1)
        self._progress = progress

    # -- the agent's events -------------------------------------------------------------------------
    def on_event(self, event: AgentEvent) -> None:
        """Count rounds and restarts from the agent's events."""
        if event.kind == "rendezvous":
            self._rendezvous_started = time.monotonic()
        elif event.kind == "rendezvous_done":
            self.rounds.inc()
            if self._rendezvous_started is not None:
                self.rendezvous.observe(time.monotonic() - self._rendezvous_started)
                self._rendezvous_started = None
            self.group_world_size.set(event.data.get("group_world_size") or 0)
            self.world_size.set(event.data.get("world_size") or 0)
            self.group_rank.set(event.data.get("group_rank") or 0)
        elif event.kind == "restarting":
            self.restarts.labels(RESTART_CAUSES.get(str(event.data.get("reason")), "failure")).inc()
        elif event.kind == "attributed":  # the node ledger's verdict on a failure (docs/node-health.md)
            first, culprit = bool(event.data.get("first")), event.data.get("culprit")
            self.attributed.labels("self" if first else "other" if culprit else "nobody").inc()
            until = event.data.get("until")
            self.quarantined_until.set(float(until) if event.data.get("quarantined") and until else 0.0)

    # -- rdzv_core.observe -------------------------------------------------------------------------
    def backend_request(self, op: str, seconds: float, error: BaseException | None) -> None:
        self.requests.labels(op).observe(seconds)
        if error is not None:
            self.request_errors.labels(op, type(error).__name__).inc()

    def keepalive_refresh(self, seconds: float, error: BaseException | None) -> None:
        self.keepalive.observe(seconds)
        if error is not None:
            self.keepalive_errors.inc()

    def keepalive_lapse(self) -> None:
        self.keepalive_lapses.inc()

    # -- serving -------------------------------------------------------------------------------------
    def serve(self, port: int) -> None:
        """Serve on ``port`` (all interfaces) and observe the backend.

        Raises:
            OSError: the port cannot be bound.
        """
        self._server, _ = start_http_server(port, registry=self.registry)
        observe.add(self)

    def stop(self) -> None:
        """Stop serving and observing (idempotent)."""
        observe.remove(self)
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
