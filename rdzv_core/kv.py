"""The key-value protocol: the one contract between rendezvous logic and backends.

Everything above this module (the rendezvous state machine, the c10d Store, the
handler) talks to a backend only through :class:`KVBackend`; every backend
(memory, file, etcd v2, etcd v3, Redis, third-party plugins) implements it and
nothing more.

Keys
    ``str`` paths of ``/``-separated segments, e.g. ``"torchelastic/p2p/run_1/rdzv/active"``.
    A segment is 1-255 characters from ``A-Z a-z 0-9 _ - . = % + : @ ~`` and is
    neither ``.`` nor ``..``; there is no leading, trailing or doubled ``/``. A
    key is at most 1,024 characters. Arbitrary data (user keys, run ids) becomes
    a segment with :func:`escape_segment`, which cannot produce ``/``.
Prefixes
    ``""`` (the whole keyspace) or a key followed by ``/``; they select the keys
    below them (string-prefix match).
Values
    ``bytes``; at most ``capabilities.max_value_bytes`` (else :class:`ValueTooLargeError`,
    raised before anything is written).
Revisions
    Every write (create, put, compare-and-swap, add, take_ticket, delete, expiry) advances a
    keyspace-wide revision counter; :attr:`Entry.revision` is the revision of the
    entry's last modification (etcd's ``modifiedIndex`` / ``mod_revision``).
    Revisions are positive ints, strictly increasing in the order writes took
    effect. ``refresh`` does not change the value; a backend may advance the
    entry's revision on refresh (etcd v2 does), and it emits no event.
TTL
    float seconds > 0, or ``None`` for a key that lives until deleted. Expiry is
    judged by the server (or, for server-less backends, the host's clock) and is
    visible to ``watch`` as a :attr:`EventType.DELETE` event. Writing a key with
    ``ttl=None`` removes any TTL it had; ``add`` keeps the TTL the key has;
    ``refresh`` gives the key a TTL of ``ttl`` seconds from now, also when it had none.
Watch
    ``watch(prefix, after_revision, timeout)`` returns the events under ``prefix``
    with revision > ``after_revision`` (in revision order), blocking until there
    is at least one or ``timeout`` seconds pass (then ``[]``). A backend may
    return fewer events than exist (callers re-read and watch again) but never
    an event at or below ``after_revision``. :class:`HistoryCompactedError` means the
    history after ``after_revision`` is gone: re-read, then watch from the
    revision read. Closing the backend while a watch runs makes that watch return
    ``[]`` or raise :class:`~rdzv_core.errors.BackendClosedError` promptly.
Counters
    ``add`` stores ASCII decimal (``-?[0-9]+``); any other present value is a
    :class:`~rdzv_core.errors.CorruptEntryError`.
Tickets
    ``take_ticket(key)`` hands concurrent callers 1, 2, 3, ..., each number once;
    ``tickets(key)`` says how many were taken. A ticket key is written and read only
    through these two (and deleted by ``delete``); its stored form is the backend's:
    an ``add`` counter by default, in-order keys on etcd v2, the key's version on etcd
    v3 -- where a counter under contention costs a compare-and-swap race.
Deadlines
    Every call returns or raises within the backend's ``operation_timeout``. A
    caller with a tighter bound (the c10d Store: its timeout) wraps its calls in
    :func:`call_deadline` (:mod:`rdzv_core.deadlines`); a backend gives each request it sends ``call_budget(its
    operation_timeout)`` seconds, so the call ends by the caller's deadline too
    (a small margin aside), with :class:`~rdzv_core.errors.BackendTimeoutError`.
    A backend that retries within one operation may share a :class:`Deadline`
    (an absolute time with the back-off between attempts) among them.
Corrupt storage
    Data at a key that this protocol did not write (a value of the wrong storage
    type, unparseable bookkeeping) makes ``get``/``list``/``add``/... raise
    :class:`~rdzv_core.errors.CorruptEntryError` naming the key -- never a crash with a
    client library's exception, never a hang -- and ``delete(key)`` removes it.

The errors are drawn in :mod:`rdzv_core.errors`.
"""

from __future__ import annotations

import abc
import enum
import re
import time
from dataclasses import dataclass
from types import TracebackType
from .deadlines import Deadline, budget_text, call_budget, call_deadline  # re-exported: part of the protocol
from .deadlines import check_timeout as _check_timeout
from .errors import BackendClosedError, CorruptEntryError, InvalidArgumentError, KeyNotFoundError, ValueTooLargeError
from .keys import check_key, check_prefix, escape_segment, join_key, unescape_segment  # re-exported

_List = list  # ``list`` is also a method name of KVBackend; annotations inside the class use this

