"""The round record's reads and writes for :class:`~rdzv_core.rendezvous.machine.RoundMachine`.

:class:`RoundIO` holds the helpers every phase uses: read ``ROOT/state/``, compare-and-swap the record
from one status to the next, compare-and-delete it, the counters, and the run-tagged log line.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from ..errors import (
    CompareFailedError,
    CorruptEntryError,
    KeyExistsError,
    KeyNotFoundError,
    RendezvousClosedError,
    RendezvousStateError,
)
from ..kv import Entry, KVBackend
from .params import RoundResult
from .record import RoundRecord, RunKeys, Status
from .steps import DeadlinePassedError

__all__ = ["RoundIO", "closed_message", "delete_round_record", "has_state", "restore_round", "round_ended", "log"]

#: The rendezvous' logger (one name for the whole package).
log = logging.getLogger("rdzv_core.rendezvous")


def closed_message(run_id: str, incarnation: int, next_free: int | None = None) -> str:
    """The one-line message of a closed run, with the ways out: a new run id, ``rdzv reset URL`` (with the
    incarnation's query key when it is not 0) or a later incarnation: ``next_free`` (the first one with no state),
    else the next."""
    which = f" (incarnation {incarnation})" if incarnation else ""
    reset = "'rdzv reset URL'" + (f" (with incarnation={incarnation} in the URL)" if incarnation else "")
    later = incarnation + 1 if next_free is None else next_free
    return (f"run {run_id}{which} is closed: its job ended and a closed run forms no new rounds; start the job with "
            f"a new run id, delete this run's state with {reset} to use the id again, or (a job restarted by a "
            f"scheduler) give it an incarnation not used yet: incarnation={later}")


#: Later incarnations a closed run's error looks at for one not used yet (a read of a small directory each).
FREE_INCARNATION_PROBES = 8


def has_state(kv: KVBackend, keys: RunKeys) -> bool:
    """Whether the run of ``keys`` (one incarnation) has anything under ``ROOT/state/``: a round record, a closed
    mark or a configuration.

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
    """
    return bool(kv.list(keys.state_dir)[0])


def delete_round_record(kv: KVBackend, keys: RunKeys, revision: int) -> bool:
    """Compare-and-delete the run's round record at ``revision``: whether this call deleted it (``False``:
    the record changed or went first).

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
    """
    try:
        kv.compare_and_delete(keys.round_record, revision)
    except (CompareFailedError, KeyNotFoundError):
        return False
    return True


def restore_round(kv: KVBackend, keys: RunKeys, final: RoundRecord, recreate: bool = True) -> str | None:
    """Re-establish the final round ``final`` where the backend lost it, never over a decision of the others.

    * The record is that final round: ``"standing"``.
    * The record is that round, frozen with the same members: a failover lost the final compare-and-swap;
      it is made final again: ``"repaired"``.
    * No record, and the run's version counter is absent or behind the round's version: the backend lost
      the run's keys (restarted empty, failed over to a replica that lost them). The record is written
      again (create: if absent) and the counter raised to the version: ``"restored"``.
    * Otherwise -- the run is closed, another round's record is live, or no record while the counter
      reached the version (the round was destroyed: the others re-form) -- ``None``: the round is over.

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
        RendezvousStateError: the round record is corrupt.
    """
    for _ in range(8):  # each pass loses a race only to a write that settles the question
        if kv.get(keys.closed) is not None:
            return None
        entry = kv.get(keys.round_record)
        if entry is not None:
            record = RoundRecord.decode(entry)
            if not record.is_round(final.version, final.id):
                return None
            if record.status is Status.FINAL:
                return "standing"
            if record.status is not Status.FROZEN or record.participants != final.participants:
                return None
            try:
                kv.compare_and_swap(keys.round_record, final.encode(), entry.revision)
                return "repaired"
            except (CompareFailedError, KeyNotFoundError):
                continue
        counter = kv.get(keys.version_counter)
        try:
            reached = counter is not None and int(counter.value) >= final.version
        except ValueError:
            return None  # a corrupt counter: not ours to repair (the state machine reports it)
        if reached and kv.get(keys.round_record) is not None:
            continue  # restored meanwhile by another member (it creates the record before it raises the counter)
        if reached or not recreate:
            return None
        try:
            kv.create(keys.round_record, final.encode())
        except KeyExistsError:
            continue
        _raise_counter(kv, keys.version_counter, final.version)
        return "restored"
    return None


def round_ended(kv: KVBackend, keys: RunKeys, version: int, rid: str | None) -> bool:
    """Whether round ``(version, rid)`` is over and the run goes on: another round's record is live (also one
    set up between the reads: a node that destroyed the round sets up the next one at once), or there is no
    record while the version counter reached ``version`` (the round was destroyed: a destroy never lowers the
    counter). ``False`` while the run is closed, the record is the round's, or the backend lost it (no
    record, the counter absent or behind: :func:`restore_round`).

    Raises:
        BackendUnavailableError, BackendClosedError: from ``kv``.
        RendezvousStateError: the round record is corrupt.
    """
    if kv.get(keys.closed) is not None:
        return False
    entry = kv.get(keys.round_record)
    if entry is not None:
        return not RoundRecord.decode(entry).is_round(version, rid)
    counter = kv.get(keys.version_counter)
    try:
        reached = counter is not None and int(counter.value) >= version
    except ValueError:
        return False
    # A member that restores a lost record creates it before it raises the counter: read the record again.
    # Found now, it is that restored round's, or another round's (the next one, set up since the first read).
    entry = kv.get(keys.round_record)
    if entry is not None:
        return not RoundRecord.decode(entry).is_round(version, rid)
    return reached


def _raise_counter(kv: KVBackend, key: str, version: int) -> None:
    """Set the counter at ``key`` to at least ``version`` (never lower it; absent counts as 0). Each lost race
    means another writer moved the counter; after 8 the counter is left to them (a new round's ``add``)."""
    for _ in range(8):
        entry = kv.get(key)
        try:
            if entry is None:
                kv.create(key, str(version).encode())
            elif int(entry.value) < version:
                kv.compare_and_swap(key, str(version).encode(), entry.revision)
            return
        except (KeyExistsError, CompareFailedError, KeyNotFoundError):
            continue
        except ValueError:
            return


class RoundIO:
    """Reads and writes of one run's round record and counters over ``kv`` (see the module)."""

    kv: KVBackend
    keys: RunKeys
    run_id: str
    current: RoundResult | None

    def closed_error(self) -> RendezvousClosedError:
        """The error for this run being closed; its way out names the first later incarnation with no state
        (of :data:`FREE_INCARNATION_PROBES`; else the one after them).

        Raises:
            BackendUnavailableError, BackendClosedError: from ``kv``.
        """
        first = self.keys.incarnation + 1
        free = first + FREE_INCARNATION_PROBES
        for incarnation in range(first, first + FREE_INCARNATION_PROBES):
            if not has_state(self.kv, dataclasses.replace(self.keys, incarnation=incarnation)):
                free = incarnation
                break
        return RendezvousClosedError(closed_message(self.run_id, self.keys.incarnation, free))

    def _read_state(self) -> tuple[Entry | None, RoundRecord | None]:
        """One read of ``ROOT/state/``: the round record, or ``RoundRecord(Status.CLOSED)`` for a closed run.

        Raises:
            RendezvousStateError: the record is corrupt (:meth:`RoundRecord.decode`).
        """
        entry, record, _ = self._read_state_at()
        return entry, record

    def _read_state_at(self) -> tuple[Entry | None, RoundRecord | None, int]:
        """:meth:`_read_state` and the keyspace revision of the read (int): waits watch from the record's
        own revision (so waiting nodes share one server watch) and go on from the read's where the
        backend's history no longer reaches back that far (etcd v2 keeps 1,000 events: the wait spun)."""
        entries, revision = self.kv.list(self.keys.state_dir)
        found = {e.key: e for e in entries}
        closed = found.get(self.keys.closed)
        if closed is not None:
            return closed, RoundRecord(Status.CLOSED), revision
        entry = found.get(self.keys.round_record)
        if entry is None:
            return None, None, revision
        return entry, RoundRecord.decode(entry), revision

    def _transition(self, version: int, rid: str | None, source: Status,
                    target: Callable[[RoundRecord], RoundRecord], deadline: float,
                    ttl: float | None = None,
                    current: tuple[Entry | None, RoundRecord | None] | None = None) -> Entry | None:
        """Compare-and-swap the record of round ``(version, rid)`` from status ``source`` to
        ``target(record)`` (with ``ttl`` seconds, or none), re-reading after every lost race; ``current``:
        the caller's own :meth:`_read_state`, used for the first attempt instead of reading again.

        Returns:
            the new entry; ``None`` if the record left ``source`` (or is another round's) first.

        Raises:
            DeadlinePassedError: ``deadline`` (``time.monotonic()``) passed first.
        """
        while time.monotonic() < deadline:
            entry, record = current if current is not None else self._read_state()
            current = None
            if entry is None or record is None or record.status is not source or not record.is_round(version, rid):
                return None
            try:
                return self.kv.compare_and_swap(self.keys.round_record, target(record).encode(), entry.revision,
                                                ttl=ttl)
            except (CompareFailedError, KeyNotFoundError):
                continue
        raise DeadlinePassedError()

    def _destroy(self, entry: Entry, reason: str) -> bool:
        """Compare-and-delete the round record at ``entry``'s revision.

        Returns:
            ``True`` if this call deleted it; ``False`` if the record had changed or gone first.
        """
        if not delete_round_record(self.kv, self.keys, entry.revision):
            return False
        self._log(logging.INFO, "destroyed the round: %s", reason)
        return True

    def _tickets(self, key: str) -> int:
        """How many tickets were taken at ``key`` (:meth:`~rdzv_core.kv.KVBackend.tickets`); a corrupt
        counter is a :class:`RendezvousStateError`."""
        return self._corrupt_is_state_error(key, self.kv.tickets)

    def _take_ticket(self, key: str) -> int:
        """``kv.take_ticket(key)``: join tickets, confirmations, waiting spares (no compare-and-swap race)."""
        return self._corrupt_is_state_error(key, self.kv.take_ticket)

    def _add(self, key: str) -> int:
        """``kv.add(key, 1)`` (the version counter: one writer per round)."""
        return self._corrupt_is_state_error(key, lambda k: self.kv.add(k, 1))

    @staticmethod
    def _corrupt_is_state_error(key: str, call: Callable[[str], int]) -> int:
        try:
            return call(key)
        except CorruptEntryError as exc:
            raise RendezvousStateError(f"counter at {key!r} is corrupt: {exc}; reset the run's state", key) from None

    def _log(self, level: int, msg: str, *args: Any, version: int | None = None) -> None:
        """Log ``msg`` prefixed with ``run=RUN_ID version=V rank=R`` (``-`` where unknown); the same
        values go into the record's ``extra`` as ``rdzv_run_id``, ``rdzv_version``, ``rdzv_rank``."""
        if not log.isEnabledFor(level):
            return
        current = self.current
        if version is None and current is not None:
            version = current.version
        rank = current.rank if current is not None and current.version == version else None
        extra = {"rdzv_run_id": self.run_id, "rdzv_version": version, "rdzv_rank": rank}
        log.log(level, "run=%s version=%s rank=%s: " + msg,
                self.run_id, "-" if version is None else version, "-" if rank is None else rank, *args, extra=extra)
