"""``rdzv_core.rendezvous``'s pieces without a backend: the round record, the key map, the decisions."""

from __future__ import annotations

import pytest

from rdzv_core import InvalidURLError, RendezvousStateError
from rdzv_core.kv import Entry
from rdzv_core.rendezvous import RoundRecord, RunKeys, Status
from rdzv_core.rendezvous.steps import Held, Step, next_step

KEY = "p/run_j/state/round"


def _entry(value: bytes) -> Entry:
    return Entry(KEY, value, 1)


@pytest.mark.parametrize("record", [
    RoundRecord(Status.SETUP),
    RoundRecord(Status.JOINABLE, 3, "abc"),
    RoundRecord(Status.JOINABLE, 3, "abc", last_call="host:1:ff"),
    RoundRecord(Status.FROZEN, 3, "abc", participants=2),
    RoundRecord(Status.FINAL, 1, None, participants=1),
])
def test_a_record_decodes_to_what_was_encoded(record: RoundRecord) -> None:
    assert RoundRecord.decode(_entry(record.encode())) == record


def test_records_are_stored_as_before() -> None:
    """The stored bytes: sorted JSON with only the fields a status has (agents of other versions read them)."""
    assert RoundRecord(Status.SETUP).encode() == b'{"status": "setup"}'
    assert RoundRecord(Status.FROZEN, 2, "ab", participants=4).encode() == \
        b'{"id": "ab", "participants": 4, "status": "frozen", "version": 2}'


@pytest.mark.parametrize("raw, names", [
    (b"x" * 5000, "5000 bytes"),
    (b"not json", "not JSON"),
    (b'{"status": "bogus"}', "no valid 'status'"),
    (b'{"status": "joinable", "version": true}', "'version' must be an int >= 1"),
    (b'{"status": "joinable", "version": 1, "id": "a/b"}', "'id' must be 1-64"),
    (b'{"status": "final", "version": 1}', "'participants' must be an int >= 1"),
])
def test_a_corrupt_record_is_a_state_error_naming_the_key(raw: bytes, names: str) -> None:
    with pytest.raises(RendezvousStateError, match=names) as info:
        RoundRecord.decode(_entry(raw))
    assert info.value.key == KEY


def test_run_keys() -> None:
    keys = RunKeys("torchelastic/p2p", "job")
    assert (keys.root, keys.round_record, keys.closed, keys.version_counter) == (
        "torchelastic/p2p/run_job", "torchelastic/p2p/run_job/state/round", "torchelastic/p2p/run_job/state/closed",
        "torchelastic/p2p/run_job/counter/version")
    assert keys.alive(2, "ab", 7) == "torchelastic/p2p/run_job/v_2.ab/alive/rank_7"
    assert keys.joined(2, None) == "torchelastic/p2p/run_job/v_2/joined"
    assert keys.store_prefix(2, "ab") == "torchelastic/p2p/run_job/store/v_2.ab/"
    assert keys.extra(2, "ab", "a/b") == "torchelastic/p2p/run_job/v_2.ab/extra/=a%2Fb"
    with pytest.raises(InvalidURLError):
        RunKeys("p", "../other")


@pytest.mark.parametrize("record, held, step", [
    (RoundRecord(Status.CLOSED), Held(1, "a", 1), Step.CLOSED),
    (RoundRecord(Status.JOINABLE, 1, "a"), None, Step.JOIN),
    (RoundRecord(Status.SETUP), None, Step.WAIT),
    (RoundRecord(Status.FROZEN, 1, "a", participants=2), None, Step.CHECK_FROZEN_STALL),
    (RoundRecord(Status.FROZEN, 1, "a", participants=2), Held(1, "a", 2), Step.RESUME),
    (RoundRecord(Status.FROZEN, 1, "a", participants=2), Held(1, "a", 3), Step.CHECK_FROZEN_STALL),  # froze before us
    (RoundRecord(Status.FROZEN, 1, "b", participants=2), Held(1, "a", 1), Step.CHECK_FROZEN_STALL),  # another round
    (RoundRecord(Status.FINAL, 1, "a", participants=2), Held(1, "a", 1), Step.WAIT_AS_LATE_NODE),  # not confirmed
    (RoundRecord(Status.FINAL, 1, "a", participants=2), Held(1, "a", 1, confirmed=True), Step.RESUME),
    (RoundRecord(Status.FINAL, 1, "a", participants=2), None, Step.WAIT_AS_LATE_NODE),
])
def test_next_step(record: RoundRecord, held: Held | None, step: Step) -> None:
    assert next_step(record, held, max_nodes=2, key=KEY) is step


def test_more_participants_than_max_nodes_is_a_state_error() -> None:
    with pytest.raises(RendezvousStateError, match="more than max_nodes=2") as info:
        next_step(RoundRecord(Status.FINAL, 1, "a", participants=3), None, max_nodes=2, key=KEY)
    assert info.value.key == KEY
