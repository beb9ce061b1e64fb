"""How redis-py's errors become :mod:`rdzv_core.errors`, for a backend and its listener: one
:class:`_ErrorMap` per backend (``RedisBackend._translate`` and the listener map through it)."""

from __future__ import annotations

import re
import shlex
import ssl
from typing import Any

import redis

from rdzv_backends._tls import certificate_error, refused_certificate
from rdzv_backends.redis._config import TLSFiles
from rdzv_core.errors import (
    BackendConnectionError,
    BackendTimeoutError,
    CorruptEntryError,
    InvalidURLError,
    KVError,
    RdzvError,
)
from rdzv_core.kv import budget_text

#: What Redis 7 appends to an error raised by a script.
_SCRIPT_SUFFIX = re.compile(r"\s*script: \w+, on @user_script:\d+\.?\s*$")
#: What deleting a corrupt bookkeeping key costs (for the error message).
_AFTER_DELETE = {
    "#rev": "nothing is lost without it (revisions go on after the log's last)",
    "#epoch": "nothing is lost without it",
    "#log": "without it, the event history is lost: watchers get HistoryCompactedError and re-read",
    "#ttl": "without it, keys with a TTL expire in Redis alone, each recorded when a client next touches it",
    "#last": "nothing is lost without it (watches read the log until the next write starts it again)",
}
#: The server's option naming the CAs whose client certificates it accepts (for messages).
TRUSTED_CA_OPTION = "redis-server's --tls-ca-cert-file"
#: OpenSSL verify codes X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_NAME_MISMATCH = (62, 64)


