"""A c10d ``Store`` over any :class:`~rdzv_core.kv.KVBackend` (torchelastic's ``EtcdStore``, generalised).

Keys and values may be any ``str`` or ``bytes``; each key becomes one escaped
segment (a SHA-256 digest segment for keys over 80 bytes) under the store's prefix
(``ROOT/store/v_V.ID/`` for a rendezvous round),
so two runs or two rounds never see each other's keys and no key can escape the
prefix. Blocking operations (``get``, ``wait``, ``multi_get``) watch the prefix
until the keys appear or the timeout passes.

Every operation returns or raises within its timeout (the call's, else the
store's; a zero timeout is c10d's "no timeout"), whatever the backend's
``operation_timeout``: its backend calls run under :func:`rdzv_core.kv.deadline`.
Errors are c10d's (both ``RuntimeError``, the rdzv error as ``__cause__``):
``torch.distributed.DistStoreError`` for a timeout -- keys not set in time, or a
backend that did not answer in time -- and ``torch.distributed.DistNetworkError``
for a lost or refused connection (and a closed backend client).
``ValueTooLarge`` and ``CorruptEntry`` pass through as they are (bad data, not
store trouble).

Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import random
import time
from typing import Iterator, Sequence

import torch.distributed as dist
from torch._C._distributed_c10d import Store as _C10dStore  # dist.Store, typed (torch's .pyi)

from .errors import (
    BackendClosed,
    BackendTimeout,
    BackendUnavailable,
    CompareFailed,
    KeyExists,
    KeyNotFound,
    ValueTooLarge,
)
from .kv import KVBackend, check_prefix, deadline, escape_segment, unescape_segment, wait_for_change

__all__ = ["KVStore", "DEFAULT_STORE_TIMEOUT"]

#: c10d's default store timeout (c10d/Store.hpp).
DEFAULT_STORE_TIMEOUT = datetime.timedelta(seconds=300)


#: Seconds before a wait's deadline within which a backend timeout counts as the wait's own timeout.
_CUT_SLACK = 0.05


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
            with deadline(seconds):
                yield
        except BackendTimeout as exc:
            within = f"within {limit}" if seconds is not None else "(no Store timeout: the backend's own)"
            raise dist.DistStoreError(f"store {what} under {self._prefix!r} did not finish {within}: {exc}") from exc
        except (BackendUnavailable, BackendClosed) as exc:
            raise dist.DistNetworkError(f"store {what} under {self._prefix!r}: {exc}") from exc

    def _key(self, key: str | bytes) -> str:
        raw = _as_bytes("key", key)
        if len(raw) <= 80:  # escaped form is at most 1 + 3 * 80 characters: one segment
            return self._prefix + escape_segment(raw)
        return self._prefix + "~" + hashlib.sha256(raw).hexdigest()  # long keys: a digest segment

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
                raise ValueTooLarge(f"value of {len(data)} bytes for key {full!r} exceeds {limit} bytes", full)
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
            while True:
                entry = self._kv.get(full)
                try:
                    if entry is None:
                        self._kv.create(full, data)
                    else:
                        self._kv.compare_and_swap(full, entry.value + data, entry.revision)
                    return
                except (KeyExists, KeyNotFound, CompareFailed):
                    time.sleep(random.uniform(0, 0.005))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """c10d ``compareSet``: store ``desired_value`` if the current value is ``expected_value``
        (an absent key matches an empty ``expected_value``); return the value now stored
        (the current one, unchanged, when the comparison fails; ``expected_value`` for an
        absent key that does not match, as TCPStore does)."""
        full = self._key(key)
        expected, desired = _as_bytes("expected_value", expected_value), _as_bytes("desired_value", desired_value)
        with self._bounded("compare_set"):
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
                except (KeyExists, KeyNotFound, CompareFailed):
                    time.sleep(random.uniform(0, 0.005))

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
        """Wait until every key in ``keys`` is set.

        Raises:
            torch.distributed.DistStoreError: not all set within ``timeout`` (default: the store's).
        """
        limit = self._timeout if timeout is None else timeout
        with self._bounded("wait", limit):
            self._wait_get(keys, limit)

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` is set right now (no waiting)."""
        with self._bounded("check"):
            return all(self._kv.get(self._key(k)) is not None for k in keys)

    def num_keys(self) -> int:
        """Number of keys in this store."""
        with self._bounded("num_keys"):
            return len(self._kv.list(self._prefix)[0])

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
        """This store implements ``append``, ``multi_get`` and ``multi_set``."""
        return True

    def _wait_get(self, keys: Sequence[str | bytes], timeout: datetime.timedelta) -> list[bytes]:
        """Values of ``keys`` once all are set; a zero timeout waits forever (c10d's kNoTimeout)."""
        wanted = [self._key(k) for k in keys]
        seconds = timeout.total_seconds()
        until = time.monotonic() + (seconds if seconds > 0 else float("inf"))
        entries = [self._kv.get(k) for k in wanted]  # fast path: everything is usually there
        while True:
            if all(e is not None for e in entries):
                return [e.value for e in entries]  # type: ignore[union-attr]
            listed, revision = self._kv.list(self._prefix)  # the revision to watch from
            found = {e.key: e for e in listed}
            entries = [found.get(k) for k in wanted]
            if all(e is not None for e in entries):
                continue
            cut: BackendTimeout | None = None
            try:
                changed = wait_for_change(self._kv, self._prefix, revision, until)
            except BackendTimeout as exc:  # the watch's own request, cut at our deadline: the keys' timeout
                if time.monotonic() < until - _CUT_SLACK:
                    raise
                changed, cut = False, exc
            if not changed:
                missing = [k for k, e in zip(keys, entries, strict=True) if e is None]
                raise dist.DistStoreError(
                    f"timed out after {seconds:.3f} s waiting for store keys {missing!r:.200} under {self._prefix!r}"
                ) from cut
