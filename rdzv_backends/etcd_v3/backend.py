"""The ``etcd-v3://`` backend: the KV protocol's operations on etcd's v3 API, one lease per key.

Compare-guarded writes are transactions; ``add`` is one transaction per attempt whose lost race answers the
current state; a ticket is the key's version after one plain ``Put``; a TTL is a lease of the key's own;
watches share one gRPC stream per endpoint (:mod:`.watch`); streams run on the process's stream loop (:mod:`.streams`).
``docs/backends/etcd-v3.md`` explains the leases, attempts, retries and their measured costs.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, NamedTuple

from rdzv_core.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    KeyExistsError,
    KeyNotFoundError,
    KVError,
    ValueTooLargeError,
)
from rdzv_core.kv import call_budget, Entry, Event, KVBackend, parse_counter

from .._concurrency import AddCombiner, RaceRetry, ReadCoalescer
from .._etcd.budget import AttemptDeadline, FailureBudget, Tries
from .._etcd.errors import compare_error, key_gone, may_have_applied
from .._etcd.settings import MAX_VALUE_BYTES, V3_CAPABILITIES, EtcdSettings, ttl_seconds
from .._etcd.probe import probe_http
from .._etcd.tls import check_tls
from .client import etcdrpc, grpc, transactions
from .keys import key_of, own_write, prefix_range, v3_key
from .transport import Endpoint, ServerError, Transport, put_request, range_request, txn_request
from .watch import StreamError, WatchStream

__all__ = ["EtcdV3Backend", "REFRESH_CONCURRENCY"]

log = logging.getLogger(__name__)

#: Refreshes (a Range and a message on the keep-alive stream each) one client runs at once; more wait their turn.
REFRESH_CONCURRENCY = 32
#: Counters whose last written state ``add`` remembers per backend object.
_COUNTER_CACHE = 1024


class Counter(NamedTuple):
    """A counter's state as this backend last saw it: value bytes, ``mod_revision``, lease ID (0: none)."""

    value: bytes
    revision: int
    lease: int