__all__ = [
    "Entry",
    "EventType",
    "Event",
    "Capabilities",
    "KVBackend",
    "escape_segment",
    "unescape_segment",
    "join_key",
    "check_key",
    "check_prefix",
    "wait_for_change",
    "Deadline",
    "call_deadline",
    "call_budget",
    "budget_text",
    "parse_counter",
    "watch_prefixes",
]

_COUNTER = re.compile(rb"-?[0-9]{1,30}")


@dataclass(frozen=True)
class Entry:
    """One stored key.

    Attributes:
        key: the key (str, see the key grammar).
        value: the stored bytes.
        revision: keyspace revision of the entry's last modification (int > 0).
    """

    key: str
    value: bytes
    revision: int


class EventType(enum.Enum):
    """What happened to a key: ``PUT`` (created or changed) or ``DELETE``
    (deleted, compare-and-deleted or expired)."""

    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class Event:
    """One change seen by :meth:`KVBackend.watch`.

    Attributes:
        type: :class:`EventType`.
        key: the key that changed.
        revision: the keyspace revision of the change (int > 0).
        value: the new value for ``PUT``; ``None`` for ``DELETE``.
    """

    type: EventType
    key: str
    revision: int
    value: bytes | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data that tests and users can ask.

    Attributes:
        multi_host: agents on different hosts can meet through it.
        multi_process: several processes (on one host at least) share one keyspace.
        server_side_ttl: TTLs are judged by a server's clock, not the clients'.
        native_watch: watches are pushed by the server (not polled).
        persistent: state survives the end of the process that wrote it.
        tls: the backend can speak TLS (``protocol=https`` / ``rediss://``).
        auth: the backend accepts a user and password from the URL.
        max_value_bytes: the largest value accepted (bytes), ``None`` if unlimited.
        ttl_resolution: how late (seconds) an expiry may be observed by watch.
        tickets_in_value: ``get`` reads a ticket key as its count (ASCII decimal), and
            foreign data there is a ``CorruptEntryError`` (``False`` on etcd v3: the count is
            the key's version).
    """

    multi_host: bool
    server_side_ttl: bool
    native_watch: bool
    persistent: bool
    multi_process: bool = True
    tls: bool = False
    auth: bool = False
    max_value_bytes: int | None = None
    ttl_resolution: float = 0.5
    tickets_in_value: bool = True

    def as_dict(self) -> dict[str, object]:
        """The capabilities as a plain ``dict`` (for JSON and tables)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _check_ttl(ttl: float | None) -> float | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0 or ttl != ttl or ttl == float("inf"):
        raise InvalidArgumentError("ttl", ttl, "a TTL is a finite number of seconds > 0, or None")
    return float(ttl)


class KVBackend(abc.ABC):
    """Base class of every backend: validates arguments, then calls the ``_do_*`` hooks.

    Subclasses implement the ``_do_*`` methods (arguments already validated) and set
    :attr:`capabilities`. All methods are thread-safe and synchronous. Transient
    server trouble raises :class:`~rdzv_core.errors.BackendUnavailableError` subclasses
    within the operation's deadline; nothing retries forever.
    """

    #: What this backend can do; subclasses override.
    capabilities: Capabilities = Capabilities(
        multi_host=False, server_side_ttl=False, native_watch=False, persistent=False
    )

    #: What the backend found about its server at open that it accepted with a warning (one line each,
    #: also logged at WARNING): e.g. a setting the URL explicitly allowed. ``rdzv check`` shows them.
    server_warnings: tuple[str, ...] = ()

    _closed: bool = False

    # -- public API (validation lives here, once for every backend) -------------
    def get(self, key: str) -> Entry | None:
        """Return the entry at ``key`` or ``None`` if absent or expired."""
        self._check_open()
        return self._do_get(check_key(key))

    def list(self, prefix: str) -> tuple[_List[Entry], int]:
        """Return ``(entries below prefix sorted by key, keyspace revision at read time)``."""
        self._check_open()
        return self._do_list(check_prefix(prefix))

    def create(self, key: str, value: bytes, ttl: float | None = None) -> Entry:
        """Write ``key`` only if absent; return the new entry.

        Raises:
            KeyExistsError: the key is present.
        """
        self._check_open()
        return self._do_create(check_key(key), self._check_value(key, value), _check_ttl(ttl))

    def put(self, key: str, value: bytes, ttl: float | None = None) -> Entry:
        """Write ``key`` unconditionally; return the new entry."""
        self._check_open()
        return self._do_put(check_key(key), self._check_value(key, value), _check_ttl(ttl))

    def compare_and_swap(
        self, key: str, value: bytes, expected_revision: int, ttl: float | None = None
    ) -> Entry:
        """Replace ``key``'s value if its revision is ``expected_revision``.

        Raises:
            KeyNotFoundError: the key is absent.
            CompareFailedError: the key's revision differs.
        """
        self._check_open()
        return self._do_compare_and_swap(
            check_key(key), self._check_value(key, value), _check_revision(expected_revision), _check_ttl(ttl)
        )

    def compare_and_delete(self, key: str, expected_revision: int) -> None:
        """Delete ``key`` if its revision is ``expected_revision``.

        Raises:
            KeyNotFoundError: the key is absent.
            CompareFailedError: the key's revision differs.
        """
        self._check_open()
        self._do_compare_and_delete(check_key(key), _check_revision(expected_revision))

    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        self._check_open()
        return self._do_delete(check_key(key))

    def refresh(self, key: str, ttl: float) -> None:
        """Restart ``key``'s TTL at ``ttl`` seconds without changing its value.

        Raises:
            KeyNotFoundError: the key is absent (for example its TTL already ran out).
        """
        self._check_open()
        checked = _check_ttl(ttl)
        if checked is None:
            raise InvalidArgumentError("ttl", ttl, "refresh needs a TTL")
        self._do_refresh(check_key(key), checked)

    def expire_tree(self, prefix: str, ttl: float) -> int:
        """Give every key under ``prefix`` a TTL of ``ttl`` seconds from now, as :meth:`refresh` does
        (values unchanged, no watch event; each key's expiry is a ``DELETE`` event), so the whole
        tree goes. A key written under ``prefix`` afterwards keeps the TTL it is written with; a
        backend that keeps directories (etcd v2) also expires the prefix's directory, shortly after
        its keys, and with it any key written there since.

        Args:
            prefix: ``""`` or a key followed by ``/``.
            ttl: seconds (float > 0).

        Returns:
            how many keys were given the TTL (keys that went meanwhile are skipped).

        Raises:
            InvalidArgumentError: a bad TTL; InvalidKeyError: a bad prefix.
            CorruptEntryError: as :meth:`list`.
        """
        self._check_open()
        checked = _check_ttl(ttl)
        if checked is None:
            raise InvalidArgumentError("ttl", ttl, "expire_tree needs a TTL")
        return self._do_expire_tree(check_prefix(prefix), checked)

    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the decimal integer at ``key``; return the sum.

        An absent key counts as 0. The value is stored as ASCII decimal bytes
        (``b"5"``), as c10d's ``Store.add`` does.

        Raises:
            CorruptEntryError: the present value is not a decimal integer.
        """
        self._check_open()
        if isinstance(delta, bool) or not isinstance(delta, int):
            raise InvalidArgumentError("delta", delta, "add() takes an int")
        return self._do_add(check_key(key), delta)

    def take_ticket(self, key: str) -> int:
        """Take the next ticket at ``key``: concurrent callers get 1, 2, 3, ..., each number once.

        ``tickets(key)`` counts them; after ``delete(key)`` they start again at 1.

        Raises:
            CorruptEntryError: ``key`` holds data that is no ticket counter (nothing written).
            BackendUnavailableError: as every write; the ticket may have been taken if no answer came.
        """
        self._check_open()
        return self._do_take_ticket(check_key(key))

    def tickets(self, key: str) -> int:
        """How many tickets were taken at ``key`` (0 if none); :class:`CorruptEntryError` as ``take_ticket``."""
        self._check_open()
        return self._do_tickets(check_key(key))

    def watch(self, prefix: str, after_revision: int, timeout: float) -> _List[Event]:
        """Wait for changes under ``prefix`` after ``after_revision`` (see module doc).

        Args:
            prefix: ``""`` or a key followed by ``/``.
            after_revision: only events with a larger revision are returned (int >= 0).
            timeout: seconds to wait at most; ``[]`` when nothing happened in time.

        Raises:
            HistoryCompactedError: events after ``after_revision`` are no longer available.
        """
        self._check_open()
        if isinstance(after_revision, bool) or not isinstance(after_revision, int) or after_revision < 0:
            raise InvalidArgumentError("after_revision", after_revision, "a revision is an int >= 0")
        return self._do_watch(check_prefix(prefix), after_revision, _check_timeout(timeout))

    def ttl_remaining(self, key: str) -> float | None:
        """Seconds (float >= 0) until ``key`` expires, or ``None`` if it has no TTL.

        For operators (``rdzv status`` shows how long ago each member's keep-alive
        was refreshed); the rendezvous does not depend on it. Judged by the same
        clock as expiry (the server's, or the host's for server-less backends), to
        that backend's resolution (etcd: whole seconds).

        Raises:
            KeyNotFoundError: the key is absent (or expired).
            NotImplementedError: the backend cannot tell (the default for plugins
                that do not implement ``_do_ttl_remaining``).
        """
        self._check_open()
        return self._do_ttl_remaining(check_key(key))

    def close(self) -> None:
        """Release connections and threads; later calls raise :class:`BackendClosedError`."""
        if not self._closed:
            self._closed = True
            self._do_close()

    def __enter__(self) -> "KVBackend":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError(f"{type(self).__name__} is closed")

    def _check_value(self, key: str, value: bytes) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError("value", type(value).__name__, "values are bytes")
        value = bytes(value)
        limit = self.capabilities.max_value_bytes
        if limit is not None and len(value) > limit:
            raise ValueTooLargeError(
                f"value of {len(value)} bytes for key {key!r} exceeds this backend's limit of {limit} bytes",
                key,
            )
        return value

    # -- what backends implement -----------------------------------------------
    @abc.abstractmethod
    def _do_get(self, key: str) -> Entry | None: ...

    @abc.abstractmethod
    def _do_list(self, prefix: str) -> tuple[_List[Entry], int]: ...

    @abc.abstractmethod
    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry: ...

    @abc.abstractmethod
    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry: ...

    @abc.abstractmethod
    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry: ...

    @abc.abstractmethod
    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None: ...

    @abc.abstractmethod
    def _do_delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _do_refresh(self, key: str, ttl: float) -> None: ...

    @abc.abstractmethod
    def _do_add(self, key: str, delta: int) -> int: ...

    @abc.abstractmethod
    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> _List[Event]: ...

    @abc.abstractmethod
    def _do_close(self) -> None: ...

    def _do_expire_tree(self, prefix: str, ttl: float) -> int:
        """Default: ``refresh`` each key ``list`` finds (one request each). Skipped, not counted: a key gone
        meanwhile, and one ``refresh`` finds to be no key of this protocol's (``CorruptEntryError``: ``delete`` it)."""
        count = 0
        for entry in self._do_list(prefix)[0]:
            try:
                self._do_refresh(entry.key, ttl)
            except (KeyNotFoundError, CorruptEntryError):
                continue
            count += 1
        return count

    def _do_take_ticket(self, key: str) -> int:
        """Default: ``add(key, 1)``; a backend without an atomic add overrides it (and ``_do_tickets``)."""
        return self._do_add(key, 1)

    def _do_tickets(self, key: str) -> int:
        entry = self._do_get(key)
        return 0 if entry is None else parse_counter(key, entry.value)

    def _do_ttl_remaining(self, key: str) -> float | None:
        """Optional (see :meth:`ttl_remaining`); backends that can tell override it."""
        raise NotImplementedError(f"{type(self).__name__} cannot report a key's remaining TTL")


def _check_revision(revision: int) -> int:
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
        raise InvalidArgumentError("expected_revision", revision, "a revision is an int >= 1")
    return revision


def watch_prefixes(key: str) -> list[str]:
    """Every prefix that selects ``key`` (see Prefixes): ``""`` and each ``"seg/.../"`` above it.

    For backends that index blocked watches by prefix: an event on ``key`` concerns
    exactly the watches registered under one of these (``len(key.split("/"))`` of them).
    """
    out = [""]
    start = 0
    while (slash := key.find("/", start)) != -1:
        start = slash + 1
        out.append(key[:start])
    return out


def parse_counter(key: str, raw: bytes) -> int:
    """Parse a value written by ``add`` (ASCII decimal); raise :class:`CorruptEntryError` if it is not one."""
    if not _COUNTER.fullmatch(raw):
        raise CorruptEntryError(f"value at {key!r} is not a decimal integer: {raw[:40]!r}", key)
    return int(raw)


#: Longest single ``watch`` call of :func:`wait_for_change` (seconds).
WATCH_SLICE = 60.0


def wait_for_change(kv: KVBackend, prefix: str, after_revision: int, deadline: float,
                    read_revision: int | None = None) -> bool:
    """Block until something under ``prefix`` changes after ``after_revision``, or ``deadline``.

    Args:
        deadline: absolute ``time.monotonic()`` value (``float("inf")``: no deadline).
        read_revision: the keyspace revision of the caller's read of ``prefix`` (``list``), if any:
            where the backend no longer has the events after ``after_revision`` (etcd v2 keeps
            1,000), the wait goes on from there instead of reporting lost history -- a caller
            that re-read and watched from the same old revision would spin. Callers pass an
            entry's revision as ``after_revision`` so that their watches can share one server watch.

    Returns:
        ``True`` if a change (or lost history, which callers treat the same way:
        re-read) was seen, ``False`` at the deadline.
    """
    from .errors import HistoryCompactedError

    while (remaining := deadline - time.monotonic()) > 0:
        try:
            # in slices: a deadline may be infinite (c10d's "no timeout"); no socket takes that
            if kv.watch(prefix, after_revision, min(remaining, WATCH_SLICE)):
                return True
        except HistoryCompactedError:
            if read_revision is None or read_revision <= after_revision:
                return True
            after_revision, read_revision = read_revision, None
    return False