class _ErrorMap:
    """How one server's redis-py errors become :mod:`rdzv_core.errors` (for a backend and its listener)."""

    def __init__(self, host: str, port: int, db: int, tls: TLSFiles | None, operation_timeout: float,
                 max_connections: int, prefix: str, username: str | None = None,
                 password_given: bool = True, where: str | None = None) -> None:
        self.host, self.port, self.db, self.tls = host, port, db, tls
        #: How messages name the server ("redis at HOST:PORT" by default).
        self.where = where if where is not None else f"redis at {host}:{port}"
        self.username, self.password_given = username, password_given
        self.operation_timeout, self.max_connections, self.prefix = operation_timeout, max_connections, prefix

    def map(self, exc: Exception, key: str | None) -> RdzvError | None:
        """The error of :mod:`rdzv_core.errors` for a redis-py one (``None``: not redis-py's)."""
        errors = redis.exceptions
        where = self.where
        text = str(exc)
        if isinstance(exc, errors.AuthenticationError):
            user = self.username if self.username is not None else "default"
            if not self.password_given:
                return InvalidURLError("password", None, f"{where} needs a password and the URL gives none (user "
                                       f"{user!r}): write redis://[USER]:PASSWORD@HOST ({text})")
            return InvalidURLError("password", "***", f"{where} rejected user {user!r} with the given password: "
                                   f"{text}")
        if isinstance(exc, errors.TimeoutError):
            return BackendTimeoutError(f"{where} did not answer within {budget_text(self.operation_timeout)}: "
                                  f"{text}", key)
        if isinstance(exc, errors.ConnectionError):
            verify = _find_cause(exc, ssl.SSLCertVerificationError)
            if verify is not None and verify.verify_code in _NAME_MISMATCH:
                return InvalidURLError("host", self.host, f"the TLS certificate of {where} is not issued for "
                                       f"this name: {verify.verify_message}")
            if verify is not None:
                return InvalidURLError("cacert", self.tls.cacert if self.tls else None,
                                       f"the TLS certificate of {where} did not verify: "
                                       f"{verify.verify_message or verify}")
            refused = refused_certificate(exc, self.tls.cert is not None) if self.tls is not None else None
            if refused is not None:
                return certificate_error(f"{self.host}:{self.port}", self.tls.cert if self.tls else None, refused,
                                         TRUSTED_CA_OPTION)
            if "Invalid Database" in text:
                return InvalidURLError("db", self.db, f"{where} has no such database")
            if "No connection available" in text:
                return BackendTimeoutError(f"all max_connections={self.max_connections} connections to {where} stayed "
                                      f"busy for {budget_text(self.operation_timeout)}", key)
            return BackendConnectionError(f"cannot reach {where}: {text}", key)
        if isinstance(exc, errors.ReadOnlyError):
            return BackendConnectionError(f"{where} cannot serve writes now (a replica?): {text}", key)
        if isinstance(exc, errors.ResponseError) and "DB index is out of range" in text:
            return InvalidURLError("db", self.db, f"{where} has no such database")
        if isinstance(exc, errors.ResponseError) and text.startswith("CORRUPT "):
            return self.corrupt(_SCRIPT_SUFFIX.sub("", text))
        if isinstance(exc, errors.ResponseError) and "WRONGTYPE" in text:
            # Only where no check of ours ran first: some key of the namespace holds another type.
            return CorruptEntryError(f"{where}: a Redis key of namespace {self.prefix!r} holds another type than "
                                f"this backend wrote there ({text}); see docs/backends/redis.md, 'Corrupt storage'",
                                None)
        if isinstance(exc, errors.RedisError):
            return KVError(f"{where} answered with an error: {text}", key)
        return None

    def corrupt(self, text: str) -> CorruptEntryError:
        """The :class:`CorruptEntryError` for a script's ``CORRUPT KEY|BOOK|MEMBER ...`` error; for the
        bookkeeping, the message ends with the ``redis-cli`` command that removes the bad data."""
        kind, _, rest = text[len("CORRUPT "):].partition(" ")
        name, _, why = rest.partition(" ")
        where = self.where
        if kind == "KEY":
            redis_key = self.prefix + "k/" + name
            return CorruptEntryError(f"{where}: key {name!r} (Redis key {redis_key!r}) {why}: not written by rdzv; "
                                f"delete the key (KVBackend.delete, or `rdzv reset`)", name)
        cli = f"redis-cli -h {self.host} -p {self.port} -n {self.db}"
        if kind == "MEMBER":
            hex_member, _, why = why.partition(" ")
            member = bytes.fromhex(hex_member) if hex_member != "-" else b""
            printable = member.isascii() and member.decode().isprintable()
            fix = (f"ZREM {shlex.quote(name)} {shlex.quote(member.decode())}" if printable
                   else f"DEL {shlex.quote(name)}")
            return CorruptEntryError(f"{where}: this backend's bookkeeping key {name!r} holds the member {member!r}, "
                                f"which {why}: not written by rdzv; remove it: {cli} {fix}", None)
        if name[len(self.prefix):] == "#keys":  # the index cannot be rebuilt: clear the whole namespace
            pattern = shlex.quote(self.prefix.replace("*", "\\*") + "*")
            return CorruptEntryError(f"{where}: this backend's bookkeeping key {name!r} {why}: not written by rdzv; "
                                f"it indexes every key of the namespace and cannot be rebuilt, so delete the whole "
                                f"namespace (every run in it): {cli} --scan --pattern {pattern} | xargs {cli} DEL",
                                None)
        cost = _AFTER_DELETE.get(name[len(self.prefix):], "")
        return CorruptEntryError(f"{where}: this backend's bookkeeping key {name!r} {why}: not written by rdzv; "
                            f"{cost}; delete it: {cli} DEL {shlex.quote(name)}", None)


def _find_cause(exc: BaseException, kind: type[BaseException]) -> Any:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _copy_error(error: RdzvError, key: str) -> RdzvError:
    """A copy of ``error`` (met by the listener thread) for one watch to raise, about ``key`` (its prefix)."""
    copy = type(error).__new__(type(error))
    copy.__dict__.update(error.__dict__)
    copy.args = error.args
    if isinstance(copy, KVError) and not isinstance(copy, CorruptEntryError):  # CorruptEntryError names its own key
        copy.key = key
    return copy
