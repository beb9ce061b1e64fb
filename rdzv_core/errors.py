"""Every error that ``rdzv`` raises, in one hierarchy.

::

    RdzvError
    ├── KVError                          a key-value backend operation failed
    │   ├── KeyExistsError               create() on a key that is present
    │   ├── KeyNotFoundError             CAS / refresh / compare_and_delete on an absent key
    │   ├── CompareFailedError           the entry's revision is not the expected one
    │   ├── HistoryCompactedError        watch() can no longer serve events after a revision
    │   ├── ValueTooLargeError           a value exceeds the backend's ``max_value_bytes``
    │   ├── CorruptEntryError            stored data this protocol did not write (wrong type, not a counter)
    │   ├── BackendClosedError           the backend was closed by its owner
    │   └── BackendUnavailableError      the server cannot be used right now
    │       ├── BackendConnectionError   connection refused / lost
    │       └── BackendTimeoutError      the server did not answer in time
    ├── ConfigError (also ValueError)    bad input: names ``field`` and ``value``
    │   ├── InvalidArgumentError         a bad argument of a call (TTL, timeout, delta, revision, value)
    │   │   └── InvalidKeyError          a key or prefix outside the key grammar
    │   ├── InvalidURLError              a rendezvous URL or one of its query values
    │   ├── UnknownBackendError          no installed backend claims the URL's scheme
    │   ├── UnsuitableServerError        the server is set up so the backend cannot be used safely
    │   └── RunConfigMismatchError       a setting differs from the one the run recorded when it was created
    ├── PluginError                      two distributions claim one scheme
    ├── RendezvousClosedError            the run was closed (``set_closed``)
    │   └── RendezvousGracefulExitError  ... while this node waited as a spare (exit successfully)
    ├── NodeExcludedError                this node is kept out (its check failed, or it is quarantined)
    ├── RendezvousTimeoutError           no round completed within the overall timeout
    └── RendezvousStateError             the stored rendezvous state is corrupt

Naming rule: every exception class ends in ``Error``.

The rendezvous handler maps these onto torch's ``RendezvousClosedError``,
``RendezvousTimeoutError``, ``RendezvousConnectionError`` and
``RendezvousStateError`` (see :mod:`rdzv_core.torch_api.handler`); this module itself does
not import torch.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "RdzvError",
    "KVError",
    "KeyExistsError",
    "KeyNotFoundError",
    "CompareFailedError",
    "HistoryCompactedError",
    "ValueTooLargeError",
    "CorruptEntryError",
    "BackendClosedError",
    "BackendUnavailableError",
    "BackendConnectionError",
    "BackendTimeoutError",
    "ConfigError",
    "is_secret_field",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidURLError",
    "UnknownBackendError",
    "UnsuitableServerError",
    "RunConfigMismatchError",
    "PluginError",
    "RendezvousClosedError",
    "RendezvousGracefulExitError",
    "NodeExcludedError",
    "RendezvousTimeoutError",
    "RendezvousStateError",
]


class RdzvError(Exception):
    """Base class of every error raised by ``rdzv``."""


class KVError(RdzvError):
    """A key-value backend operation failed.

    Attributes:
        key: the key (or prefix) the operation was about, or ``None``.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class KeyExistsError(KVError):
    """``create`` found the key already present."""


class KeyNotFoundError(KVError):
    """The key is absent (never written, deleted, or its TTL ran out)."""


class CompareFailedError(KVError):
    """The entry's current revision differs from ``expected_revision``.

    Attributes:
        expected_revision: what the caller expected (int).
        actual_revision: what the backend holds (int), when it said so, else ``None``.
    """

    def __init__(
        self,
        message: str,
        key: str | None = None,
        expected_revision: int | None = None,
        actual_revision: int | None = None,
    ) -> None:
        super().__init__(message, key)
        self.expected_revision = expected_revision
        self.actual_revision = actual_revision


class HistoryCompactedError(KVError):
    """``watch`` cannot serve events after ``after_revision`` any more.

    The caller re-reads the current state (``get``/``list``) and watches again from
    the revision it read.
    """


class ValueTooLargeError(KVError):
    """A value is larger than the backend's ``Capabilities.max_value_bytes``.

    Raised before anything is written.
    """


class CorruptEntryError(KVError):
    """The backend holds data at ``key`` that is not an entry of this protocol.

    Examples: ``add`` on a value that is not ASCII decimal; a Redis key of the
    wrong type (a list where a string belongs); an etcd v2 directory where a key
    belongs; a non-integer revision counter; an SQLite value stored as TEXT.
    Someone wrote it with another tool. Nothing was written by the failing call.
    ``delete(key)`` (or ``rdzv reset URL``, which deletes such keys one by one)
    recovers; ``key`` is ``None`` only when the bad data is the backend's own
    bookkeeping, and the message then names the storage location to delete.
    """


class BackendClosedError(KVError):
    """The backend object was closed; open a new one."""


class BackendUnavailableError(KVError):
    """The backend's server cannot be used right now (transient)."""


class BackendConnectionError(BackendUnavailableError):
    """Connection refused, reset or lost."""


class BackendTimeoutError(BackendUnavailableError):
    """The server did not answer within the operation's deadline."""


