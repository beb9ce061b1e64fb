"""A c10d ``Store`` over any :class:`~rdzv_core.kv.KVBackend` (torchelastic's ``EtcdStore``, generalised).

Keys and values may be any ``str`` or ``bytes``; each key becomes one escaped
segment (a SHA-256 digest segment for keys over 80 bytes) under the store's prefix
(``ROOT/store/v_V.ID/`` for a rendezvous round),
so two runs or two rounds never see each other's keys and no key can escape the
prefix. Blocking operations (``get``, ``wait``, ``multi_get``, ``queue_pop``,
``barrier``) watch the prefix until the keys appear or the timeout passes.
Queues (torch 2.13's ``queue_push``/``queue_pop``/``queue_len``) live apart from
the keys, under ``PREFIX@q/SEGMENT/`` (one entry per item, numbered by a counter
at ``PREFIX@qn/SEGMENT``), so they are not counted by ``num_keys``/``list_keys``
(as in TCPStore); docs/architecture.md lists the keys.

Every operation returns or raises within its timeout (the call's, else the
store's; a zero timeout is c10d's "no timeout"), whatever the backend's
``operation_timeout``: its backend calls run under :func:`rdzv_core.kv.call_deadline`.
Errors are c10d's (both ``RuntimeError``, the rdzv error as ``__cause__``):
``torch.distributed.DistStoreError`` for a timeout -- keys not set in time, or a
backend that did not answer in time -- and ``torch.distributed.DistNetworkError``
for a lost or refused connection (and a closed backend client).
``ValueTooLargeError`` and ``CorruptEntryError`` pass through as they are (bad data, not
store trouble).

torch's pybind trampoline for Python stores forwards neither the queue methods nor
``barrier`` to Python: C++ callers (e.g. a ``PrefixStore`` over this store) get c10d's
"queue support is not implemented", and c10d's default ``barrier`` (built on our
``add``/``wait``, same keys as ours, so both meet).

Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import time
from typing import Iterator, Sequence

import torch.distributed as dist
from torch._C._distributed_c10d import Store as _C10dStore  # dist.Store, typed (torch's .pyi)

from ..backoff import Backoff
from ..errors import (
    BackendClosedError,
    BackendTimeoutError,
    BackendUnavailableError,
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    ValueTooLargeError,
)
from ..kv import Entry, KVBackend, call_deadline, check_prefix, escape_segment, unescape_segment, wait_for_change

__all__ = ["KVStore", "DEFAULT_STORE_TIMEOUT"]

#: c10d's default store timeout (c10d/Store.hpp).
DEFAULT_STORE_TIMEOUT = datetime.timedelta(seconds=300)


#: First segment of queue items (``@q``) and of queue counters (``@qn``): never a key's segment,
#: which starts with ``=`` or ``~``.
_QUEUE, _QUEUE_COUNTER = "@q", "@qn"

#: Seconds before a wait's deadline within which a backend timeout counts as the wait's own timeout.
_CUT_SLACK = 0.05


def _race_backoff() -> Backoff:
    """The pause after a compare-and-swap loop lost a race: up to 5 ms, not growing (full jitter)."""
    return Backoff(base=0.005, cap=0.005)


def _seconds(timeout: datetime.timedelta) -> float | None:
    """A c10d timeout in seconds; ``None`` for zero or less (c10d's kNoTimeout: wait forever)."""
    seconds = timeout.total_seconds()
    return seconds if seconds > 0 else None


def _as_bytes(field: str, data: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, (list, tuple)):  # c10d passes std::vector<uint8_t> as a list of ints
        return bytes(data)
    raise TypeError(f"{field} must be str or bytes, got {type(data).__name__}")


class KVStore(_C10dStore):
    """``torch.distributed.Store`` backed by a KV backend.

    Args:
        kv: the backend (not closed by the store).
        prefix: key prefix ending in ``/`` (e.g. ``Rendezvous.store_prefix(version)``).
        timeout: default timeout of blocking operations (``datetime.timedelta``; 300 s).

    In torch >= 2.13 ``Store.timeout`` is a read-only property of the C++ base,
    so the store keeps its own ``_timeout`` and overrides ``timeout``.
    """

    def __init__(self, kv: KVBackend, prefix: str, timeout: datetime.timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__()
        self._kv = kv
        self._prefix = check_prefix(prefix)
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"KVStore(prefix={self._prefix!r}, timeout={self._timeout})"

    @property
    def timeout(self) -> datetime.timedelta:
        """Default timeout of blocking operations."""
        return self._timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Change the default timeout of blocking operations."""
        self._timeout = timeout

    @contextlib.contextmanager
    def _bounded(self, what: str, timeout: datetime.timedelta | None = None) -> Iterator[None]:
        """Run one operation's backend calls within ``timeout`` (default: the store's); map errors to c10d's."""
        limit = self._timeout if timeout is None else timeout
        seconds = _seconds(limit)
        try:
            with call_deadline(seconds):
                yield
        except BackendTimeoutError as exc:
            within = f"within {limit}" if seconds is not None else "(no Store timeout: the backend's own)"
            raise dist.DistStoreError(f"store {what} under {self._prefix!r} did not finish {within}: {exc}") from exc
        except (BackendUnavailableError, BackendClosedError) as exc:
            raise dist.DistNetworkError(f"store {what} under {self._prefix!r}: {exc}") from exc

    @staticmethod
    def _segment(key: str | bytes) -> str:
        raw = _as_bytes("key", key)
        if len(raw) <= 80:  # escaped form is at most 1 + 3 * 80 characters: one segment
            return escape_segment(raw)
        return "~" + hashlib.sha256(raw).hexdigest()  # long keys: a digest segment

    def _key(self, key: str | bytes) -> str:
        return self._prefix + self._segment(key)

    def _queue(self, key: str | bytes) -> str:
        """The prefix under which the items of queue ``key`` live."""
        return f"{self._prefix}{_QUEUE}/{self._segment(key)}/"

    # -- writes -------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value`` at ``key``."""
        with self._bounded("set"):
            self._kv.put(self._key(key), _as_bytes("value", value))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Write each ``values[i]`` at ``keys[i]`` (one write per key)."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        pairs = [(self._key(k), _as_bytes("value", v)) for k, v in zip(keys, values, strict=True)]
        limit = self._kv.capabilities.max_value_bytes
        for full, data in pairs:  # all or nothing for sizes: check every value before the first write
            if limit is not None and len(data) > limit:
                raise ValueTooLargeError(f"value of {len(data)} bytes for key {full!r} exceeds {limit} bytes", full)
        with self._bounded("multi_set"):
            for full, data in pairs:
                self._kv.put(full, data)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (absent = 0); return the sum."""
        with self._bounded("add"):
            return self._kv.add(self._key(key), int(amount))

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (creating it), atomically (compare-and-swap loop)."""
        full, data = self._key(key), _as_bytes("value", value)
        with self._bounded("append"):
            backoff = _race_backoff()
            while True:
                entry = self._kv.get(full)
                try:
                    if entry is None:
                        self._kv.create(full, data)
                    else:
                        self._kv.compare_and_swap(full, entry.value + data, entry.revision)
                    return
                except (KeyExistsError, KeyNotFoundError, CompareFailedError):
                    backoff.sleep()

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """c10d ``compareSet``: store ``desired_value`` if the current value is ``expected_value``
        (an absent key matches an empty ``expected_value``); return the value now stored
        (the current one, unchanged, when the comparison fails; ``expected_value`` for an
        absent key that does not match, as TCPStore does)."""
        full = self._key(key)
        expected, desired = _as_bytes("expected_value", expected_value), _as_bytes("desired_value", desired_value)
        with self._bounded("compare_set"):
            backoff = _race_backoff()
            while True:
                entry = self._kv.get(full)
                try:
                    if entry is None:
                        if expected:
                            return expected
                        self._kv.create(full, desired)
                        return desired
                    if entry.value != expected:
                        return entry.value
                    self._kv.compare_and_swap(full, desired, entry.revision)
                    return desired
                except (KeyExistsError, KeyNotFoundError, CompareFailedError):
                    backoff.sleep()

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        with self._bounded("delete_key"):
            return self._kv.delete(self._key(key))

    # -- reads --------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """Return the value at ``key``, waiting up to the timeout for it to be set.

        Raises:
            torch.distributed.DistStoreError: not set within the timeout.
        """
        with self._bounded("get"):
            return self._wait_get([key], self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Return the values of ``keys`` (waiting for all, like ``get``)."""
        with self._bounded("multi_get"):
            return self._wait_get(keys, self._timeout)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set (or, as in TCPStore, is a non-empty queue).

        Raises:
            torch.distributed.DistStoreError: not all set within ``timeout`` (default: the store's).
        """
        limit = self._timeout if timeout is None else timeout
        with self._bounded("wait", limit):
            self._wait_get(keys, limit, queues=True)

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` is set (or is a non-empty queue) right now (no waiting)."""
        with self._bounded("check"):
            return all(self._kv.get(self._key(k)) is not None or self._kv.list(self._queue(k))[0] for k in keys)

    def num_keys(self) -> int:
        """Number of keys in this store."""
        with self._bounded("num_keys"):
            return sum(1 for e in self._kv.list(self._prefix)[0] if not e.key[len(self._prefix):].startswith("@"))

    def clone(self) -> "KVStore":
        """This same store (it is thread-safe).

        c10d clones stores for its own threads. A fresh Python object handed to C++
        would be garbage-collected while C++ still holds it, and pybind11 would then
        find no Python overrides ("Not implemented"), so the clone is ``self``.
        """
        return self

    def list_keys(self) -> list[str]:
        """The keys of this store that are valid UTF-8 (digest-named long keys are not listed)."""
        out = []
        with self._bounded("list_keys"):
            listed = self._kv.list(self._prefix)[0]
        for entry in listed:
            segment = entry.key[len(self._prefix):]
            if segment.startswith("="):
                try:
                    out.append(unescape_segment(segment).decode("utf-8"))
                except UnicodeDecodeError:
                    continue
        return out

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` are implemented (what c10d's
        ``Store::hasExtendedApi`` promises, and what gloo's ``has_v2_support`` asks; the
        queue and barrier methods are not gated by it)."""
        return True

    # -- queues and barrier (torch 2.13) ------------------------------------
    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the FIFO queue ``key`` (c10d ``queuePush``; created on first push).

        Each item is one entry numbered by an atomic counter, so pushes that do not
        overlap in time pop in push order, whichever clients made them.
        """
        data = _as_bytes("value", value)
        counter = f"{self._prefix}{_QUEUE_COUNTER}/{self._segment(key)}"
        with self._bounded("queue_push"):
            number = self._kv.add(counter, 1)
            self._kv.create(f"{self._queue(key)}{number:020d}", data)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the oldest item of queue ``key`` (c10d ``queuePop``).

        Args:
            block: wait up to the store's timeout for an item when the queue is empty.

        Raises:
            torch.distributed.QueueEmptyError: empty and ``block`` is False.
            torch.distributed.DistStoreError: still empty when the timeout passed.
        """
        items = self._queue(key)
        seconds = self._timeout.total_seconds()
        until = time.monotonic() + (seconds if seconds > 0 else float("inf"))
        with self._bounded("queue_pop"):
            while True:
                listed, revision = self._kv.list(items)
                for entry in sorted(listed, key=lambda e: e.key):
                    if self._kv.delete(entry.key):  # items are written once: whoever deletes it owns it
                        return entry.value
                if not block:
                    raise dist.QueueEmptyError(f"queue {key!r} under {self._prefix!r} is empty")
                self._await_change(items, revision, until, seconds, f"an item in queue {key!r}")

    def queue_len(self, key: str) -> int:
        """Number of items in queue ``key`` (0 for a queue never pushed to)."""
        with self._bounded("queue_len"):
            return len(self._kv.list(self._queue(key))[0])

    def barrier(self, key: str, world_size: int, timeout: datetime.timedelta | None = None) -> None:
        """Block until ``world_size`` callers have called ``barrier`` with ``key`` (c10d 2.13 ``Store::barrier``).

        c10d's default algorithm and keys (``KEY/num_members`` counted by ``add``,
        ``KEY/last_member`` set by the last arrival), so it meets C++ callers of
        the same store; once passed, a key's barrier stays open (single use, as in torch).

        Raises:
            torch.distributed.DistStoreError: fewer than ``world_size`` arrived within
                ``timeout`` (default: the store's), naming how many did.
        """
        limit = self._timeout if timeout is None else timeout
        count, last = f"{key}/num_members", f"{key}/last_member"
        if self.add(count, 1) == int(world_size):
            self.set(last, b"1")
        try:
            self.wait([last], limit)
        except dist.DistStoreError as exc:
            arrived = self.add(count, 0)
            raise dist.DistStoreError(
                f"barrier {key!r} under {self._prefix!r}: timeout: {arrived} of {world_size} arrived within {limit}"
            ) from exc

    def _await_change(self, prefix: str, revision: int, until: float, seconds: float, what: str) -> None:
        """Return once something under ``prefix`` changed after ``revision``; at ``until``
        (monotonic seconds; the wait's ``seconds``) raise ``DistStoreError`` naming ``what``."""
        cut: BackendTimeoutError | None = None
        try:
            if wait_for_change(self._kv, prefix, revision, until):
                return
        except BackendTimeoutError as exc:  # the watch's own request, cut at our deadline: the keys' timeout
            if time.monotonic() < until - _CUT_SLACK:
                raise
            cut = exc
        raise dist.DistStoreError(f"timeout after {seconds:.3f} s waiting for {what} under {self._prefix!r}") from cut

    def _wait_get(self, keys: Sequence[str | bytes], timeout: datetime.timedelta, queues: bool = False) -> list[bytes]:
        """Values of ``keys`` once all are set; a zero timeout waits forever (c10d's kNoTimeout).

        With ``queues`` a key that names a non-empty queue counts as set (its value is ``b""``).
        """
        wanted = [self._key(k) for k in keys]
        seconds = timeout.total_seconds()
        until = time.monotonic() + (seconds if seconds > 0 else float("inf"))
        entries: list[Entry | None] = [self._kv.get(k) for k in wanted]  # fast path: usually all there
        while True:
            if all(e is not None for e in entries):
                return [e.value for e in entries]  # type: ignore[union-attr]
            listed, revision = self._kv.list(self._prefix)  # the revision to watch from
            found = {e.key: e for e in listed}
            entries = [found.get(k) for k in wanted]
            if queues:  # a non-empty queue counts as set (value b"", which wait() does not return)
                queues_held = {self._queue(k): w for k, w in zip(keys, wanted, strict=True)}
                queued = {w for q, w in queues_held.items() if any(x.key.startswith(q) for x in listed)}
                entries = [Entry(w, b"", revision) if e is None and w in queued else e
                           for w, e in zip(wanted, entries, strict=True)]
            if all(e is not None for e in entries):
                continue
            missing = [k for k, e in zip(keys, entries, strict=True) if e is None]
            self._await_change(self._prefix, revision, until, seconds, f"store keys {missing!r:.200}")
