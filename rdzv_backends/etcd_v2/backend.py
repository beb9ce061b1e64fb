"""The ``etcd-v2://`` backend: the KV protocol's operations on etcd's v2 API.

Writes are compare-guarded where the protocol asks (``prevExist``, ``prevIndex``); ``add`` is a
compare-and-swap loop on ``prevIndex`` and ``prevValue`` whose lost races carry the current state; a ticket
is an in-order key (``POST``) in the key's directory; a watch is a long poll. ``docs/backends/etcd-v2.md``
explains the attempts, retries and what they cost.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from typing import Any

from rdzv_core.errors import (
    BackendClosedError,
    BackendTimeoutError,
    BackendUnavailableError,
    CorruptEntryError,
    HistoryCompactedError,
    KeyExistsError,
    KeyNotFoundError,
)
from rdzv_core.kv import call_budget, Entry, Event, KVBackend, parse_counter

from .._concurrency import AddCombiner, RaceRetry
from .._etcd.budget import AttemptDeadline, FailureBudget, Tries
from .._etcd.errors import key_gone, may_have_applied
from .._etcd.settings import V2_CAPABILITIES, EtcdSettings, ttl_seconds
from .._etcd.probe import probe_http
from .._etcd.tls import check_tls
from .mapping import (
    COMPARE_FAILED,
    INDEX_CLEARED,
    KEY_NOT_FOUND,
    NODE_EXISTS,
    NOT_DIR,
    NOT_FILE,
    Answer,
    Counter,
    after_compare_failed,
    b64,
    compare_answer_error,
    current_index,
    decode,
    dir_error,
    dir_path,
    key_of,
    node_key,
    node_path,
    node_segments,
    nodes,
    own_write,
    ticket_nodes,
    to_entry,
    unexpected,
    value_params,
    watch_event,
)
from .transport import POOL_CONNECTIONS, Transport

__all__ = ["EtcdV2Backend", "POOL_CONNECTIONS"]

log = logging.getLogger(__name__)

#: Counters whose last written state ``add`` remembers per backend object.
_COUNTER_CACHE = 1024
#: Keys written with a TTL whose last answered ``modifiedIndex`` ``refresh`` remembers per backend object.
_INDEX_CACHE = 65536
#: Every read is linearizable: ``quorum=true`` makes the member confirm it through raft, so a member cut off
#: from its peers (or not caught up after a partition) fails the read instead of answering from its own,
#: possibly old, copy (etcd's v2 API, "Read Consistency"; v3 ranges are linearizable by default).
QUORUM = {"quorum": "true"}


class EtcdV2Backend(KVBackend):
    """KV backend on etcd's v2 API (the mapping: :mod:`.mapping`, ``docs/backends/etcd-v2.md``).

    Args:
        settings: endpoints, TLS, credentials and ``operation_timeout``.

    Raises:
        InvalidURLError: the server does not serve the v2 API (started without
            ``--enable-v2``), or rejected the credentials; the URL names a user
            without a password; a TLS file cannot be used, or the server's TLS
            handshake refuses it (see :func:`~rdzv_backends._etcd.tls.check_tls`);
            ``protocol=http`` to a server that speaks TLS, or an endpoint that is
            not etcd (see :func:`~rdzv_backends._etcd.probe.probe_http`).
        KVError: the installed ``python-etcd`` lacks ``Client.api_execute.__wrapped__``.
        BackendConnectionError, BackendTimeoutError: no endpoint answered within
            ``operation_timeout`` seconds.
    """

    capabilities = V2_CAPABILITIES

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._net = Transport(settings, self._check_open, lambda: self._closed)
        self._adds: AddCombiner[AttemptDeadline] = AddCombiner()
        self._counters: dict[str, Counter] = {}  # key -> state last written by add (see _add_once)
        self._indexes: dict[str, int] = {}  # key -> modifiedIndex of its last TTL write seen (see _do_refresh)
        try:
            opening = AttemptDeadline(settings.operation_timeout)
            answering = probe_http(settings, opening)  # a TLS-only etcd or a server that is not etcd at once
            self._net.endpoints.prefer(answering)  # not a silent first endpoint again: the open's time is short
            check_tls(settings, opening)  # names a wrong cacert or cert (urllib3's error would not)
            self._net.probe(opening)
        except BaseException:
            self._do_close()
            raise

    def __repr__(self) -> str:
        return f"EtcdV2Backend({self.settings.describe()!r})"

    def _deadline(self) -> AttemptDeadline:
        """One operation's deadline: ``operation_timeout``, or the caller's (``kv.call_deadline``) if sooner."""
        return AttemptDeadline(call_budget(self.settings.operation_timeout))

    # -- reads -------------------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        answer = self._net.call("GET", node_path(key), dict(QUORUM), self._deadline())
        if not answer.ok:
            if answer.code in (KEY_NOT_FOUND, NOT_DIR):
                return None
            raise unexpected(answer, key)
        return to_entry(key, answer.body["node"])

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        answer = self._net.call("GET", dir_path(prefix), {"recursive": "true", **QUORUM}, self._deadline())
        if not answer.ok:
            if answer.code in (KEY_NOT_FOUND, NOT_DIR):
                return [], answer.etcd_index
            raise unexpected(answer, prefix)
        entries = []
        for node in nodes(answer.body["node"]):
            key = key_of(node.get("key", ""))
            if key is not None and key.startswith(prefix):
                entries.append(to_entry(key, node))
        return sorted(entries, key=lambda e: e.key), answer.etcd_index

    def _do_ttl_remaining(self, key: str) -> float | None:
        """The node's ``ttl``: the server's remaining whole seconds (rounded up)."""
        node = self._read_node(key, self._deadline())
        if node is None:
            raise key_gone(key)
        if node.get("dir"):
            raise dir_error(key)
        ttl = node.get("ttl")
        return None if ttl is None else float(max(0, int(ttl)))

    # -- writes ------------------------------------------------------------------
    def _write(self, key: str, params: dict[str, str], deadline: AttemptDeadline, tries: Tries | None = None) -> Answer:
        answer = self._net.call("PUT", node_path(key), params, deadline, tries)
        if answer.code in (NOT_FILE, NOT_DIR):
            raise unexpected(answer, key)
        if answer.ok and "ttl" in params:
            self._note_index(key, int(answer.body["node"]["modifiedIndex"]))
        return answer

    def _note_index(self, key: str, index: int | None) -> None:
        """Remember ``key``'s ``modifiedIndex`` for its next refresh (``None``: forget it); bounded."""
        if index is None:
            self._indexes.pop(key, None)
            return
        if len(self._indexes) >= _INDEX_CACHE and key not in self._indexes:
            self._indexes.clear()
        self._indexes[key] = index

    def _read_node(self, key: str, deadline: AttemptDeadline) -> dict[str, Any] | None:
        """The v2 node at ``key`` (a value or a directory), ``None`` if absent."""
        answer = self._net.call("GET", node_path(key), dict(QUORUM), deadline)
        if not answer.ok:
            if answer.code in (KEY_NOT_FOUND, NOT_DIR):
                return None
            raise unexpected(answer, key)
        node: dict[str, Any] = answer.body["node"]
        return node

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        deadline, tries = self._deadline(), self._net.tries()
        params = value_params(value, ttl, prevExist="false")
        answer = self._write(key, params, deadline, tries)
        if answer.code == NODE_EXISTS:
            node = self._read_node(key, deadline)  # a key, or a directory?
            if node is not None and node.get("dir"):
                raise dir_error(key)
            if tries.maybe_applied and (node is None or not tries.predates(int(node["createdIndex"]))):
                if node is not None and own_write(node, params, tries, created=True):
                    return to_entry(key, node)
                raise may_have_applied(f"create({key!r})", key)
            raise KeyExistsError(f"key {key!r} exists", key)
        if not answer.ok:
            raise unexpected(answer, key)
        return to_entry(key, answer.body["node"])

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        answer = self._write(key, value_params(value, ttl), self._deadline())
        if not answer.ok:
            raise unexpected(answer, key)
        return to_entry(key, answer.body["node"])

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        deadline, tries = self._deadline(), self._net.tries()
        params = value_params(value, ttl, prevIndex=str(expected_revision))
        answer = self._write(key, params, deadline, tries)
        if answer.ok:
            return to_entry(key, answer.body["node"])
        if tries.maybe_applied and not self._conflict_predates(answer, tries):
            node = self._read_node(key, deadline)
            if node is not None and not node.get("dir") and own_write(node, params, tries):
                return to_entry(key, node)
            raise may_have_applied(f"compare_and_swap({key!r})", key)
        raise compare_answer_error(answer, key, expected_revision)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        deadline, tries = self._deadline(), self._net.tries()
        answer = self._net.call("DELETE", node_path(key), {"prevIndex": str(expected_revision)}, deadline, tries)
        if answer.ok:
            self._note_index(key, None)
            self._prune(key, deadline)
            return
        if tries.maybe_applied and not self._conflict_predates(answer, tries):
            raise may_have_applied(f"compare_and_delete({key!r})", key)
        raise compare_answer_error(answer, key, expected_revision)

    def _conflict_predates(self, answer: Answer, tries: Tries) -> bool:
        """Whether a failed compare shows a node state older than the request (so the conflict is genuine).

        Only error 101 tells: its cause ends ``[prevIndex != modifiedIndex]``.
        An absent key (100) may be this write's own doing followed by a delete,
        an existing one (105) this write's own create. Answers that are no
        conflict count as genuine (the caller raises them as usual).
        """
        if answer.code != COMPARE_FAILED:
            return answer.code not in (KEY_NOT_FOUND, NODE_EXISTS)
        current = current_index(str(answer.body.get("cause", "")))
        return current is not None and tries.predates(current)

    def _do_delete(self, key: str) -> bool:
        deadline = self._deadline()
        answer = self._net.call("DELETE", node_path(key), {}, deadline)
        if answer.code == NOT_FILE:  # a directory where the key belongs: remove it and what it holds
            answer = self._net.call("DELETE", node_path(key), {"recursive": "true"}, deadline)
        elif answer.code == NOT_DIR:  # a foreign value node where a directory of the key's path belongs
            self._delete_blocking(key, str(answer.body.get("cause", "")), deadline)
            return False
        if answer.ok:
            self._note_index(key, None)
            self._prune(key, deadline)
            return True
        if answer.code == KEY_NOT_FOUND:
            return False
        raise unexpected(answer, key)

    def _prune(self, key: str, deadline: AttemptDeadline) -> None:
        """After ``key`` was deleted, remove the directories on its path that it left empty (v2 makes them
        implicitly, so each round left its own behind), deepest first, never the root.

        ``DELETE ?dir=true`` removes only an EMPTY directory (errorCode 108 otherwise, which ends the walk), so a
        key created in it concurrently is never lost: etcd applies one of the two first. Costs one request for
        the first directory that still holds something; a failure only leaves an empty directory behind.
        """
        segments = node_segments(key)[:-1]
        while segments:
            path = "".join("/" + urllib.parse.quote(s, safe="") for s in segments)
            try:
                answer = self._net.call("DELETE", path, {"dir": "true"}, deadline)
            except (BackendUnavailableError, BackendClosedError) as exc:
                log.debug("empty etcd v2 directory %s left behind: %s", path, exc)
                return
            if not answer.ok and answer.code != KEY_NOT_FOUND:  # 108: not empty (or not ours to remove)
                return
            segments.pop()

    def _delete_blocking(self, key: str, blocking: str, deadline: AttemptDeadline) -> None:
        """Delete the value node ``blocking`` (a node key) that stands where a directory of ``key``'s node
        path belongs."""
        if not node_key(key).startswith(blocking.rstrip("/") + "/") or key_of(blocking) is not None:
            return  # not a proper ancestor, or one of our own keys: leave it
        path = "".join("/" + urllib.parse.quote(s, safe="") for s in blocking.strip("/").split("/"))
        log.warning("deleting etcd v2 node %s (not written by rdzv): it blocks key %r", blocking, key)
        answer = self._net.call("DELETE", path, {}, deadline)
        if not answer.ok and answer.code != KEY_NOT_FOUND:
            raise unexpected(answer, key)

    def _do_refresh(self, key: str, ttl: float) -> None:
        """A refresh guarded by the key's ``modifiedIndex`` (which every refresh moves on).

        v2 stores an absolute expiry time, computed by the member that took the request. An attempt that timed out
        at a follower whose leader was cut off is not lost: forwarded to that leader, it arrives once the link heals
        and may be applied long after later refreshes, setting the expiry back to a moment already past: the key
        lapses although it was refreshed in time. Guarded, such a late attempt fails its compare instead.
        """
        deadline = self._deadline()
        race = RaceRetry(deadline)
        index = self._indexes.get(key)
        while True:
            if index is None:
                index = self._refreshable_index(key, deadline)
            params = {"ttl": str(ttl_seconds(ttl)), "refresh": "true", "prevExist": "true", "prevIndex": str(index)}
            answer = self._write(key, params, deadline)
            if answer.ok:
                return
            if answer.code == KEY_NOT_FOUND:
                self._note_index(key, None)
                raise key_gone(key)
            if answer.code != COMPARE_FAILED:
                raise unexpected(answer, key)
            index = current_index(str(answer.body.get("cause", "")))  # written meanwhile (or by our own attempt)
            self._note_index(key, index)
            if not race.again(True):
                raise race.exhausted(f"refresh({key!r})", key, self.settings.operation_timeout)

    def _do_expire_tree(self, prefix: str, ttl: float) -> int:
        """Refresh each key; a ticket, a directory of in-order keys, is deleted at once instead (its keys
        could expire, but the directory would stay and read as corrupt: etcd 3.5's v2 API refuses a TTL on
        a directory, "Not a file"). The directories the keys' paths made stay behind, empty, once the keys
        expired (``rdzv reset`` removes them)."""
        count = 0
        for entry in self._do_list(prefix)[0]:
            try:
                self._do_refresh(entry.key, ttl)
            except KeyNotFoundError:
                continue
            except CorruptEntryError:  # a ticket directory
                self._do_delete(entry.key)
            count += 1
        return count

    def _refreshable_index(self, key: str, deadline: AttemptDeadline) -> int:
        """``key``'s ``modifiedIndex`` read from etcd; raises as an unguarded refresh of it would."""
        answer = self._net.call("GET", node_path(key), dict(QUORUM), deadline)
        if answer.code == KEY_NOT_FOUND:
            raise key_gone(key)
        if not answer.ok:
            raise unexpected(answer, key)
        if answer.body["node"].get("dir"):
            raise dir_error(key)
        index = int(answer.body["node"]["modifiedIndex"])
        self._note_index(key, index)
        return index

    def _do_add(self, key: str, delta: int) -> int:
        return self._adds.add(key, delta, self._deadline(), lambda total, dl: self._add_once(key, total, dl))

    def _add_once(self, key: str, delta: int, deadline: AttemptDeadline) -> int:
        """Add ``delta`` to ``key`` with one successful compare-and-swap; return the new value.

        See "Writes" in ``docs/backends/etcd-v2.md`` for the attempts and when they read.

        Raises:
            CorruptEntryError: the key holds a non-decimal value or is a directory (nothing written).
            BackendTimeoutError: every attempt lost a race until the operation deadline; or an
                attempt that may have been applied was followed by a lost race, so the add
                may or may not have taken effect (see ``Tries``; it is never applied twice).
        """
        known: Counter | None = self._counters.get(key)
        read = known is None
        race = RaceRetry(deadline)
        while True:
            if read:
                known, read = self._read_counter(key, deadline), False
            if known is None:
                total = delta
                params = {"value": b64(str(total).encode("ascii")), "prevExist": "false"}
            else:
                total = parse_counter(key, decode(key, known.raw)) + delta
                params = {"value": b64(str(total).encode("ascii")), "prevIndex": str(known.modified),
                          "prevValue": known.raw}
                if known.ttl is not None:  # keep the key's TTL (remaining whole seconds)
                    params["ttl"] = str(max(1, known.ttl))
            tries = self._net.tries()
            answer = self._write(key, params, deadline, tries)
            if answer.ok:  # a success proves that no earlier attempt was applied (see Tries)
                node = answer.body["node"]
                self._remember(key, Counter(node["value"], int(node["modifiedIndex"]), node.get("ttl")))
                return total
            if tries.maybe_applied and not self._conflict_predates(answer, tries):
                self._counters.pop(key, None)
                raise may_have_applied(f"add({key!r})", key)  # adding again could count twice
            if answer.code == COMPARE_FAILED and known is not None:
                current = None if known.ttl is not None else after_compare_failed(known, str(answer.body.get("cause")))
                progressed, read = True, current is None
                known = current
            elif answer.code == KEY_NOT_FOUND:  # deleted (or expired) since it was seen
                progressed, known = known is not None, None
            elif answer.code == NODE_EXISTS:  # created since it was seen absent
                progressed, read = True, True
            else:
                raise unexpected(answer, key)
            self._counters.pop(key, None)  # only states this backend wrote are remembered (never corrupt ones)
            if not race.again(progressed):
                raise race.exhausted(f"add({key!r})", key, self.settings.operation_timeout)

    def _do_take_ticket(self, key: str) -> int:
        """``POST`` an in-order key into the key's node, a directory (``/a/b/!t/000...N``): one write that
        never races; the ticket is its place among the directory's children (one sorted read).

        The written value is a random token: an attempt that may have been applied is not sent again (that
        could take two tickets) and the token is looked for instead.

        Raises:
            CorruptEntryError: the key's node is a value or a directory that is not a ticket directory.
            BackendTimeoutError: an attempt may have been applied, no answer came and its token is not there.
            KeyNotFoundError: the key was deleted between the write and the read.
        """
        deadline, tries = self._deadline(), self._net.tries()
        token = b64(os.urandom(9))
        try:
            answer = self._net.call("POST", node_path(key), {"value": token}, deadline, tries, resend=False)
        except BackendTimeoutError:
            found = self._find_ticket(key, token, deadline) if tries.maybe_applied else None
            if found is None:
                raise
            return found
        if not answer.ok:
            raise unexpected(answer, key)  # NOT_DIR: a value node stands at the key
        found = self._find_ticket(key, token, deadline)
        if found is None:
            raise KeyNotFoundError(f"ticket key {key!r} was deleted while a ticket was taken", key)
        return found

    def _find_ticket(self, key: str, token: str, deadline: AttemptDeadline) -> int | None:
        """The place (1-based) of the in-order key holding ``token`` in ``key``'s ticket directory, if any."""
        answer = self._net.call("GET", node_path(key), {"sorted": "true", **QUORUM}, deadline)
        if not answer.ok:
            if answer.code in (KEY_NOT_FOUND, NOT_DIR):
                return None
            raise unexpected(answer, key)
        for place, node in enumerate(ticket_nodes(key, answer.body["node"]), 1):
            if node.get("value") == token:
                return place
        return None

    def _read_counter(self, key: str, deadline: AttemptDeadline) -> Counter | None:
        """The counter node at ``key`` (``None`` if absent); :class:`CorruptEntryError` for a directory."""
        node = self._read_node(key, deadline)
        if node is None:
            return None
        if node.get("dir"):
            raise dir_error(key)
        ttl = node.get("ttl")
        return Counter(str(node.get("value", "")), int(node["modifiedIndex"]), None if ttl is None else int(ttl))

    def _remember(self, key: str, counter: Counter) -> None:
        """Note the state ``add`` wrote at ``key`` (a decimal value, so a later add never fails on a
        remembered state: only on one the server answered), unless the key has a TTL (its TTL runs
        down, so such a counter is read each time).

        Bounded; a stale entry costs one lost attempt, whose answer has the current state.
        """
        if counter.ttl is not None:
            self._counters.pop(key, None)
            return
        if len(self._counters) >= _COUNTER_CACHE:
            self._counters.clear()
        self._counters[key] = counter

    # -- watch -------------------------------------------------------------------
    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        poll = AttemptDeadline(timeout)
        failures = FailureBudget(call_budget(self.settings.operation_timeout), poll)
        wait_index = after_revision + 1
        while True:
            params = {"wait": "true", "recursive": "true", "waitIndex": str(wait_index)}
            answer = self._net.send("GET", dir_path(prefix), params, failures, tries=None, poll=poll)
            if answer is None:
                return []
            if not answer.ok:
                if answer.code == INDEX_CLEARED:
                    raise HistoryCompactedError(
                        f"etcd v2 no longer has the events after index {after_revision} "
                        f"({answer.body.get('cause')}); re-read and watch from the index read",
                        prefix,
                    )
                raise unexpected(answer, prefix)
            event = watch_event(answer.body, prefix)
            if event is not None:
                return [event]
            wait_index = int(answer.body["node"]["modifiedIndex"]) + 1  # a refresh or a directory: skip
            if poll.expired():
                return []

    def _do_close(self) -> None:
        net = getattr(self, "_net", None)
        if net is not None:
            net.close()
