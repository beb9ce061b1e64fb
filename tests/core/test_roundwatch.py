"""``rdzv_core.rendezvous.roundwatch``: the members of a round in one process share one watch thread."""

from __future__ import annotations

import threading
import time
import uuid

from rdzv_core import Rendezvous, RendezvousParams, open_backend
from rdzv_core.rendezvous import roundwatch


def _next_rounds(members: list[Rendezvous]) -> list:
    """Each member's ``next_round()``, run at once on threads of their own (20 s each at most; ``None``
    for one that did not return)."""
    results: list = [None] * len(members)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, members[i].next_round()))
               for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(roundwatch.THREAD_PREFIX)]


def test_members_in_one_process_share_one_watch_and_the_last_one_out_stops_it() -> None:
    name = f"rw{uuid.uuid4().hex[:8]}"
    clients = [open_backend(f"memory://{name}/") for _ in range(3)]
    params = RendezvousParams(min_nodes=3, max_nodes=3, keep_alive_ttl=1.0, timeout=20)
    members = [Rendezvous(kv, "job", params) for kv in clients]
    try:
        results = _next_rounds(members)
        version = results[0].version
        ours = {k: v for k, v in roundwatch.watched_rounds().items() if k[0].startswith(members[0].keys.tree)}
        assert list(ours.values()) == [3] and next(iter(ours))[1] == version
        assert len([t for t in _watch_threads() if t.name.endswith(f"v{version}")]) == 1
        clients[0].close()  # the client the watch may be using: the watch goes on with another one's
        members[1].leave()
        deadline = time.monotonic() + 10
        while members[2].num_nodes_waiting() < 1:  # the remaining member's watch destroyed the round
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for m in (members[0], members[2]):
            m.leave()
        assert not any(k[0].startswith(members[0].keys.tree) for k in roundwatch.watched_rounds())
    finally:
        for kv in clients:
            kv.close()


def test_a_stopped_watch_never_destroys_the_round() -> None:
    """The last subscriber left (its member deletes its key next): a watch that lists only after that
    delete must not take it for a lapse. CI saw ``rdzv status`` find the round of a member that had just
    left destroyed by that member's own watch (its thread had not made its first look yet)."""
    kv = open_backend(f"memory://rw{uuid.uuid4().hex[:8]}/")
    member = Rendezvous(kv, "job", RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    try:
        member.next_round()
        watched = member._watched
        assert watched is not None
        watch = roundwatch._RoundWatch(watched)  # not started: we make its first look by hand, late
        watch.subscribers[member] = kv
        member.leave()  # unsubscribes, then deletes its keep-alive key
        watch.stopped.set()  # what unsubscribe does to the watch of the last subscriber
        assert watch._check(kv) is None
        assert kv.get(watched.keys.round_record) is not None  # the final record is still there
    finally:
        kv.close()


class _Unwatched(Rendezvous):
    """A member without the round watch: only its own keep-alive can notice that its key lapsed (as when the
    backend was away from every member longer than the TTL and the keep-alive is the first to look after it)."""

    def _watch_round(self, result) -> None:
        self._watched = roundwatch.WatchedRound(self.keys, result.version, result.round_id, result.world_size,
                                                self.params.keep_alive_ttl, self._final_ranks)


def test_a_member_whose_own_key_vanished_writes_it_again_and_its_round_goes_on() -> None:
    """The key of a member of a final round disappears unseen (no watch runs) while the round record stands:
    nobody ended the round, so its keep-alive writes the key again at the next refresh and the round goes on
    (the same version and id, final, every key back); neither member is told to re-rendezvous."""
    kv = open_backend(f"memory://rw{uuid.uuid4().hex[:8]}/")
    params = RendezvousParams(min_nodes=2, keep_alive_ttl=0.6, last_call_timeout=0.1, timeout=20)
    members = [_Unwatched(kv, "job", params) for _ in range(2)]
    try:
        results = _next_rounds(members)
        assert [r.world_size for r in results] == [2, 2]
        lapsed = members[0]._alive_key
        assert lapsed is not None and kv.get(lapsed) is not None
        kv.delete(lapsed)  # as an expiry while nobody could see it
        keepalive = members[0]._keepalive
        assert keepalive is not None
        deadline = time.monotonic() + 5 * params.keep_alive_ttl
        while keepalive.recreated < 1:
            assert time.monotonic() < deadline, "the keep-alive never wrote the lost key again"
            assert all(m.num_nodes_waiting() == 0 for m in members)
            time.sleep(0.02)
        assert kv.get(lapsed) is not None
        assert all(m.num_nodes_waiting() == 0 for m in members)
        assert members[0].describe()["status"] == "final" and members[0].describe()["version"] == results[0].version
    finally:
        for m in members:
            m.leave()
        kv.close()


def test_keys_deleted_while_the_backend_answers_are_not_brought_back() -> None:
    """Every key of the run deleted while the backend answered all along (an operator's ``rdzv reset``): no
    member's keep-alive saw an outage, so nobody re-establishes the round; the members are told it is gone.
    (After an outage the same loss is repaired: ``conformance_tests/test_outages.py``.)"""
    kv = open_backend(f"memory://rw{uuid.uuid4().hex[:8]}/")
    params = RendezvousParams(min_nodes=2, keep_alive_ttl=0.6, last_call_timeout=0.1, timeout=20)
    members = [_Unwatched(kv, "job", params) for _ in range(2)]
    try:
        _next_rounds(members)
        keys = members[0].keys
        for entry in kv.list(keys.tree)[0]:
            kv.delete(entry.key)
        assert all(m.num_nodes_waiting() >= 1 for m in members)
        assert kv.get(keys.round_record) is None
    finally:
        for m in members:
            m.leave()
        kv.close()