class EtcdV3Backend(KVBackend):
    """KV backend on etcd's v3 API (``docs/backends/etcd-v3.md`` has the mapping and the failure handling).

    Args:
        settings: endpoints, TLS, credentials and ``operation_timeout``.

    Raises:
        InvalidURLError: etcd rejected the user or password; a TLS file cannot
            be used, or the server's TLS handshake refuses it (see
            :func:`~rdzv_backends._etcd.tls.check_tls`); ``protocol=http`` to a
            server that speaks TLS, or an endpoint that is not etcd (see
            :func:`~rdzv_backends._etcd.probe.probe_http`).
        BackendConnectionError, BackendTimeoutError: no endpoint answered within
            ``operation_timeout`` seconds.
    """

    capabilities = V3_CAPABILITIES

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        opening = AttemptDeadline(settings.operation_timeout)
        answering = probe_http(settings, opening)  # a TLS-only etcd or not etcd at once: gRPC would retry
        check_tls(settings, opening)  # a wrong cacert or cert at once: gRPC retries its handshake until the deadline
        self._net = Transport(settings, self._check_open, lambda: self._closed)
        self._net.endpoints.prefer(answering)  # not a silent first endpoint again: the open's time is short
        self._min_ttl = 0  # etcd's minimum lease TTL (seconds), once a grant revealed it
        self._adds: AddCombiner[AttemptDeadline] = AddCombiner()
        self._reads = ReadCoalescer()
        self._counters: dict[str, Counter] = {}  # key -> state last written by add (see _add_once)
        self._refresh_slots = threading.BoundedSemaphore(REFRESH_CONCURRENCY)
        try:
            if settings.username is not None:
                self._net.authenticate(AttemptDeadline(settings.operation_timeout))
            self._net.call(lambda ep, t, md: ep.maintenance.Status(etcdrpc.StatusRequest(), timeout=t, metadata=md),
                           opening, what="status")
            self._net.open_streams()
        except BaseException:
            self._do_close()
            raise

    def __repr__(self) -> str:
        return f"EtcdV3Backend({self.settings.describe()!r})"

    def _deadline(self) -> AttemptDeadline:
        """One operation's deadline: ``operation_timeout``, or the caller's (``kv.call_deadline``) if sooner."""
        return AttemptDeadline(call_budget(self.settings.operation_timeout))

    def _txn(self, request: Any, deadline: AttemptDeadline, what: str, tries: Tries | None = None) -> Any:
        return self._net.call(lambda ep, t, md: ep.kv.Txn(request, timeout=t, metadata=md), deadline,
                              what=what, tries=tries)

    # -- leases --------------------------------------------------------------------
    def _grant(self, ttl: float | None, deadline: AttemptDeadline) -> int:
        """A new lease for ``ttl`` seconds (rounded up), or ``0`` for no TTL."""
        if ttl is None:
            return 0
        request = etcdrpc.LeaseGrantRequest(TTL=ttl_seconds(ttl))
        answer = self._net.call(lambda ep, t, md: ep.lease.LeaseGrant(request, timeout=t, metadata=md), deadline,
                                what="lease grant")
        if answer.error:
            raise KVError(f"etcd refused a lease of {ttl_seconds(ttl)} s: {answer.error}")
        if answer.TTL > request.TTL:  # etcd raised it to its minimum lease TTL
            self._min_ttl = int(answer.TTL)
        return int(answer.ID)

    def _revoke(self, lease: int, deadline: AttemptDeadline) -> None:
        """Revoke ``lease`` within ``deadline`` (at most 2 s; best effort: a lease without keys just runs out)."""
        if not lease:
            return
        request = etcdrpc.LeaseRevokeRequest(ID=lease)
        try:
            self._net.call(lambda ep, t, md: ep.lease.LeaseRevoke(request, timeout=t, metadata=md),
                           AttemptDeadline(min(2.0, deadline.remaining())), what="lease revoke")
        except (BackendUnavailableError, ServerError) as exc:
            log.debug("lease %x not revoked (it will run out): %s", lease, exc)

    def _keepalive(self, lease: int, deadline: AttemptDeadline) -> int:
        """Send one keep-alive for ``lease`` on the endpoint's keep-alive stream (:mod:`.lease_stream`); return
        its granted TTL (seconds), 0 if it is gone."""
        return self._net.call(lambda ep, t, md: ep.lease_stream(md).keep_alive(lease, t), deadline,
                              what="lease keep-alive")

    # -- reads -----------------------------------------------------------------------
    def _get_kv(self, key: str, deadline: AttemptDeadline) -> Any | None:
        request = range_request(v3_key(key))
        answer = self._net.call(lambda ep, t, md: ep.kv.Range(request, timeout=t, metadata=md), deadline,
                                what=f"get {key!r}")
        return answer.kvs[0] if answer.kvs else None

    def _do_get(self, key: str) -> Entry | None:
        deadline = self._deadline()
        kv = self._reads.read(("get", key), deadline, lambda: self._get_kv(key, deadline))
        return None if kv is None else Entry(key, bytes(kv.value), int(kv.mod_revision))

    def _do_ttl_remaining(self, key: str) -> float | None:
        """The remaining TTL of the key's lease (``LeaseTimeToLive``, whole seconds)."""
        deadline = self._deadline()
        kv = self._get_kv(key, deadline)
        if kv is None:
            raise key_gone(key)
        if not kv.lease:
            return None
        request = etcdrpc.LeaseTimeToLiveRequest(ID=int(kv.lease))
        answer = self._net.call(lambda ep, t, md: ep.lease.LeaseTimeToLive(request, timeout=t, metadata=md), deadline,
                                what="lease time-to-live")
        if int(answer.TTL) < 0:  # the lease ran out since the read
            raise KeyNotFoundError(f"key {key!r} not found (expired)", key)
        return float(answer.TTL)

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        start, end = prefix_range(prefix)
        request = range_request(start, end)
        deadline = self._deadline()
        answer = self._reads.read(("list", prefix), deadline, lambda: self._net.call(
            lambda ep, t, md: ep.kv.Range(request, timeout=t, metadata=md), deadline, what=f"list {prefix!r}"))
        entries = [Entry(key, bytes(kv.value), int(kv.mod_revision))
                   for kv in answer.kvs if (key := key_of(kv.key)) is not None]
        return entries, int(answer.header.revision)

    # -- writes ----------------------------------------------------------------------
    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        deadline = self._deadline()
        k = v3_key(key)
        answer, lease, tries = self._on_lease(ttl, deadline, key, value, lambda lease, tries: self._txn(
            txn_request(transactions.Version(k) == 0, put_request(k, value, lease), k), deadline,
            f"create {key!r}", tries))
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and not (kvs and tries.predates(int(kvs[0].create_revision))):
                if kvs and own_write(kvs[0], value, lease, tries, created=True):
                    return Entry(key, value, int(kvs[0].mod_revision))
                self._revoke(lease, deadline)
                raise may_have_applied(f"create({key!r})", key)
            self._revoke(lease, deadline)
            raise KeyExistsError(f"key {key!r} exists", key)
        return Entry(key, value, int(answer.header.revision))

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        deadline = self._deadline()

        def send(lease: int, _: Tries) -> Any:
            request = put_request(v3_key(key), value, lease)
            return self._net.call(lambda ep, t, md: ep.kv.Put(request, timeout=t, metadata=md), deadline,
                                  what=f"put {key!r}")

        answer, lease, _ = self._on_lease(ttl, deadline, key, value, send)
        self._revoke_replaced(answer.prev_kv, lease, deadline)
        return Entry(key, value, int(answer.header.revision))

    def _on_lease(self, ttl: float | None, deadline: AttemptDeadline, key: str, value: bytes,
                  send: Callable[[int, Tries], Any]) -> tuple[Any, int, Tries]:
        """``send(lease, tries)`` a write of ``value`` on a new lease for ``ttl`` (revoked if the write fails);
        return ``(answer, lease, tries)``.

        etcd refuses a write whose lease ran out before the write arrived ("requested lease not found":
        nothing written; a client slower than ``ttl`` between grant and write, seen with 1,024 clients on
        2 cores). Any key an earlier attempt wrote on that lease went with it, so the write is sent again
        on a new lease until ``deadline``.

        Raises:
            ValueTooLargeError: etcd refused the write as too large (nothing was written);
            whatever else ``send`` raised.
        """
        while True:
            lease, tries = self._grant(ttl, deadline), self._net.tries()
            try:
                return send(lease, tries), lease, tries
            except BaseException as exc:
                if lease and isinstance(exc, ServerError) and "lease not found" in exc.details \
                        and deadline.remaining() > 0:
                    log.debug("write of %r: lease %x ran out before the write arrived; a new lease", key, lease)
                    continue
                self._revoke(lease, deadline)
                _raise_if_too_large(exc, key, value)
                raise

    def _revoke_replaced(self, prev_kv: Any, new_lease: int, deadline: AttemptDeadline) -> None:
        """After a write replaced ``prev_kv``, revoke the lease it had (one lease per key)."""
        if prev_kv is not None and prev_kv.lease and prev_kv.lease != new_lease:
            self._revoke(int(prev_kv.lease), deadline)

    def _compare_failed(self, answer: Any, key: str, expected: int) -> KVError:
        kvs = answer.responses[0].response_range.kvs
        return compare_error(key, expected, int(kvs[0].mod_revision) if kvs else None, absent=not kvs)

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        deadline = self._deadline()
        k = v3_key(key)
        answer, lease, tries = self._on_lease(ttl, deadline, key, value, lambda lease, tries: self._txn(
            txn_request(transactions.Mod(k) == expected_revision, put_request(k, value, lease), k), deadline,
            f"compare_and_swap {key!r}", tries))
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and not (kvs and tries.predates(int(kvs[0].mod_revision))):
                if kvs and own_write(kvs[0], value, lease, tries):
                    return Entry(key, value, int(kvs[0].mod_revision))  # the replaced lease just runs out
                self._revoke(lease, deadline)
                raise may_have_applied(f"compare_and_swap({key!r})", key)
            self._revoke(lease, deadline)
            raise self._compare_failed(answer, key, expected_revision)
        self._revoke_replaced(answer.responses[0].response_put.prev_kv, lease, deadline)
        return Entry(key, value, int(answer.header.revision))

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        request = txn_request(
            transactions.Mod(v3_key(key)) == expected_revision,
            etcdrpc.DeleteRangeRequest(key=v3_key(key), prev_kv=True),
            v3_key(key),
        )
        deadline, tries = self._deadline(), self._net.tries()
        answer = self._txn(request, deadline, f"compare_and_delete {key!r}", tries)
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and not (kvs and tries.predates(int(kvs[0].mod_revision))):
                raise may_have_applied(f"compare_and_delete({key!r})", key)
            raise self._compare_failed(answer, key, expected_revision)
        for prev in answer.responses[0].response_delete_range.prev_kvs:
            self._revoke_replaced(prev, 0, deadline)

    def _do_delete(self, key: str) -> bool:
        request = etcdrpc.DeleteRangeRequest(key=v3_key(key), prev_kv=True)
        deadline = self._deadline()
        answer = self._net.call(lambda ep, t, md: ep.kv.DeleteRange(request, timeout=t, metadata=md),
                                deadline, what=f"delete {key!r}")
        for prev in answer.prev_kvs:
            self._revoke_replaced(prev, 0, deadline)
        return int(answer.deleted) > 0

    def _do_refresh(self, key: str, ttl: float) -> None:
        deadline = self._deadline()
        # Unbounded, 1,024 refreshes at once starved each other and keys lapsed (steady benchmark,
        # docs/benchmarks.md; measured while each keep-alive stream had gRPC threads of its own).
        if not self._refresh_slots.acquire(timeout=max(0.0, deadline.remaining())):
            raise BackendTimeoutError(f"refresh({key!r}): {REFRESH_CONCURRENCY} refreshes of this client in flight for "
                                 f"{self.settings.operation_timeout} s", key)
        try:
            self._refresh_once(key, ttl, deadline)
        finally:
            self._refresh_slots.release()

    def _refresh_once(self, key: str, ttl: float, deadline: AttemptDeadline) -> None:
        wanted = ttl_seconds(ttl)
        while True:
            kv = self._get_kv(key, deadline)
            if kv is None:
                raise key_gone(key)
            granted = self._keepalive(int(kv.lease), deadline) if kv.lease else 0
            if granted > 0 and granted == self._effective_ttl(wanted):
                return
            if granted <= 0 and kv.lease:
                # The lease ran out or was replaced between the read and the keep-alive: read again.
                current = self._get_kv(key, deadline)
                if current is None:
                    raise key_gone(key)
                if current.lease != kv.lease or current.mod_revision != kv.mod_revision:
                    if not deadline.backoff():
                        raise BackendTimeoutError(f"refresh({key!r}) lost every race", key)
                    continue
            # No lease, or a different TTL: re-put the same value on a lease of the asked TTL.
            if self._reput(key, kv, ttl, deadline):
                return
            if not deadline.backoff():
                raise BackendTimeoutError(f"refresh({key!r}) lost every race", key)

    def _effective_ttl(self, wanted: int) -> int:
        """The TTL a new lease of ``wanted`` seconds gets (etcd raises it to its minimum, once seen)."""
        return max(wanted, self._min_ttl)

    def _reput(self, key: str, kv: Any, ttl: float, deadline: AttemptDeadline) -> bool:
        """Put ``kv``'s value again on a new lease, if it is unchanged; ``False`` if it changed."""
        lease = self._grant(ttl, deadline)
        k = v3_key(key)
        request = txn_request(transactions.Mod(k) == int(kv.mod_revision), put_request(k, bytes(kv.value), lease), k)
        tries = self._net.tries()
        try:
            answer = self._txn(request, deadline, f"refresh {key!r}", tries)
        except BaseException:
            self._revoke(lease, deadline)
            raise
        if not answer.succeeded:
            kvs = answer.responses[0].response_range.kvs
            if tries.maybe_applied and kvs and kvs[0].lease == lease:
                return True  # an earlier attempt put the key on the new lease
            self._revoke(lease, deadline)
            if not answer.responses[0].response_range.kvs:
                raise key_gone(key)
            return False
        self._revoke_replaced(answer.responses[0].response_put.prev_kv, lease, deadline)
        return True

    def _do_add(self, key: str, delta: int) -> int:
        return self._adds.add(key, delta, self._deadline(), lambda total, dl: self._add_once(key, total, dl))

    def _add_once(self, key: str, delta: int, deadline: AttemptDeadline) -> int:
        """Add ``delta`` to ``key`` in one successful transaction; return the new value.

        Each attempt is ONE transaction ``if mod_revision(key) == R: put(value + delta)
        else: range(key)`` (``version == 0`` for an absent key): a lost race answers
        the key's current value and revision, which the next attempt uses at once
        (:class:`~rdzv_backends._concurrency.RaceRetry`). The first attempt assumes
        the state this backend last saw at ``key`` (absent if none), so an add to a
        counter nobody else touched since costs one round trip.

        Raises:
            CorruptEntryError: the value at ``key`` is not ASCII decimal (nothing written).
            BackendTimeoutError: every attempt lost a race until the operation deadline; or an
                attempt that may have been applied was followed by a lost race, so the add
                may or may not have taken effect (see ``Tries``; it is never applied twice).
        """
        k = v3_key(key)
        known = self._counters.get(key)
        race = RaceRetry(deadline)
        while True:
            if known is None:
                total, lease = delta, 0
                compare = transactions.Version(k) == 0
            else:
                total, lease = parse_counter(key, known.value) + delta, known.lease  # keeps its TTL (lease)
                compare = transactions.Mod(k) == known.revision
            value = str(total).encode("ascii")
            tries = self._net.tries()
            try:
                answer = self._txn(txn_request(compare, put_request(k, value, lease), k), deadline,
                                   f"add {key!r}", tries)
            except ServerError as exc:
                if "lease not found" not in exc.details:
                    raise
                current = None  # the key's lease ran out after we saw it: the key is gone with it
            else:
                if answer.succeeded:  # a success proves that no earlier attempt was applied (see Tries)
                    self._remember(key, Counter(value, int(answer.header.revision), lease))
                    return total
                kvs = answer.responses[0].response_range.kvs
                current = Counter(bytes(kvs[0].value), int(kvs[0].mod_revision), int(kvs[0].lease)) if kvs else None
            if tries.maybe_applied and (current is None or not tries.predates(current.revision)):
                self._counters.pop(key, None)
                raise may_have_applied(f"add({key!r})", key)  # adding again could count twice
            progressed, known = current != known, current
            self._counters.pop(key, None)  # only states this backend wrote are remembered (never corrupt ones)
            if not race.again(progressed):
                raise race.exhausted(f"add({key!r})", key, self.settings.operation_timeout)

    def _do_take_ticket(self, key: str) -> int:
        """One ``Put`` of an empty value (no lease): the ticket is the key's version it made (``prev_kv``'s + 1).

        etcd applies puts one after another, so concurrent callers get consecutive versions at one
        request each -- no compare-and-swap race (``add`` under 1,024 writers lost dozens in a row).
        An attempt that may have reached etcd is not sent again: that could take two tickets.

        Raises:
            BackendTimeoutError: no answer to an attempt that may have been applied (the ticket may be taken).
        """
        deadline, tries = self._deadline(), self._net.tries()
        request = put_request(v3_key(key), b"", 0)
        answer = self._net.call(lambda ep, t, md: ep.kv.Put(request, timeout=t, metadata=md), deadline,
                                what=f"take a ticket at {key!r}", tries=tries, resend=False)
        self._revoke_replaced(answer.prev_kv, 0, deadline)
        return int(answer.prev_kv.version) + 1  # an absent key: an empty prev_kv, version 0

    def _do_tickets(self, key: str) -> int:
        deadline = self._deadline()
        kv = self._reads.read(("get", key), deadline, lambda: self._get_kv(key, deadline))
        return 0 if kv is None else int(kv.version)

    def _remember(self, key: str, counter: Counter) -> None:
        """Note the state ``add`` wrote at ``key`` (a decimal value, so a later add never fails on
        a remembered state: only on one the server answered).

        Bounded; a stale entry costs one lost attempt, whose answer has the current state.
        """
        if len(self._counters) >= _COUNTER_CACHE:
            self._counters.clear()
        self._counters[key] = counter

    # -- watch -----------------------------------------------------------------------
    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        start, end = prefix_range(prefix)
        poll = AttemptDeadline(timeout)
        return self._net.call(
            lambda ep, t, md: self._watch_once(ep, start, end, after_revision, poll, md),
            FailureBudget(call_budget(self.settings.operation_timeout), poll), what=f"watch {prefix!r}",
        )

    def _watch_once(self, ep: Endpoint, start: bytes, end: bytes, after: int, poll: AttemptDeadline,
                    md: Any) -> list[Event]:
        """Wait on ``ep``'s shared watch stream until an event after ``after``, an error, or ``poll`` passes.

        Raises:
            StreamError: the stream failed (``_call`` retries); HistoryCompactedError, KVError: see the stream.
        """
        for _ in range(3):  # a stream that fails between being found and subscribed to is replaced
            with ep.stream_lock:
                stream = ep.stream
                if stream is None or stream.failure is not None or stream.retired or stream.metadata != md:
                    if stream is not None:
                        stream.retire()
                    stream = ep.stream = WatchStream(ep.streams().watch, ep.target, md)
            sub = stream.subscribe(start, end, after)
            if sub is not None:
                break
        else:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "the watch stream failed at once, thrice")
        try:
            # Exactly the call's timeout, no floor: a floor makes every short watch end at the same moment,
            # which defeats the rendezvous's jittered setup stagger.
            sub.woken.wait(max(poll.remaining(), 0.0))
        finally:
            stream.unsubscribe(sub)
        if sub.error is not None:
            raise sub.error
        return sub.events

    def _do_close(self) -> None:
        net = getattr(self, "_net", None)
        if net is not None:
            net.close()  # fails every watch stream: their callers raise BackendClosedError



def _raise_if_too_large(error: BaseException, key: str, value: bytes) -> None:
    """Raise :class:`ValueTooLargeError` if ``error`` is etcd refusing a write as too large (nothing was written).

    etcd answers ``request is too large`` above its ``--max-request-bytes``, and
    gRPC ``received message larger than max`` above that plus 512 KiB; the
    server's limit cannot be read through the API.
    """
    if isinstance(error, ServerError) and ("request is too large" in error.details
                                            or "larger than max" in error.details):
        raise ValueTooLargeError(
            f"etcd refused the value of {len(value)} bytes for key {key!r} as too large ({error.details}): this "
            f"backend accepts up to {MAX_VALUE_BYTES} bytes (max_value_bytes), but the server's "
            "--max-request-bytes may be configured lower; store smaller values or raise the server's limit", key
        ) from None
