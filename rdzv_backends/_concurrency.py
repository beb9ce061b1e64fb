"""Backend-neutral helpers for threads that share one backend object.

* :class:`RaceRetry` -- when an optimistic read-modify-write that lost a race tries again;
* :class:`AddCombiner` -- concurrent ``add`` calls on one key become one write ("flat combining");
* :class:`ReadCoalescer` -- concurrent identical reads share requests, each as fresh as its own;
* :func:`copy_error` -- an exception met in one thread, to raise in another.

Nothing here knows a server or a client library; the etcd backends use all of it
(``docs/backends/etcd-v3.md`` explains why), and any backend may.
"""

from __future__ import annotations

import copy
import threading
from typing import Callable, Generic, Hashable, TypeVar, cast

from rdzv_core.backoff import Backoff
from rdzv_core.deadlines import Deadline
from rdzv_core.errors import BackendTimeoutError, KVError

__all__ = ["RaceRetry", "AddCombiner", "ReadCoalescer", "copy_error"]

T = TypeVar("T")

#: RaceRetry's contention pause window: first and largest (seconds).
_CONTENTION_FIRST = 0.002
_CONTENTION_CAP = 0.5


D = TypeVar("D", bound=Deadline)


class RaceRetry:
    """When to retry an optimistic read-modify-write that lost a race (a compare-and-swap loop).

    A lost attempt whose answer shows that another writer succeeded (progress)
    retries at once with the state the answer carried -- the first time, and
    right after a pause. A second loss in a row with that fresh state means
    contention: the call pauses a random time in [0, w) first, w = 2 ms doubling
    per pause up to 0.5 s (:class:`~rdzv_core.backoff.Backoff`: exponential backoff with
    "full jitter", as in Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015). Without
    pauses N clients arriving at one counter at once make about N^2/2 attempts
    (at N = 1,024 independent clients on etcd v3 no round formed within 40 s);
    with them about 2 N log2(N) and the key's writes stay close to one per round
    trip. A loss without progress retries once at once, then with
    :meth:`~rdzv_core.deadlines.Deadline.backoff`. Nothing retries past the deadline.

    Args:
        deadline: the operation's :class:`~rdzv_core.deadlines.Deadline`.
    """

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.attempts = 0
        self.pauses = 0  # contention pauses taken
        self._stalls = 0
        self._lost = 0  # lost attempts in a row that saw progress
        self._contention = Backoff(base=_CONTENTION_FIRST, cap=_CONTENTION_CAP)

    def again(self, progressed: bool) -> bool:
        """Note a lost attempt (sleeping as described above); ``False`` once the deadline has passed.

        Args:
            progressed: the key's state moved since the attempt's assumption.
        """
        self.attempts += 1
        if self.deadline.expired():
            return False
        if progressed:
            self._stalls = 0
            self._lost += 1
            if self._lost % 2:  # the first loss, or the one right after a pause: its state was stale
                return True
            self.pauses += 1
            self._contention.sleep(self.deadline.at)
            return not self.deadline.expired()
        self._lost = 0
        self._stalls += 1
        return True if self._stalls == 1 else self.deadline.backoff()

    def exhausted(self, what: str, key: str, operation_timeout: float) -> BackendTimeoutError:
        """The error once :meth:`again` said no: ``what`` lost every race until the deadline."""
        return BackendTimeoutError(
            f"{what} lost {self.attempts} races in a row to other writers of the key within "
            f"operation_timeout={operation_timeout:g} s", key
        )


class _Waiter(Generic[D]):
    """One ``add`` call queued in an :class:`AddCombiner`."""

    __slots__ = ("delta", "deadline", "done", "lead", "result", "error")

    def __init__(self, delta: int, deadline: D) -> None:
        self.delta = delta
        self.deadline = deadline
        self.done = threading.Event()
        self.lead = False
        self.result: int | None = None
        self.error: BaseException | None = None


