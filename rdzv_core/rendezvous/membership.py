"""A member's side of a final round: its keep-alive key, its round watch, and its recovery after an outage.

:class:`Membership` is the part of :class:`~rdzv_core.rendezvous.machine.RoundMachine` that runs while
the node is a member: it keeps the member's key alive (:class:`~rdzv_core.rendezvous.keepalive.KeepAlive`),
subscribes to the round's lapse watch (:mod:`rdzv_core.rendezvous.roundwatch`) with the keep-alive's evidence of
the backend's answers, and re-establishes the round where the backend lost it (``docs/design.md``,
"The backend away").
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import roundwatch
from ..errors import BackendClosedError, BackendUnavailableError, RendezvousStateError
from .keepalive import KeepAlive
from ..outage import Responsiveness
from .params import RendezvousParams, RoundResult
from .record import REJOINED, REJOINING, encode_json, round_segment
from .runconfig import record_run_config
from .state_io import RoundIO, restore_round

__all__ = ["Membership"]


class Membership(RoundIO):
    """Keep-alive, lapse watch and outage recovery of this node's membership (see the module)."""

    params: RendezvousParams
    on_keepalive: Callable[[BaseException | None], object] | None
    _keepalive: KeepAlive | None
    _alive_key: str | None
    _alive_info: dict[str, Any]
    _final_ranks: str | None
    _evidence: Responsiveness | None
    _watched: roundwatch.WatchedRound | None
    #: The keep-alive key of the round this member left to re-join (``next_round``), or ``None``.
    _rejoining: tuple[str, dict[str, Any]] | None = None

    def _watch_round(self, result: RoundResult) -> None:
        """Subscribe to the lapse watch of the round ``result`` (see :mod:`rdzv_core.rendezvous.roundwatch`)."""
        self._unwatch_round()
        self._watched = roundwatch.WatchedRound(self.keys, result.version, result.round_id, result.world_size,
                                                self.params.keep_alive_ttl, self._final_ranks)
        self._rejoining = None
        roundwatch.subscribe(self, self.kv, self._watched, self._answering_since, on_end=self._round_ended)

    def _answering_since(self) -> float:
        """Since when (monotonic) this member's keep-alive saw the backend answer without a break."""
        evidence = self._evidence
        return evidence.since if evidence is not None else time.monotonic()

    def _round_ended(self, watched: roundwatch.WatchedRound) -> None:
        """Round ``watched`` is over (the others re-form; its lapse watch says so): mark this member's key
        re-joining at once, before its agent notices, so the next round keeps it a place
        (``docs/design.md``, "Admission order"). On the watch's thread; backend errors are logged."""
        key = self._alive_key
        if self._watched != watched or key is None or REJOINING in self._alive_info:
            return
        try:
            self._alive_info = self._mark_key(key, self._alive_info, {REJOINING: round(time.time(), 3)})
        except (BackendUnavailableError, BackendClosedError) as exc:
            self._log(logging.WARNING, "could not mark this member re-joining: %s", exc, version=watched.version)

    def _mark_key(self, key: str, info: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
        """Write this member's keep-alive ``key`` (record ``info``) again with ``changes`` and its TTL; the
        new record. The keep-alive of ``key``, if it runs, writes the new record if it lapses."""
        info = {**info, **changes}
        if self._keepalive is not None and self._alive_key == key:
            self._keepalive.value = encode_json(info)
        self.kv.put(key, encode_json(info), ttl=self.params.keep_alive_ttl)
        return info

    def _leave_to_rejoin(self) -> None:
        """``next_round`` leaves this member's round: its key is marked re-joining and left to lapse (not
        deleted), and :meth:`_mark_rejoined` marks the round it takes a ticket in. Backend errors are logged."""
        key, info = self._alive_key, self._alive_info
        self._stop_keepalive(delete=False)
        self._rejoining = None if key is None else (key, info)
        if key is None or REJOINING in info:
            return
        try:
            self._rejoining = (key, self._mark_key(key, info, {REJOINING: round(time.time(), 3)}))
        except (BackendUnavailableError, BackendClosedError) as exc:
            self._log(logging.WARNING, "could not mark the keep-alive key re-joining (it lapses): %s", exc)

    def withdraw(self) -> None:
        """This node will not take part in the next round (the gate keeps it out): leave the current round and
        delete the key it left re-joining, so nobody waits for it. Backend errors are logged (the key lapses)."""
        self._stop_keepalive(delete=True)
        rejoining, self._rejoining = self._rejoining, None
        if rejoining is None:
            return
        try:
            self.kv.delete(rejoining[0])
        except (BackendUnavailableError, BackendClosedError) as exc:
            self._log(logging.WARNING, "could not withdraw the re-joining keep-alive key (it lapses): %s", exc)

    def _mark_rejoined(self, version: int, rid: str | None) -> None:
        """This re-joining member took a ticket in round ``(version, rid)``: say so in its old key, so the
        nodes queued for a place there stop counting it as expected. Backend errors are logged."""
        if self._rejoining is None:
            return
        key, info = self._rejoining
        try:
            self._mark_key(key, info, {REJOINED: round_segment(version, rid)})
        except (BackendUnavailableError, BackendClosedError) as exc:
            self._log(logging.WARNING, "could not mark the old keep-alive key re-joined: %s", exc, version=version)

    def _unwatch_round(self) -> None:
        if self._watched is not None:
            roundwatch.unsubscribe(self, self._watched)
            self._watched = None

    def _start_keepalive(self, key: str, info: dict[str, Any], name: str) -> KeepAlive:
        """Keep this member's key ``key`` (value ``info``) alive; a lapse of it calls :meth:`_own_key_lapsed`."""
        keepalive = KeepAlive(self.kv, key, self.params.keep_alive_ttl, value=encode_json(info), name=name,
                              on_refresh=self.on_keepalive, on_lapse=lambda: self._own_key_lapsed(key))
        self._evidence = keepalive.responsiveness
        return keepalive

    def _own_key_lapsed(self, key: str) -> None:
        """This member's keep-alive ``key`` was found gone (the backend lost it, or this node was away longer
        than ``keep_alive_ttl``); it is written again next. If it is a key of this node's final round,
        re-establish the round where the backend lost it (:meth:`_restore_round`); where the others ended it,
        ``num_nodes_waiting`` tells the agent. On a refresh thread."""
        watched = self._watched
        if watched is None or not key.startswith(watched.alive_prefix):
            return  # not final yet (the key is written again and the round goes on), or another round
        self._restore_round()

    def _restore_round(self, quiet: bool = True) -> bool:
        """Re-establish this member's final round if the backend lost its record
        (:func:`~.state_io.restore_round`): whether the round stands. A lost record is written again only
        after an outage this member's keep-alive saw within the last ``4/3 x keep_alive_ttl`` (a failed or
        stalled refresh). With ``quiet``, backend errors are logged and give ``False``; else they are raised.

        Raises:
            BackendUnavailableError, BackendClosedError, RendezvousStateError: not ``quiet``, from the backend.
        """
        watched = self._watched
        if watched is None:
            return False
        evidence = self._evidence
        # Keys that vanish while the backend answers all along were deleted on purpose (rdzv reset): a lost
        # record is written again only after an outage this member saw; a final round found frozen again
        # (nobody ever makes a final round frozen) is repaired always.
        away = evidence is None or time.monotonic() - evidence.last_break <= self.params.keep_alive_ttl * 4 / 3
        try:
            done = restore_round(self.kv, self.keys, watched.record, recreate=away)
            if done == "restored":  # the run's keys were lost: its configuration too (this member's matched it)
                record_run_config(self.kv, self.keys, self.params)
        except (BackendUnavailableError, BackendClosedError, RendezvousStateError) as exc:
            if not quiet:
                raise
            self._log(logging.WARNING, "could not check this node's round after a lapse: %s", exc,
                      version=watched.version)
            return False
        if done in ("restored", "repaired"):
            self._log(logging.WARNING, "the backend lost this round's %s (restarted empty or failed over?): "
                      "re-established it, same members and ranks", "record" if done == "restored" else
                      "final state", version=watched.version)
        return done is not None

    def _stop_keepalive(self, delete: bool, forget: bool = True) -> None:
        if self._keepalive is not None:
            self._keepalive.stop()
            self._keepalive = None
        if delete and self._alive_key is not None:
            try:
                self.kv.delete(self._alive_key)
            except (BackendUnavailableError, BackendClosedError) as exc:
                self._log(logging.WARNING, "could not delete the keep-alive key (it will lapse): %s", exc)
        if forget:
            self._alive_key = None
            self._alive_info = {}
