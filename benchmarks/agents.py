"""The worker process: agent threads of one target, driven by the parent over a pipe.

One worker process holds ``n_threads`` agents of one *target*:

* an rdzv backend (``memory``, ``file``, ``etcd-v2``, ``etcd-v3``, ``redis``):
  each agent is an :class:`rdzv_core.torch_api.handler.RdzvHandler` whose backend is its own
  :class:`~benchmarks.counting.CountingKV` proxy over ONE client shared by the
  process (one connection pool per process, as threads of one agent process
  would share it); the *victim* of the re-rendezvous scenario has a client of its
  own, so closing it (a crash: its keep-alive stops, its key is not deleted)
  touches nobody else. With ``client_mode="per-agent"`` every agent opens a
  client of its own (used for Redis: a shared redis-py client allows only 100
  connections, see ``docs/benchmarks.md``);
* a PyTorch handler (``torch:c10d``, ``torch:etcd-v2``, ``torch:etcd``): each
  agent is the handler ``get_rendezvous_handler(RendezvousParameters(...))``
  returns, with the client it makes for itself.

Every agent calls ``next_rendezvous()`` — the same call on both sides, which
returns the rank, world size and the MASTER_ADDR/PORT published by rank 0.
For rdzv agents the time ``next_round`` returned (rank known) is recorded too,
through a timing shim on the handler's :class:`~rdzv_core.rendezvous.Rendezvous`.

Commands (tuples received on the pipe; each is answered with one message):

``("setup", spec)``
    build agents (``spec``: run_id, n_threads, min/max nodes, timeouts, victim) -> ``("ready", info)``
``("go", event_index, who, wait_limit)``
    start one blocked thread per selected agent (``who``: ``"all"`` or
    ``"survivors"``) -> ``("armed", None)``; then wait for ``events[event_index]``
    (the start barrier, set by the parent), release the threads, join them
    -> ``("done", {"agents": [per-agent results], "log": warnings tally})``
``("kill",)``
    close the victim's client -> ``("killed", t)``
``("steady", seconds, monitor, check_interval)``
    (rdzv) hold the round the last ``go`` formed for ``seconds`` with every
    agent's keep-alive running, then report what happened to it ->
    ``("held", report)``; see :meth:`_Worker.steady`. The worker with
    ``monitor`` true also watches the round's keys (:class:`_Monitor`).
``("cleanup",)``
    leave the round / stop heartbeats of every agent -> ``("clean", None)``
``("exit",)``
    -> ``("bye", None)``, then return.

The Store-throughput commands ``tp_open``/``tp_run``/``tp_close`` are
described in :func:`benchmarks.throughput.measure_store`; the same processes
serve both, so each target starts its workers once.

Times are ``time.monotonic()`` values, which on Linux are comparable between
processes of one machine (``CLOCK_MONOTONIC``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
import traceback
from typing import Any

from .counting import CountingKV

__all__ = ["worker_main"]

#: Threads that build a worker's agents (handlers, clients) before a round.
SETUP_THREADS = 128

log = logging.getLogger(__name__)


class _Agent:
    """One agent: a handler, its counting proxy (rdzv only) and its last result."""

    def __init__(self, handler: Any, proxy: Any, victim: bool) -> None:
        self.handler = handler
        self.proxy = proxy
        self.victim = victim
        self.result: dict[str, Any] = {}


class _Worker:
    def __init__(self, target: dict[str, Any], events: list[Any]) -> None:
        self.target = target
        self.events = events
        self.kind = target["kind"]
        self.shared: Any = None
        self.agents: list[_Agent] = []
        self._chosen: list[_Agent] = []
        self._release = threading.Event()
        self._threads: list[threading.Thread] = []
        if self.kind == "rdzv":
            from rdzv_core import open_backend

            if target.get("client_mode", "shared") == "shared":
                self.shared = open_backend(target["url"])
            import rdzv_core.torch_api.handler  # noqa: F401  (import torch now, not inside the timed section)
        elif self.kind == "torch":
            import torch.distributed.elastic.rendezvous.registry  # noqa: F401
        else:  # "tcpstore": Store throughput only
            import torch.distributed  # noqa: F401

    # -- setup -------------------------------------------------------------------
    def setup(self, spec: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()

        def make(i: int) -> _Agent:
            victim = bool(spec.get("victim")) and i == 0
            return self._make_rdzv(spec, victim) if self.kind == "rdzv" else self._make_torch(spec)

        # Built concurrently: a PyTorch c10d handler's TCPStore client now and then takes 5 s
        # to connect (seen here on loopback, about one connection in 25), which would make
        # building 512 agents one after the other take minutes. Not part of any timing.
        with concurrent.futures.ThreadPoolExecutor(SETUP_THREADS) as ex:
            self.agents = list(ex.map(make, range(spec["n_threads"])))
        return {"setup_s": time.monotonic() - started}

    def _make_rdzv(self, spec: dict[str, Any], victim: bool) -> _Agent:
        from rdzv_core import open_backend
        from rdzv_core.torch_api.handler import RdzvHandler
        from rdzv_core.rendezvous import RendezvousParams

        own = victim or self.shared is None
        inner = open_backend(self.target["url"]) if own else self.shared
        proxy = _RefreshClock(inner, owns_inner=own)
        params = RendezvousParams(
            min_nodes=spec["min_nodes"], max_nodes=spec["max_nodes"], timeout=spec["timeout"],
            last_call_timeout=spec["last_call_timeout"], keep_alive_ttl=spec["keep_alive_ttl"], prefix="bench",
        )
        handler = RdzvHandler(proxy, spec["run_id"], params, backend_name=self.target["name"],
                              local_addr="127.0.0.1", store_timeout=spec["timeout"])
        return _Agent(handler, proxy, victim)

    def _make_torch(self, spec: dict[str, Any]) -> _Agent:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        backend = self.target["torch_backend"]
        timeout = int(spec["timeout"])
        config: dict[str, Any] = {"read_timeout": timeout}
        if backend == "etcd":  # the legacy handler's own keys
            config.update(timeout=timeout, last_call_timeout=max(1, int(spec["last_call_timeout"])))
        else:  # dynamic_rendezvous
            config.update(join_timeout=timeout, last_call_timeout=spec["last_call_timeout"])
            if backend == "c10d":
                config["is_host"] = False  # the parent hosts the TCPStore
        params = RendezvousParameters(
            backend=backend, endpoint=self.target["endpoint"], run_id=spec["run_id"],
            min_nodes=spec["min_nodes"], max_nodes=spec["max_nodes"], local_addr="127.0.0.1", **config,
        )
        return _Agent(get_rendezvous_handler(params), None, False)

    # -- one round -------------------------------------------------------------------
    def arm(self, who: str) -> None:
        """Start one blocked thread per selected agent (``"all"`` or ``"survivors"``)."""
        self._chosen = [a for a in self.agents if who == "all" or not a.victim]
        self._release = threading.Event()
        self._threads = []
        for agent in self._chosen:
            agent.result = {}
            if agent.proxy is not None:
                agent.proxy.counts.clear()
                agent.proxy.phase = "round"
            t = threading.Thread(target=self._run_agent, args=(agent, self._release), daemon=True)
            t.start()
            self._threads.append(t)

    def go(self, event_index: int, wait_limit: float) -> list[dict[str, Any]]:
        """Wait for the start barrier, release the armed threads, join them; their results."""
        event = self.events[event_index]
        if not event.wait(wait_limit):
            raise TimeoutError(f"start event {event_index} was not set within {wait_limit} s")
        cpu = os.times()
        self._release.set()
        deadline = time.monotonic() + wait_limit  # then report whoever finished (a timeout)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        after = os.times()
        results = []
        for agent in self._chosen:
            res = dict(agent.result) or {"unfinished": True, "error": "did not finish within the time limit"}
            if agent.proxy is not None:
                res["counts"] = agent.proxy.snapshot()
            res["victim"] = agent.victim
            results.append(res)
        if results:  # this process's CPU seconds (every thread, user + system) from the release to the last done
            results[0]["worker_cpu_s"] = round(after.user - cpu.user + after.system - cpu.system, 3)
        return results

    def _run_agent(self, agent: _Agent, release: threading.Event) -> None:
        release.wait()
        res: dict[str, Any] = {"t_start": time.monotonic()}
        if self.kind == "rdzv":
            _time_next_round(agent, res)
        try:
            info = agent.handler.next_rendezvous()
            res["t_done"] = time.monotonic()
            res["rank"], res["world"] = int(info.rank), int(info.world_size)
            res.setdefault("t_rank", res["t_done"])
        except BaseException as exc:  # recorded and reported; the parent decides
            res["error"] = f"{type(exc).__name__}: {exc}"[:500]
            frames = traceback.extract_tb(exc.__traceback__)[-3:]
            res["where"] = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
            res["t_done"] = time.monotonic()
        agent.result = res

    # -- steady state --------------------------------------------------------------------
    def steady(self, seconds: float, monitor: bool, check_interval: float) -> dict[str, Any]:
        """Hold the current round ``seconds`` seconds with the keep-alives running; what happened to it.

        Every agent's :class:`_RefreshClock` records when each refresh of its keep-alive
        key returned; the largest gap between two of them (or between the start or
        end of the hold and the nearest refresh) is the key's refresh lateness. At the
        end every agent reports whether its ``KeepAlive.lapsed`` is set, how often the
        key was written again, whether it is still refreshed and its own
        ``num_nodes_waiting()``. With ``monitor``, a :class:`_Monitor` also watches
        the round's keys (from this process's client) during the hold.
        """
        if self.kind != "rdzv":
            raise ValueError(f"the steady scenario needs an rdzv target, not {self.kind!r}")
        members = [a for a in self.agents if a.handler.rendezvous.current is not None]
        if len(members) != len(self.agents):
            raise RuntimeError(f"{len(self.agents) - len(members)} agents hold no round")
        for agent in members:
            agent.proxy.counts.clear()
            agent.proxy.start_clock()
        mon = _Monitor(self._monitor_kv(), members[0].handler.rendezvous, check_interval) if monitor else None
        started = time.monotonic()
        if mon is not None:
            mon.start()
        threading.Event().wait(seconds)  # the hold's length is the scenario's input
        ended = time.monotonic()
        threads = threading.active_count()  # keep-alive threads included (the agent threads have ended)
        report: dict[str, Any] = {"monitor": mon.stop() if mon is not None else None,
                                  "threads": threads, "agents": len(members)}
        gaps: list[float] = []
        lapsed = recreated = stopped = waiting = errors = refreshes = 0
        for agent in members:
            rdzv = agent.handler.rendezvous
            ka = rdzv._keepalive
            if ka is None or not ka.is_alive():
                stopped += 1
            if ka is not None:
                lapsed += ka.lapsed.is_set()
                recreated += ka.recreated
            try:
                waiting += rdzv.num_nodes_waiting() != 0
            except Exception:  # reported, not fatal: the count says how many could not tell
                errors += 1
            times = agent.proxy.stop_clock()
            refreshes += len(times)
            marks = [started, *times, ended]
            gaps.append(max(b - a for a, b in zip(marks, marks[1:], strict=False)))
        counts = [a.proxy.snapshot().get("keepalive", {}) for a in members]
        report.update(
            lapsed_events=lapsed, recreated=recreated, keepalives_not_running=stopped,
            agents_told_to_rejoin=waiting, num_nodes_waiting_errors=errors,
            refreshes=refreshes, refresh_gap_max_s=round(max(gaps, default=0.0), 3),
            refresh_gaps_s=[round(g, 3) for g in sorted(gaps)[-5:]],
            keepalive_ops={op: sum(c.get(op, 0) for c in counts) for op in sorted({k for c in counts for k in c})},
            held_s=round(ended - started, 3),
        )
        return report

    def _monitor_kv(self) -> Any:
        from rdzv_core import open_backend

        return self.shared if self.shared is not None else open_backend(self.target["url"])

    # -- teardown ------------------------------------------------------------------------
    def kill(self) -> float:
        for agent in self.agents:
            if agent.victim:
                agent.proxy.close()  # its KeepAlive ends on BackendClosedError; its key stays until the TTL
        return time.monotonic()

    def cleanup(self) -> None:
        for agent in self.agents:
            try:
                if self.kind == "rdzv":
                    agent.handler.rendezvous.leave()
                    agent.proxy.close()  # closes the client only if the agent owns it
                else:
                    _stop_torch_handler(agent.handler)
            except Exception as exc:  # cleanup is best effort; the next round uses a new run id
                log.warning("cleanup of an agent failed: %s", exc)
        self.agents = []


class _RefreshClock(CountingKV):
    """A :class:`~benchmarks.counting.CountingKV` that also records when each successful
    ``refresh`` returned (``time.monotonic()`` seconds), between :meth:`start_clock` and
    :meth:`stop_clock` (the steady scenario's refresh lateness)."""

    def __init__(self, inner: Any, owns_inner: bool = False) -> None:
        super().__init__(inner, owns_inner=owns_inner)
        self._times: list[float] | None = None

    def start_clock(self) -> None:
        self._times = []

    def stop_clock(self) -> list[float]:
        """The refresh times recorded since :meth:`start_clock` (and stop recording)."""
        times, self._times = self._times or [], None
        return times

    def _do_refresh(self, key: str, ttl: float) -> None:
        super()._do_refresh(key, ttl)
        times = self._times
        if times is not None:
            times.append(time.monotonic())


class _Monitor:
    """Watches one round's keys during the steady hold, from a client of the worker's own.

    A watch thread counts ``DELETE`` events of the round's ``alive/`` keys (a lapsed
    or deleted keep-alive key; after ``HistoryCompactedError`` it lists the keys again and
    counts missing ones instead). Every ``check_interval`` seconds a check thread
    lists ``alive/`` (the fewest keys seen), reads the round record (how many reads
    differed from the record at the start) and calls ``num_nodes_waiting()`` of one
    agent (the largest value seen).
    """

    def __init__(self, kv: Any, rdzv: Any, check_interval: float) -> None:
        self.kv, self.rdzv, self.check_interval = kv, rdzv, check_interval
        version = rdzv.current.version
        self.alive_prefix = rdzv.keys.alive_dir(version, rdzv.current.round_id or None)
        self.state_key = rdzv.keys.round_record
        entries, self.revision = kv.list(self.alive_prefix)
        self.expected = {e.key for e in entries}
        record = kv.get(self.state_key)
        self.record = None if record is None else record.value
        self.out: dict[str, Any] = {
            "alive_keys_at_start": len(self.expected), "alive_keys_min": len(self.expected), "alive_deletes": 0,
            "deleted_examples": [], "record_changes": 0, "num_nodes_waiting_max": 0, "checks": 0,
            "watch_compacted": 0, "errors": [], "round_version": version,
        }
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, name="steady-watch", daemon=True),
                         threading.Thread(target=self._check, name="steady-check", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        for t in self._threads:
            t.join(30.0)
        return self.out

    def _error(self, where: str, exc: BaseException) -> None:
        if len(self.out["errors"]) < 10:
            self.out["errors"].append(f"{where}: {type(exc).__name__}: {exc}"[:300])

    def _watch(self) -> None:
        from rdzv_core.errors import HistoryCompactedError

        after = self.revision
        while not self._stop.is_set():
            try:
                events = self.kv.watch(self.alive_prefix, after, 1.0)
            except HistoryCompactedError:
                self.out["watch_compacted"] += 1
                entries, after = self.kv.list(self.alive_prefix)
                missing = self.expected - {e.key for e in entries}
                self.out["alive_deletes"] += len(missing)
                continue
            except Exception as exc:  # recorded; the list checks still run
                self._error("watch", exc)
                self._stop.wait(1.0)
                continue
            for event in events:
                after = max(after, event.revision)
                if event.type.name == "DELETE":
                    self.out["alive_deletes"] += 1
                    if len(self.out["deleted_examples"]) < 5:
                        self.out["deleted_examples"].append(event.key)

    def _check(self) -> None:
        while not self._stop.wait(self.check_interval):
            try:
                entries = self.kv.list(self.alive_prefix)[0]
                self.out["alive_keys_min"] = min(self.out["alive_keys_min"], len(entries))
                record = self.kv.get(self.state_key)
                if (None if record is None else record.value) != self.record:
                    self.out["record_changes"] += 1
                waiting = self.rdzv.num_nodes_waiting()
                self.out["num_nodes_waiting_max"] = max(self.out["num_nodes_waiting_max"], waiting)
                self.out["checks"] += 1
            except Exception as exc:  # recorded in the report
                self._error("check", exc)


def _time_next_round(agent: _Agent, res: dict[str, Any]) -> None:
    """Make the handler's ``next_round`` call record when the rank was known and switch the
    proxy's phase to ``bootstrap`` (the MASTER_ADDR/PORT exchange that follows).

    An instance attribute shadows the method; ``RdzvHandler.next_rendezvous`` is run unchanged.
    """
    rdzv = agent.handler.rendezvous
    original = type(rdzv).next_round.__get__(rdzv)

    def next_round() -> Any:
        result = original()
        res["t_rank"] = time.monotonic()
        res["version"] = result.version
        agent.proxy.phase = "bootstrap"
        return result

    rdzv.next_round = next_round


def _stop_torch_handler(handler: Any) -> None:
    """Stop a PyTorch handler's background keep-alive without closing the (per-run) rendezvous."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if stop is not None:  # dynamic_rendezvous
        stop()
    impl = getattr(handler, "_rdzv_impl", None)
    if impl is not None:  # legacy etcd_rendezvous: lease-renewal threads
        for name in ("_lease_this_rank_stop", "_lease_run_id_stop"):
            event = getattr(impl, name, None)
            if event is not None:
                event.set()


class LogTally(logging.Handler):
    """Counts WARNING+ records per (logger, level) and keeps a few distinct examples.

    The workers' logs would flood the terminal (one warning per retry of 1,024
    agents); the tally goes into the results instead.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}
        self.examples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.levelname} {record.name}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if len(self.examples) < 5:
            text = f"{key}: {record.getMessage()}"[:300]
            if not any(text[:80] == e[:80] for e in self.examples):
                self.examples.append(text)

    def thread_exception(self, args: Any) -> None:
        """``threading.excepthook``: count an exception that ended a thread (e.g. PyTorch's
        legacy lease workers) instead of printing its traceback."""
        key = f"thread died {args.exc_type.__name__}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{key}: {args.exc_value}"[:300])

    def quiet(self, name: str) -> None:
        """Route logger ``name`` (which may carry its own stderr handler) to this tally only."""
        logger = logging.getLogger(name)
        logger.handlers = [self]
        logger.propagate = False
        logger.setLevel(logging.WARNING)

    def take(self) -> dict[str, Any]:
        out = {"counts": self.counts, "examples": self.examples}
        self.counts, self.examples = {}, []
        return out


