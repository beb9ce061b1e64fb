"""Key grammar of the KV protocol (see :mod:`rdzv_core.kv`, "Keys"): checks, joining, escaping data."""

from __future__ import annotations

import re

from .errors import InvalidKeyError

__all__ = ["MAX_KEY_CHARS", "check_key", "check_prefix", "escape_segment", "join_key", "unescape_segment"]

MAX_KEY_CHARS = 1024
_SEGMENT = re.compile(r"[A-Za-z0-9_\-.=%+:@~]{1,255}")
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def escape_segment(data: str | bytes) -> str:
    """Encode arbitrary data as one key segment (reversible, never contains ``/``).

    Args:
        data: ``str`` (encoded as UTF-8) or ``bytes``, any length including 0.

    Returns:
        ``"="`` followed by the bytes, where every byte outside ``A-Za-z0-9_-``
        is written ``%XX``. E.g. ``escape_segment("a/b")`` is ``"=a%2Fb"``.

    Raises:
        InvalidKeyError: if the escaped form exceeds 255 characters.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    out = "=" + "".join(chr(b) if b in _SAFE_BYTES else f"%{b:02X}" for b in raw)
    if len(out) > 255:
        raise InvalidKeyError("key", data[:40], f"too long once escaped ({len(out)} > 255 characters)")
    return out


def unescape_segment(segment: str) -> bytes:
    """Invert :func:`escape_segment`; returns the original bytes.

    Raises:
        InvalidKeyError: if ``segment`` was not produced by :func:`escape_segment`.
    """
    if not segment.startswith("="):
        raise InvalidKeyError("segment", segment, "not an escaped segment (must start with '=')")
    out = bytearray()
    i = 1
    while i < len(segment):
        ch = segment[i]
        if ch == "%":
            try:
                out.append(int(segment[i + 1 : i + 3], 16))
            except ValueError:
                raise InvalidKeyError("segment", segment, f"bad escape at offset {i}") from None
            i += 3
        else:
            out.append(ord(ch))
            i += 1
    return bytes(out)


def check_key(key: str, field_name: str = "key") -> str:
    """Return ``key`` if it follows the key grammar, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(field_name, key, "keys are str")
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidKeyError(field_name, key, f"length must be 1..{MAX_KEY_CHARS} characters")
    for seg in key.split("/"):
        if seg in (".", "..") or not _SEGMENT.fullmatch(seg):
            raise InvalidKeyError(
                field_name, key, f"segment {seg!r} is empty, '.'/'..', too long or has characters "
                "outside A-Za-z0-9_-.=%+:@~ (use escape_segment)"
            )
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is ``""`` or a valid key followed by ``/``."""
    if prefix == "":
        return prefix
    if not isinstance(prefix, str) or not prefix.endswith("/"):
        raise InvalidKeyError("prefix", prefix, "a prefix is '' or a key followed by '/'")
    check_key(prefix[:-1], "prefix")
    return prefix


def join_key(*parts: str) -> str:
    """Join key parts (each a key or segment, possibly with surrounding ``/``)."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))
