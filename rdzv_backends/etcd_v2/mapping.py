"""How the KV protocol maps onto etcd's v2 keyspace: keys, values, answers and watch events.

Key ``a/b/c`` is the v2 node ``/a/b/!c`` (a leaf marker, so a key and a directory of the same name coexist);
values are base64 text. ``docs/backends/etcd-v2.md`` has the whole mapping. Nothing here sends a request.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from typing import Any, NamedTuple

from rdzv_core.errors import CorruptEntryError, InvalidKeyError, KVError
from rdzv_core.kv import Entry, Event, EventType, check_key

from .._etcd.budget import Tries
from .._etcd.errors import compare_error
from .._etcd.settings import ttl_seconds

LEAF = "!"
# v2 errorCodes (etcd Documentation/v2/errorcode.md)
KEY_NOT_FOUND, COMPARE_FAILED, NOT_FILE, NOT_DIR, NODE_EXISTS = 100, 101, 102, 104, 105
DIR_NOT_EMPTY, UNAUTHORIZED, RAFT_INTERNAL, LEADER_ELECT, INDEX_CLEARED = 108, 110, 300, 301, 401
# Causes of error 101 for a compare on prevValue and prevIndex (etcd's v2store getCompareFailCause).
_INDEX_MOVED = re.compile(r"\[(\d+) != (\d+)\]")
_BOTH_MOVED = re.compile(r"\[(\S*) != (.*)\] \[(\d+) != (\d+)\]", re.DOTALL)
_CAUSE_INDEX = re.compile(r"\[(\d+) != (\d+)\]\Z")
#: The name etcd gives an in-order key (``POST``): its createdIndex, 20 digits.
_IN_ORDER = re.compile(r"[0-9]{20}")


class Answer(NamedTuple):
    """One v2 answer: ``ok`` (2xx), the JSON body (or error payload), the ``X-Etcd-Index``."""

    ok: bool
    body: dict[str, Any]
    etcd_index: int

    @property
    def code(self) -> int | None:
        return None if self.ok else self.body.get("errorCode")


class Counter(NamedTuple):
    """A counter node as ``add`` last saw it: stored (base64) text, ``modifiedIndex``, TTL left (s) or ``None``."""

    raw: str
    modified: int
    ttl: int | None


def node_segments(key: str) -> list[str]:
    """The v2 node's path segments of ``key``: ``a/b/c`` -> ``["a", "b", "!c"]``."""
    *dirs, leaf = key.split("/")
    return [dir_segment(d) for d in dirs] + [LEAF + leaf]


def node_key(key: str) -> str:
    """The v2 node key (unquoted) of ``key``: ``a/b/c`` -> ``/a/b/!c``."""
    return "/" + "/".join(node_segments(key))


def node_path(key: str) -> str:
    """The URL path (quoted) of ``key``'s v2 node."""
    return "".join("/" + urllib.parse.quote(s, safe="") for s in node_segments(key))


def dir_path(prefix: str) -> str:
    """The URL path (quoted) of the v2 directory holding ``prefix`` (``""`` -> ``/``)."""
    if not prefix:
        return "/"
    return "".join("/" + urllib.parse.quote(dir_segment(d), safe="") for d in prefix[:-1].split("/"))


def dir_segment(segment: str) -> str:
    """A directory segment as stored: ``_`` (hidden by v2) and ``~`` get one more ``~`` in front."""
    return "~" + segment if segment[0] in "_~" else segment


def key_of(node_key: str) -> str | None:
    """Our key for a v2 node key (``/a/b/!c`` -> ``a/b/c``), ``None`` if not one of ours."""
    *dirs, leaf = node_key.lstrip("/").split("/")
    if not leaf.startswith(LEAF) or len(leaf) < 2:
        return None
    try:
        return check_key("/".join([d[1:] if d.startswith("~") else d for d in dirs] + [leaf[1:]]))
    except InvalidKeyError:
        return None


def decode(key: str, raw: Any) -> bytes:
    """The bytes of a stored value (base64 text); :class:`CorruptEntryError` if it is not base64."""
    try:
        return base64.b64decode(raw if isinstance(raw, str) else "", validate=True)
    except (binascii.Error, ValueError):
        raise CorruptEntryError(
            f"etcd v2 node {node_key(key)} (key {key!r}) holds {str(raw)[:40]!r}, not base64 data written by "
            f"this backend; delete({key!r}) or `rdzv reset` removes it", key
        ) from None


def dir_error(key: str) -> CorruptEntryError:
    return CorruptEntryError(
        f"etcd v2 holds a directory at {node_key(key)}, where the value of key {key!r} belongs (made by another "
        f"program); delete({key!r}) or `rdzv reset` removes it", key
    )


def to_entry(key: str, node: dict[str, Any]) -> Entry:
    """The entry of a key's node; a ticket directory reads as its count (the ``add`` counter's form)."""
    if node.get("dir"):
        tickets = ticket_nodes(key, node)
        revision = max([int(node["modifiedIndex"])] + [int(t["modifiedIndex"]) for t in tickets])
        return Entry(key, str(len(tickets)).encode("ascii"), revision)
    return Entry(key, decode(key, node.get("value", "")), int(node["modifiedIndex"]))