class AddCombiner(Generic[D]):
    """Combines concurrent ``add`` calls of one backend object on one key into one write.

    The first caller for a key is its *leader*: it applies its own delta plus
    those of every call queued meanwhile as ONE write of their sum, hands each
    queued call its result (the value before the write plus the running sum in
    queue order) and passes leadership on ("flat combining", Hendler, Incze,
    Shavit and Tzafrir, SPAA 2010). The calls are linearizable: they take
    effect at the write's instant, in queue order. A failed write fails its
    whole batch with the same error. A batch runs under its leader's (the
    oldest call's) deadline; a call still queued at its own deadline leaves
    the queue and raises :class:`~rdzv_core.errors.BackendTimeoutError`, having
    written nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, list[_Waiter[D]]] = {}  # key -> calls waiting; present while a leader runs

    def add(self, key: str, delta: int, deadline: D, apply: Callable[[int, D], int]) -> int:
        """Add ``delta`` to ``key`` through ``apply``, combined with concurrent calls.

        Args:
            apply: ``apply(total_delta, deadline)`` adds ``total_delta`` in one
                atomic write and returns the key's new value (int).
            deadline: this call's operation deadline.

        Returns:
            The key's value right after this call's delta was applied.

        Raises:
            whatever ``apply`` raised for this call's batch;
            BackendTimeoutError: the call's deadline passed while it was queued.
        """
        me: _Waiter[D] = _Waiter(delta, deadline)
        with self._lock:
            queue = self._queues.get(key)
            if queue is None:
                self._queues[key] = []
                me.lead = True
            else:
                queue.append(me)
        if not me.lead:
            self._wait(key, me)
            if not me.lead:
                if me.error is not None:
                    raise copy_error(me.error)
                return cast(int, me.result)  # set before ``done``
        return self._lead(key, me, apply)

    def _wait(self, key: str, me: _Waiter[D]) -> None:
        """Wait until ``me`` is done or promoted to leader (bounded by its deadline)."""
        if me.done.wait(me.deadline.remaining() + 0.5):
            return
        with self._lock:
            queue = self._queues.get(key)
            if queue is not None and me in queue:  # never taken into a batch: nothing was written
                queue.remove(me)
                raise BackendTimeoutError(
                    f"add({key!r}) waited past its deadline behind other adds of this process", key)
        # In a batch whose leader started before us (so its deadline is earlier): it ends soon.
        if not me.done.wait(me.deadline.remaining() + 30.0):
            raise BackendTimeoutError(
                f"add({key!r}) did not complete in time; it may or may not have taken effect", key)

    def _lead(self, key: str, me: _Waiter[D], apply: Callable[[int, D], int]) -> int:
        with self._lock:
            batch = [me] + self._queues[key]
            self._queues[key] = []
        total = sum(w.delta for w in batch)
        try:
            value = apply(total, me.deadline)
        except BaseException as exc:
            shared: BaseException = exc if isinstance(exc, Exception) else KVError(
                f"add({key!r}) was interrupted in another thread; it may or may not have taken effect", key
            )
            for w in batch[1:]:
                w.error = shared
            raise
        else:
            running = value - total
            for w in batch:
                running += w.delta
                w.result = running
            return value - total + me.delta
        finally:
            with self._lock:
                queue = self._queues[key]
                if queue:
                    nxt = queue.pop(0)
                    nxt.lead = True
                    nxt.done.set()
                else:
                    del self._queues[key]
            for w in batch[1:]:
                w.done.set()


class _Read:
    """One request of a :class:`ReadCoalescer` and the calls it answers."""

    __slots__ = ("go", "done", "answer", "error", "calls")

    def __init__(self) -> None:
        self.calls = 1  # calls this request answers
        self.go = threading.Event()  # the request before it ended: send this one
        self.done = threading.Event()
        self.answer: object = None
        self.error: BaseException | None = None


class ReadCoalescer:
    """Concurrent identical reads through one backend object share requests, each as fresh as its own.

    The first call for a key sends its request at once; a call that finds one
    in flight joins the key's *next* request, sent as soon as the one in flight
    ends. Every answer thus comes from a request sent after the call began (a
    linearizable read stays linearizable), and at most two requests per key are
    outstanding. A request runs under the deadline of the call that sends it,
    the oldest of its group; its error is shared by the group.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, list[_Read | None]] = {}  # key -> [request in flight, next request]

    def waiting(self, key: Hashable) -> int:
        """How many calls wait for the next request of ``key`` (not yet sent); for tests and diagnostics."""
        with self._lock:
            slot = self._flights.get(key)
            nxt = None if slot is None else slot[1]
            return 0 if nxt is None else nxt.calls

    def read(self, key: Hashable, deadline: Deadline, fetch: Callable[[], T]) -> T:
        """``fetch()`` (one request, under ``deadline``), or the answer of one sent after this call began.

        Raises:
            whatever ``fetch`` raised for this call's group (a copy per call);
            BackendTimeoutError: the request before this call's group did not end in time.
        """
        with self._lock:
            slot = self._flights.get(key)
            if slot is None:
                me, lead = _Read(), True
                me.go.set()
                self._flights[key] = [me, None]
            elif slot[1] is None:
                me, lead = _Read(), True
                slot[1] = me
            else:
                me, lead = slot[1], False
                me.calls += 1
        if not lead:
            if not me.done.wait(deadline.remaining() + 30.0):
                raise BackendTimeoutError(f"a read of {key!r} shared with other threads did not end in time")
            if me.error is not None:
                raise copy_error(me.error)
            return cast(T, me.answer)
        if not me.go.wait(deadline.remaining() + 30.0):
            with self._lock:
                if slot is not None and slot[1] is me:  # never promoted: give the group up
                    slot[1] = None
                    me.error = BackendTimeoutError(f"a read of {key!r} in flight in another thread did not end in time")
                    me.done.set()
                    raise copy_error(me.error)
        try:
            answer = fetch()
        except BaseException as exc:
            me.error = exc if isinstance(exc, Exception) else KVError(f"a read of {key!r} was interrupted")
            raise
        else:
            me.answer = answer
            return answer
        finally:
            with self._lock:
                current = self._flights[key]
                nxt = current[1]
                if nxt is not None:
                    current[0], current[1] = nxt, None
                    nxt.go.set()
                else:
                    del self._flights[key]
            me.done.set()


def copy_error(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise in another thread (each thread gets its own traceback).

    An exception class that cannot be rebuilt from its ``args`` is returned itself (shared).
    """
    try:
        return copy.copy(error).with_traceback(None)
    except Exception:
        return error
