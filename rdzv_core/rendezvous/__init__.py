"""The rendezvous state machine, written once against the KV protocol (after torchelastic's ``EtcdRendezvous``).

Modules: :mod:`.record` (the round record :class:`RoundRecord`, its :class:`Status`, the run's
key map :class:`RunKeys`), :mod:`.params` (:class:`RendezvousParams`, :class:`RoundResult`,
:class:`Progress`), :mod:`.runconfig` (the run's configuration: the settings every node must share),
:mod:`.steps` (the decisions, apart from I/O), :mod:`.machine` (the phases
of a round and their I/O), :mod:`.node` (:class:`Rendezvous`, the public API), :mod:`.keepalive`
(the keep-alive scheduler), :mod:`.roundwatch` (lapse detection for final rounds), :mod:`.membership`
(a member's keep-alive, round watch and outage recovery), :mod:`.progress_keys` (the workers' progress
in the backend). The states, keys and design are described in ``docs/design.md``.
"""

from __future__ import annotations

from .params import MIN_KEEP_ALIVE_TTL, Progress, RendezvousParams, RoundResult
from .record import MAX_STATE_BYTES, RoundRecord, RunKeys, Status, round_segment
from .machine import SETUP_STAGGER, SPARE_LOG_EVERY
from .node import Rendezvous
from .state_io import has_state

__all__ = ["RendezvousParams", "Rendezvous", "RoundResult", "Progress", "round_segment", "RoundRecord", "RunKeys",
           "Status", "MAX_STATE_BYTES", "MIN_KEEP_ALIVE_TTL", "SETUP_STAGGER", "SPARE_LOG_EVERY", "has_state"]