def ticket_nodes(key: str, node: dict[str, Any]) -> list[dict[str, Any]]:
    """The in-order keys of a ticket directory (``take_ticket``: ``/a/b/!t/000...N``), in the answer's order.

    Raises:
        CorruptEntryError: ``node`` is a value, an empty directory or one holding anything else (not ours).
    """
    children = node.get("nodes") or []
    if not node.get("dir") or not children or not all(
            not c.get("dir") and _IN_ORDER.fullmatch(str(c.get("key", "")).rsplit("/", 1)[-1]) for c in children):
        raise dir_error(key)
    return list(children)


def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The value nodes, and the directories named like key nodes (``!x``), of a recursive v2 answer."""
    if not node.get("dir") or node.get("key", "").rsplit("/", 1)[-1].startswith(LEAF):
        return [node]
    out: list[dict[str, Any]] = []
    for child in node.get("nodes", ()):
        out.extend(nodes(child))
    return out


def after_compare_failed(tried: Counter, cause: str) -> Counter | None:
    """The counter's current state from the cause of a failed ``prevValue``+``prevIndex`` compare.

    ``None`` when the answer does not tell (or tells that only the index moved:
    something rewrote the same value, perhaps with another TTL, so re-read).
    """
    both = _BOTH_MOVED.fullmatch(cause)
    if both is not None and both.group(1) == tried.raw:
        return Counter(both.group(2), int(both.group(4)), None)
    return None


def current_index(cause: str) -> int | None:
    """The node's ``modifiedIndex`` from the cause of error 101 (it ends ``[prevIndex != modifiedIndex]``)."""
    match = _CAUSE_INDEX.search(cause)
    return int(match.group(2)) if match else None


def own_write(node: dict[str, Any], params: dict[str, str], tries: Tries, *, created: bool = False) -> bool:
    """Whether ``node`` shows the write ``params`` of a request whose earlier attempt may have been applied.

    It must be newer than the request (``modifiedIndex`` above ``tries.seen``),
    hold the written value, have a TTL exactly if the write gave one, and (for
    ``create``) be unmodified since it was created. v2 records no writer, so a
    concurrent write of the very same value in the same second passes as well.
    """
    return (
        not tries.predates(int(node["modifiedIndex"]))
        and node.get("value") == params["value"]
        and (node.get("ttl") is not None) == ("ttl" in params)
        and (not created or node.get("createdIndex") == node.get("modifiedIndex"))
    )


def b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def value_params(value: bytes, ttl: float | None, **extra: str) -> dict[str, str]:
    params = {"value": b64(value), **extra}
    if ttl is not None:
        params["ttl"] = str(ttl_seconds(ttl))
    return params


ACTIONS = {
    "set": EventType.PUT,
    "create": EventType.PUT,
    "update": EventType.PUT,
    "compareAndSwap": EventType.PUT,
    "delete": EventType.DELETE,
    "compareAndDelete": EventType.DELETE,
    "expire": EventType.DELETE,
}


def watch_event(body: dict[str, Any], prefix: str) -> Event | None:
    """The :class:`Event` of a v2 watch answer, ``None`` if it is not one to report."""
    node = body.get("node", {})
    kind = ACTIONS.get(body.get("action", ""))
    if kind is None or body.get("refresh") or (node.get("dir") and kind is EventType.PUT):
        return None
    path = str(node.get("key", ""))
    key = key_of(path)
    parent, _, name = path.rpartition("/")
    ticket = key is None and not node.get("dir") and _IN_ORDER.fullmatch(name) is not None
    if ticket:  # a ticket taken: a change of the ticket key (its count is not in the event)
        key = key_of(parent)
    if key is None or not key.startswith(prefix):
        return None
    value = (b"" if ticket else decode(key, node.get("value", ""))) if kind is EventType.PUT else None
    return Event(kind, key, int(node["modifiedIndex"]), value)


def compare_answer_error(answer: Answer, key: str, expected: int) -> KVError:
    """The error of a compare on ``key``'s ``prevIndex`` that failed (``KeyNotFoundError``, ``CompareFailedError``)."""
    if answer.code in (KEY_NOT_FOUND, NOT_DIR):
        return compare_error(key, expected, None, absent=True)
    if answer.code == COMPARE_FAILED:
        match = _INDEX_MOVED.fullmatch(str(answer.body.get("cause", "")))
        return compare_error(key, expected, int(match.group(2)) if match else None, absent=False)
    return unexpected(answer, key)


def unexpected(answer: Answer, key: str) -> KVError:
    """The error of an answer no operation handles: foreign data in the way, or another etcd error."""
    body = answer.body
    if answer.code == NOT_FILE:
        return dir_error(key)
    if answer.code == NOT_DIR:
        return CorruptEntryError(
            f"etcd v2 holds a value at node {body.get('cause')} (made by another program), where a directory "
            f"on the path of key {key!r} belongs; delete({key!r}) or `rdzv reset` removes it", key
        )
    return KVError(f"etcd v2 error {body.get('errorCode')} on {key!r}: {body.get('message')} "
                   f"({body.get('cause')})", key)