#: Longest rendering (characters) of a rejected value in a :class:`ConfigError` message.
MAX_SHOWN_CHARS = 120

#: Words that make a field name a secret's (``password``, ``--redis-password``, ``api_key``, ``auth_token``).
_SECRET_WORDS = frozenset({"password", "passwd", "pass", "pwd", "passphrase", "secret", "token", "apikey",
                           "credential", "credentials", "auth"})


def is_secret_field(name: object) -> bool:
    """Whether a field (query key, option, argument) holds a secret, whose value is never shown.

    One rule for every message: a word of the name (split at ``_``, ``-``, ``.``) is a password-like
    word, or the name ends in ``api_key``/``private_key``/``access_key``/``secret_key``. A TLS ``key``
    (a file path) is not a secret.
    """
    if not isinstance(name, str):
        return False
    words = [w for w in re.split(r"[_\-.\s]+", name.lower()) if w]
    if any(w in _SECRET_WORDS or w.endswith(("password", "passwd", "secret", "token")) for w in words):
        return True
    return len(words) >= 2 and words[-1] == "key" and words[-2] in ("api", "private", "access", "secret")


class ConfigError(RdzvError, ValueError):
    """Bad input. The message names the field and the offending value.

    Attributes:
        field: name of the setting, query key or argument (str).
        value: the rejected value; ``"***"`` where the field is a secret (:func:`is_secret_field`),
            ``None`` where none was given.
    """

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        if value is not None and is_secret_field(field):  # one rule: secrets' values are never shown
            value = "***"
        self.value = value
        self.reason = reason
        shown = repr(value)
        if len(shown) > MAX_SHOWN_CHARS:  # a 20 KB query value must not become a 20 KB error line
            size = len(value) if isinstance(value, (str, bytes)) else len(shown)  # the value's, not its repr's
            shown = f"{shown[:MAX_SHOWN_CHARS - 20]}... ({size} chars)"
        super().__init__(f"invalid value for {field!r}: {shown}: {reason}")


class InvalidArgumentError(ConfigError):
    """An argument of a call is invalid: a TTL, timeout, delta, revision or value of :mod:`rdzv_core.kv`."""


class InvalidKeyError(InvalidArgumentError):
    """A key or prefix does not follow the key grammar of :mod:`rdzv_core.kv`."""


class InvalidURLError(ConfigError):
    """A rendezvous URL, or one of its parts or query values, is invalid."""


class UnknownBackendError(ConfigError):
    """No installed backend claims the URL's scheme.

    The message lists the known schemes and, where one is known, the extra or
    package that would add the requested scheme.
    """


class UnsuitableServerError(ConfigError):
    """The backend's server is set up in a way that would break the rendezvous (refused when it is opened).

    The message is the backend's one line: the server, the setting and its value, why it breaks the
    rendezvous and what to do instead (a server setting, another backend, or the query key that accepts it).

    Attributes:
        field: the server's setting (str, e.g. a configuration directive's name).
        value: that setting's value on the server.
        reason: the whole message (str).
    """

    def __init__(self, field: str, value: Any, message: str) -> None:
        self.field, self.value, self.reason = field, value, message
        RdzvError.__init__(self, message)


class RunConfigMismatchError(ConfigError):
    """This node's value of a setting every node of a run must share (``min_nodes``, ``max_nodes``,
    ``last_call_timeout``, ...: ``rdzv_core.rendezvous.record.RUN_SETTINGS``) differs from the value the
    run recorded when it was created (``ROOT/state/config``). Raised by ``Rendezvous.next_round`` before
    the node takes a ticket or counts as waiting: the run and its round are not touched.

    Attributes:
        run_id: the run (str).
        field: the first differing setting (str).
        value: this node's value of it.
        run_value: the run's value of it.
        differences: every differing setting, ``((field, this node's value, the run's value), ...)``.
        reason: the whole message (str).
    """

    def __init__(self, run_id: str, differences: tuple[tuple[str, Any, Any], ...], message: str) -> None:
        self.run_id, self.differences, self.reason = run_id, differences, message
        self.field, self.value, self.run_value = differences[0]
        RdzvError.__init__(self, message)


class PluginError(RdzvError):
    """The plugin registry is inconsistent (e.g. a scheme claimed twice)."""


class RendezvousClosedError(RdzvError):
    """The run is closed: no further rounds will form (see ``Rendezvous.set_closed``)."""


class RendezvousGracefulExitError(RendezvousClosedError):
    """The run closed while this node waited as a *spare* (the round was full): it has nothing
    left to do and may exit successfully (torch's ``RendezvousGracefulExitError``)."""


class NodeExcludedError(RdzvError):
    """This node is kept out of the run: its pre-flight check failed (``node_check_action=exit``), or the run
    closed while it waited at the gate (quarantined, or its check failing): ``docs/node-health.md``.

    Attributes:
        node: the node's name; reason: one line, why it was kept out.
    """

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"node {node} kept out of the run: {reason}")
        self.node = node
        self.reason = reason


class RendezvousTimeoutError(RdzvError):
    """``next_round`` did not complete within the overall ``timeout`` (seconds)."""


class RendezvousStateError(RdzvError):
    """The rendezvous state stored in the backend is corrupt or unexpected.

    Attributes:
        key: the backend key holding the bad state (str or ``None``).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