def _diagnosis_switches() -> None:
    """With ``RDZV_BENCH_LOG=DIR``: the rendezvous' INFO lines of this worker go to ``DIR/worker-PID.log``
    (a diagnosis aid: which member stalled a round; costs time at N = 1,024). With
    ``RDZV_BENCH_GRPC_WAIT=S``: gRPC's blocked streams wake every S s instead of 0.1 s (an experiment:
    1,024 etcd-v3 watch streams on 2 cores, each waking ten times a second for the GIL)."""
    wait = os.environ.get("RDZV_BENCH_GRPC_WAIT")
    if wait:  # an experiment on the harness, not the library: see docs/benchmarks.md, "One client per agent"
        import grpc._common

        grpc._common.MAXIMUM_WAIT_TIMEOUT = float(wait)  # gRPC's wait slice (0.1 s) in every blocked stream
    directory = os.environ.get("RDZV_BENCH_LOG")
    if not directory:
        return
    handler = logging.FileHandler(os.path.join(directory, f"worker-{os.getpid()}.log"))
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f %(threadName)s %(name)s %(message)s"))
    logger = logging.getLogger("rdzv_core.rendezvous")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def worker_main(conn: Any, events: list[Any], target: dict[str, Any]) -> None:
    """Entry point of a worker process (see the module docstring for the protocol;
    the ``tp_*`` commands are :func:`benchmarks.throughput.measure_store`'s)."""
    from .throughput import StoreClients

    stores = StoreClients()
    tally = LogTally()
    logging.getLogger().addHandler(tally)
    logging.getLogger().setLevel(logging.WARNING)
    _diagnosis_switches()
    threading.excepthook = tally.thread_exception
    try:
        worker = _Worker(target, events)
        # PyTorch's legacy etcd handler installs its own INFO-level stderr handler at import.
        tally.quiet("torch.distributed.elastic.rendezvous.etcd_rendezvous")
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("hello", None))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        try:
            if cmd[0] == "setup":
                conn.send(("ready", worker.setup(cmd[1])))
            elif cmd[0] == "go":
                worker.arm(cmd[2])
                conn.send(("armed", None))
                agents = worker.go(cmd[1], cmd[3])
                conn.send(("done", {"agents": agents, "log": tally.take()}))
            elif cmd[0] == "steady":
                _, seconds, monitor, check_interval = cmd
                report = worker.steady(seconds, monitor, check_interval)
                report["log"] = tally.take()
                conn.send(("held", report))
            elif cmd[0] == "kill":
                conn.send(("killed", worker.kill()))
            elif cmd[0] == "cleanup":
                worker.cleanup()
                conn.send(("clean", None))
            elif cmd[0] == "tp_open":
                stores.open(target, cmd[1])
                conn.send(("opened", None))
            elif cmd[0] == "tp_run":
                _, op, n, event_index, duration, tag = cmd
                conn.send(("armed", None))
                conn.send(("ran", stores.run(op, n, events[event_index], duration, tag)))
            elif cmd[0] == "tp_close":
                stores.close()
                conn.send(("closed", None))
            elif cmd[0] == "exit":
                worker.cleanup()
                stores.close()
                conn.send(("bye", None))
                conn.close()
                # Everything is released; skip the interpreter's teardown (a second with torch loaded).
                os._exit(0)
            else:
                conn.send(("error", f"unknown command {cmd[0]!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
