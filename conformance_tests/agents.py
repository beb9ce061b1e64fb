"""Helpers of the conformance scenarios (no tests here): agents on threads, hooked clients, crews and rounds,
threads started together, the events of a window, and the fixtures ``run_id`` and ``agents`` (registered by
:mod:`conformance_tests.plugin`).

Agents are threads, each with its own backend client (as separate hosts would have); every wait is bounded.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import pytest

from rdzv_core import KVBackend, KVError, Rendezvous, RendezvousParams, RoundResult
from rdzv_core.kv import Event

TTL = 1.0  # keep-alive TTL used by these tests (seconds)


class Agent:
    """One node: a Rendezvous on its own client, with next_round run on a thread."""

    def __init__(self, kv: KVBackend, run_id: str, params: RendezvousParams) -> None:
        self.kv = kv
        self.rdzv = Rendezvous(kv, run_id, params)
        self.result: RoundResult | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> "Agent":
        self.result, self.error = None, None
        self.done.clear()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.result = self.rdzv.next_round()
        except BaseException as exc:  # recorded for the test to assert on
            self.error = exc
        finally:
            self.done.set()

    def wait(self, timeout: float) -> RoundResult:
        assert self.done.wait(timeout), "agent did not finish in time"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@contextlib.contextmanager
def crew_of(clients: Callable[[], KVBackend], run_prefix: str, defaults: dict[str, Any],
            leave: bool = False) -> Iterator[Callable[..., list[Agent]]]:
    """``make(n, **params)`` -> n agents of one fresh run (``run_prefix`` + random), each on its own
    ``clients()`` client, with ``RendezvousParams(**defaults, **params)`` (not started).

    On exit an agent still running (a failed test's) has its client closed, which ends its
    ``next_round`` at once; with ``leave`` every agent then leaves its round (a backend error
    there is ignored: the key lapses by its TTL).
    """
    run_id = f"{run_prefix}{uuid.uuid4().hex[:10]}"
    made: list[Agent] = []

    def make(n: int, **params: Any) -> list[Agent]:
        p = RendezvousParams(**{**defaults, **params})
        new = [Agent(clients(), run_id, p) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for agent in made:
        if agent.thread is not None and agent.thread.is_alive():
            agent.kv.close()  # a failed test's agent: BackendClosedError ends its next_round at once
            agent.thread.join(10)
        if leave:
            try:
                agent.rdzv.leave()
            except KVError:
                pass


def round_of(agents: list[Agent], timeout: float) -> list[RoundResult]:
    """Every agent's result within ``timeout`` s; they form one round (same version, ranks 0..n-1)."""
    deadline = time.monotonic() + timeout
    results = [a.wait(max(0.0, deadline - time.monotonic())) for a in agents]
    assert sorted(r.rank for r in results) == list(range(len(agents))), results
    assert {r.world_size for r in results} == {len(agents)}, results
    assert len({r.version for r in results}) == 1, results
    return results


class Hooked:
    """A real client with hooks: ``before_METHOD(first argument)`` runs before each call of ``METHOD``
    (e.g. ``before_take_ticket(key)``, ``before_list(prefix)``)."""

    def __init__(self, kv: KVBackend, **hooks: Callable[[Any], None]) -> None:
        self._kv, self._hooks = kv, hooks

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._kv, name)
        hook = self._hooks.get(f"before_{name}")
        if hook is None:
            return attr

        def hooked(*args: Any, **kwargs: Any) -> Any:
            hook(args[0] if args else None)
            return attr(*args, **kwargs)

        return hooked


@pytest.fixture
def run_id() -> str:
    return f"run{uuid.uuid4().hex[:12]}"


@pytest.fixture
def agents(kv_factory: Callable[[], KVBackend], run_id: str):
    """``agents(n, **params)`` -> n Agents on fresh clients (not started)."""
    made: list[Agent] = []

    def make(n: int, **params: float) -> list[Agent]:
        p = RendezvousParams(**{"keep_alive_ttl": TTL, "timeout": 30.0, "last_call_timeout": 0.5, **params})
        new = [Agent(kv_factory(), run_id, p) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for agent in made:
        agent.rdzv.leave()


def quiet(kv: KVBackend, prefix: str, after: int, timeout: float) -> list[Event]:
    """Every event under ``prefix`` after ``after`` during ``timeout`` seconds (expected: none)."""
    deadline = time.monotonic() + timeout
    seen: list[Event] = []
    while (remaining := deadline - time.monotonic()) > 0:
        batch = kv.watch(prefix, after, remaining)
        seen += batch
        if batch:
            after = batch[-1].revision
    return seen


def run_threads(n: int, target: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``target(i)`` in ``n`` threads started together; return results (or exceptions) by index."""
    results: list[Any] = [None] * n
    barrier = threading.Barrier(n)

    def main(i: int) -> None:
        try:
            barrier.wait(timeout)
            results[i] = target(i)
        except BaseException as exc:  # collected and judged by the test
            results[i] = exc

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s"
    return results
