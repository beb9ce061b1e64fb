"""How the KV protocol's keys and events map onto etcd's v3 keyspace (no request is sent here).

Key ``a/b`` is the v3 key ``/a/b`` (UTF-8); a prefix is the key range ``["/" + prefix, "/" + prefix + 1)``;
keys under ``/`` that no key of ours can be (written by other programs) are ignored.
"""

from __future__ import annotations

from typing import Any

from rdzv_core.errors import InvalidKeyError
from rdzv_core.kv import Event, EventType, check_key

from .._etcd.budget import Tries

__all__ = ["v3_key", "prefix_range", "key_of", "watch_event", "own_write"]


def v3_key(key: str) -> bytes:
    """The v3 key of ``key``: ``a/b`` -> ``b"/a/b"``."""
    return ("/" + key).encode("utf-8")


def prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """``[start, end)`` of the v3 keys below ``prefix`` (``"/"`` + prefix, last byte + 1)."""
    start = v3_key(prefix) if prefix else b"/"
    return start, start[:-1] + bytes([start[-1] + 1])


def key_of(raw: bytes) -> str | None:
    """Our key for a v3 key (``b"/a/b"`` -> ``"a/b"``); ``None`` for keys another program wrote
    that no key of ours can be (not UTF-8, or outside the key grammar)."""
    try:
        return check_key(bytes(raw).decode("utf-8")[1:])
    except (UnicodeDecodeError, InvalidKeyError):
        return None


def watch_event(ev: Any) -> Event | None:
    """The :class:`Event` of a v3 ``mvccpb.Event``; ``None`` for a key that is not ours."""
    key = key_of(ev.kv.key)
    if key is None:
        return None
    if ev.type == 1:  # mvccpb.Event.DELETE
        return Event(EventType.DELETE, key, int(ev.kv.mod_revision))
    return Event(EventType.PUT, key, int(ev.kv.mod_revision), bytes(ev.kv.value))


def own_write(kv: Any, value: bytes, lease: int, tries: Tries, *, created: bool = False) -> bool:
    """Whether ``kv`` (a conflict's current state) shows the write of ``value`` on ``lease`` by a
    request whose earlier attempt may have been applied.

    With a TTL the write's lease is new and never shared, so the key being on
    it proves the write. Without one: newer than the request (``mod_revision``
    above ``tries.seen``), the written value, no lease, and (for ``create``)
    unmodified since it was created; a concurrent write of the very same value
    passes as well.
    """
    if lease:
        return int(kv.lease) == lease
    return (not tries.predates(int(kv.mod_revision)) and bytes(kv.value) == value and not kv.lease
            and (not created or int(kv.version) == 1))
