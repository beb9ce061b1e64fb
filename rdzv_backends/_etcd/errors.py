"""The errors both etcd backends raise for the same conditions, built in one place.

Each backend classifies its client's failure (urllib3 exceptions for v2, gRPC status codes for v3) into a
:class:`Failure` and calls :func:`transport_error`; when an operation's deadline passes, :func:`give_up`
picks what it raises. Messages never show a password (:meth:`~.settings.EtcdSettings.describe`).
"""

from __future__ import annotations

import enum

from rdzv_core.errors import (
    BackendConnectionError,
    BackendTimeoutError,
    BackendUnavailableError,
    CompareFailedError,
    KeyNotFoundError,
)
from rdzv_core.kv import budget_text

from .budget import Tries
from .settings import EtcdSettings

__all__ = ["Failure", "transport_error", "give_up", "unreachable", "may_have_applied", "compare_error", "key_gone"]


class Failure(enum.Enum):
    """How one attempt of a request failed in transport."""

    NOT_SENT = "not sent"  # connecting failed: the request cannot have reached etcd
    TIMED_OUT = "timed out"  # no answer within the attempt's time
    LOST = "lost"  # the connection failed after the request may have reached etcd
    TLS = "tls"  # the TLS handshake failed (not retried)
    OVERLOADED = "overloaded"  # etcd refused the request as too many


def transport_error(failure: Failure, where: str, what: str, detail: str) -> BackendUnavailableError:
    """The error of one failed attempt.

    Args:
        failure: how it failed.
        where: the endpoint, e.g. ``"etcd at http://127.0.0.1:2379"``.
        what: the request, e.g. ``"PUT /a/!b"`` or ``"create 'a/b'"``.
        detail: the client's reason.
    """
    if failure is Failure.NOT_SENT:
        return BackendConnectionError(f"cannot reach {where} for {what}: {detail}")
    if failure is Failure.TIMED_OUT:
        return BackendTimeoutError(f"{where} did not answer {what} in time")
    if failure is Failure.TLS:
        return BackendConnectionError(f"TLS handshake with {where} failed: {detail}")
    if failure is Failure.OVERLOADED:
        return BackendTimeoutError(f"{where} is overloaded: {detail}")
    return BackendConnectionError(f"connection to {where} lost during {what}: {detail}")


def give_up(
    settings: EtcdSettings, what: str, last: BackendUnavailableError | None, *, refused: bool, tries: Tries | None
) -> BackendUnavailableError:
    """What a request raises once its deadline passed.

    Args:
        last: the last attempt's error (``None``: no attempt got any time).
        refused: no attempt reached a server (every one was refused or unroutable).
        tries: a compare-guarded write's :class:`~.budget.Tries`, or ``None``.

    Returns:
        :class:`BackendConnectionError` naming every endpoint if all refused;
        else ``last``, saying the write may or may not have taken effect if an attempt may have been applied.
    """
    if last is None:
        return BackendTimeoutError(f"no etcd endpoint of {settings.describe()} answered {what} in time")
    if refused and isinstance(last, BackendConnectionError):
        return BackendConnectionError(unreachable(settings, what, last))
    if tries is not None and tries.maybe_applied and "may or may not" not in str(last):
        return type(last)(f"{last}; it may or may not have taken effect")
    return last


def unreachable(settings: EtcdSettings, what: str, last: BaseException | None) -> str:
    """The message for "no endpoint could be reached": names every endpoint (never the password).

    Args:
        settings: the backend's settings (their :meth:`~.settings.EtcdSettings.describe` lists the endpoints).
        what: the operation, e.g. ``"get 'a/b'"``.
        last: the last transport error seen, or ``None``.
    """
    count = len(settings.endpoints)
    which = "the etcd endpoint" if count == 1 else f"any of the {count} etcd endpoints"
    detail = f" (last error: {last})" if last is not None else ""
    return (f"cannot reach {which} {settings.describe()} for {what} within "
            f"{budget_text(settings.operation_timeout)}{detail}; is etcd running there?")


def may_have_applied(what: str, key: str) -> BackendTimeoutError:
    """The error for a compare-guarded write whose outcome the backend cannot tell.

    An attempt may have been applied and a later attempt met a conflict that is
    not provably genuine (state written after the request was first sent, not
    recognisably this write's own).
    """
    return BackendTimeoutError(
        f"{what} was retried after an attempt that may have been applied, and the retry found {key!r} changed "
        "by a write after it was first sent: it may or may not have taken effect; re-read the key", key
    )


def compare_error(
    key: str, expected: int, actual: int | None, *, absent: bool
) -> KeyNotFoundError | CompareFailedError:
    """The error of a compare on ``key``'s revision that failed: absent, or at revision ``actual`` (if known)."""
    if absent:
        return KeyNotFoundError(f"key {key!r} not found", key)
    return CompareFailedError(f"key {key!r} is at revision {actual}, not {expected}", key, expected, actual)


def key_gone(key: str) -> KeyNotFoundError:
    """The error of ``refresh`` (and ``ttl_remaining``) for a key that is not there."""
    return KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)
