"""Rendezvous URLs: one form for every backend.

::

    SCHEME://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...]/[PATH/]RUN_ID?key=value&...

The run id is always the last path segment; what comes between the host list
and the run id is ``path`` (the directory for ``file://``). IPv6 hosts are
bracketed (``[::1]:2379``); a host without a port takes the scheme's default.

Every query key is converted by one table (:data:`RENDEZVOUS_QUERY_KEYS`, plus
the backend's own ``BackendSpec.query_keys``); a bad key or value raises
:class:`~rdzv_core.errors.InvalidURLError` naming the field and the value.
The password never appears in ``repr``, ``str`` or any error message.

A URL's text is parsed once, with its backend's rules (:func:`rdzv_core.parse_backend_url`,
which calls :func:`parse_url`); whoever adds query keys afterwards (``rdzv-run``'s
``--rdzv-conf``/``--nnodes``, torchrun's parameters) uses :meth:`RendezvousURL.with_params`
on the parsed value, which converts them with the same table.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .errors import InvalidURLError

__all__ = [
    "RendezvousURL",
    "parse_url",
    "parse_netloc",
    "parse_path",
    "split_scheme",
    "redact_text",
    "RENDEZVOUS_QUERY_KEYS",
    "QUERY_ALIASES",
    "validate_run_id",
    "to_int",
    "to_positive_float",
    "to_str",
    "to_bool",
    "RANK_POLICIES",
    "DEFAULT_RANK_POLICY",
    "parse_node_labels",
    "NODE_CHECK_ACTIONS",
]

MAX_RUN_ID_CHARS = 128
_RUN_ID = re.compile(r"[A-Za-z0-9_.\-=+:@~]+")
_SCHEME = re.compile(r"[a-z][a-z0-9+.\-]*")


#: Largest int a query value may hold (node counts, database numbers, pool sizes).
MAX_INT = 1_000_000
#: Largest number of seconds a query value may hold (about 115 days): a finite time that
#: every client library and server can represent (``1e308`` overflowed Redis's milliseconds).
MAX_SECONDS = 10_000_000.0


#: What a numeric query value may look like: ASCII only, no ``_`` separators (``int``/``float`` accept
#: ``" 1"``, ``"1_0"`` and non-ASCII digits: a value the user did not mean must not pass as a number).
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _check_number_text(field_name: str, raw: str) -> None:
    """Refuse a numeric value with surrounding whitespace (``min_nodes=%201``), naming the field."""
    if raw != raw.strip():
        raise InvalidURLError(field_name, raw, "surrounding whitespace is not allowed in a number")


def to_int(field_name: str, raw: str, minimum: int = 0, maximum: int = MAX_INT) -> int:
    """Convert a query value to an int in ``[minimum, maximum]`` or raise :class:`InvalidURLError`."""
    _check_number_text(field_name, raw)
    if not _INT_TEXT.fullmatch(raw):
        raise InvalidURLError(field_name, raw, "not an integer (ASCII digits, optionally signed)")
    value = int(raw, 10)
    if value < minimum:
        raise InvalidURLError(field_name, raw, f"must be >= {minimum}")
    if value > maximum:
        raise InvalidURLError(field_name, raw, f"must be <= {maximum}")
    return value


def to_positive_float(field_name: str, raw: str) -> float:
    """Convert a query value to seconds in ``(0, MAX_SECONDS]`` or raise :class:`InvalidURLError`."""
    _check_number_text(field_name, raw)
    if not _FLOAT_TEXT.fullmatch(raw):
        raise InvalidURLError(field_name, raw, "not a number of seconds (ASCII decimal, e.g. 5 or 0.5 or 1e3)")
    value = float(raw)
    if not (0 < value <= MAX_SECONDS):
        raise InvalidURLError(field_name, raw, f"must be a number of seconds > 0 and <= {MAX_SECONDS:g}")
    return value


def to_str(field_name: str, raw: str) -> str:
    """Accept a non-empty string without control characters."""
    if not raw or any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise InvalidURLError(field_name, raw, "must be a non-empty string without control characters")
    return raw


def to_bool(field_name: str, raw: str) -> bool:
    """Accept 1/0, true/false, yes/no, on/off."""
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise InvalidURLError(field_name, raw, "must be one of 1/0, true/false, yes/no, on/off")


def _seconds_or_forever(field_name: str, raw: str) -> float | None:
    """Seconds as :func:`to_positive_float`, or ``None`` (no limit) for ``0`` or ``none``."""
    if raw.lower() == "none" or (_FLOAT_TEXT.fullmatch(raw) and float(raw) == 0):
        return None
    try:
        return to_positive_float(field_name, raw)
    except InvalidURLError as exc:
        raise InvalidURLError(field_name, raw, f"{exc.reason}, or 0 / none for no limit") from None


def _prefix(field_name: str, raw: str) -> str:
    stripped = raw.strip("/")
    parts = stripped.split("/") if stripped else []
    for part in parts:
        if part in ("", ".", "..") or not _RUN_ID.fullmatch(part):
            raise InvalidURLError(field_name, raw, f"segment {part!r} is empty, '.'/'..' or has unsafe characters")
    return stripped


#: The rank policies (query key ``rank_policy``; ``rdzv_core.rendezvous.ranks``, ``docs/ranks.md``).
RANK_POLICIES = ("join", "stable", "topology")
DEFAULT_RANK_POLICY = "stable"
_LABEL_PART = re.compile(r"[^\s=,]+")


#: How a round that follows a final one forms (query key ``reform``; ``docs/design.md``, "Re-forming"):
#: ``fast`` freezes it once nobody else is expected, ``last_call`` waits out the last call as a first round does.
REFORM_RULES = ("fast", "last_call")
DEFAULT_REFORM = "fast"


def _reform(field_name: str, raw: str) -> str:
    if raw not in REFORM_RULES:
        raise InvalidURLError(field_name, raw, f"must be one of {', '.join(REFORM_RULES)}")
    return raw


#: Where a run's node ledger lives: the run's own keys, or the key prefix (shared by every run under it).
LEDGER_SCOPES = ("run", "prefix")


def _one_of(field_name: str, raw: str, choices: tuple[str, ...]) -> str:
    if raw not in choices:
        raise InvalidURLError(field_name, raw, f"must be one of {', '.join(choices)}")
    return raw


def _rank_policy(field_name: str, raw: str) -> str:
    if raw not in RANK_POLICIES:
        raise InvalidURLError(field_name, raw, f"must be one of {', '.join(RANK_POLICIES)}")
    return raw


def parse_node_labels(field_name: str, raw: str) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE[,KEY=VALUE...]`` (e.g. ``rack=r1,switch=s3``) as pairs in the order given; ``""``: none.

    Raises:
        InvalidURLError: naming ``field_name``: a part that is not ``KEY=VALUE`` of non-empty text
            without spaces, ``=`` or ``,``, or a key given twice.
    """
    pairs: list[tuple[str, str]] = []
    for part in raw.split(",") if raw else []:
        key, eq, value = part.partition("=")
        if not (eq and _LABEL_PART.fullmatch(key) and _LABEL_PART.fullmatch(value)):
            raise InvalidURLError(field_name, raw, f"{part!r} is not KEY=VALUE (non-empty, without spaces, '=' or "
                                                   "','); labels are KEY=VALUE[,KEY=VALUE...], e.g. rack=r1,switch=s3")
        if key in dict(pairs):
            raise InvalidURLError(field_name, raw, f"label {key!r} given twice")
        pairs.append((key, value))
    return tuple(pairs)


def _node_labels(field_name: str, raw: str) -> str:
    parse_node_labels(field_name, raw)
    return raw


def node_name(field_name: str, raw: str) -> str:
    """A node's name in the run's ledger (``node_name``): 1-253 printable characters, no white space.

    Raises:
        InvalidURLError: otherwise (names the field and the value).
    """
    if not 1 <= len(raw) <= 253 or not raw.isprintable() or any(c.isspace() for c in raw):
        raise InvalidURLError(field_name, raw, "must be 1-253 printable characters without white space "
                              "(the scheduler's node name or the host name)")
    return raw


#: What a node does while a node check fails (query key ``node_check_action``; :mod:`rdzv_core.node_checks`).
NODE_CHECK_ACTIONS = ("wait", "exit")
#: Most MiB ``node_check_min_free_mb`` may ask for (1e15 MiB, about 1 ZiB: more than any file system).
MAX_FREE_MB = 1e15


def _no_control_chars(field_name: str, raw: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise InvalidURLError(field_name, raw, "must not contain control characters")
    return raw


def _node_check_dirs(field_name: str, raw: str) -> str:
    """``DIR[:DIR...]`` (``""``: none), kept as text (:meth:`rdzv_core.node_checks.CheckSettings.from_query`
    splits it)."""
    _no_control_chars(field_name, raw)
    if raw and not all(raw.split(":")):
        raise InvalidURLError(field_name, raw, "an empty directory between ':' (directories are DIR[:DIR...])")
    return raw


def _free_mb(field_name: str, raw: str) -> float:
    _check_number_text(field_name, raw)
    if not _FLOAT_TEXT.fullmatch(raw) or not 0 <= float(raw) <= MAX_FREE_MB:
        raise InvalidURLError(field_name, raw, f"must be a number of MiB >= 0 and <= {MAX_FREE_MB:g}")
    return float(raw)


def _node_check_action(field_name: str, raw: str) -> str:
    if raw not in NODE_CHECK_ACTIONS:
        raise InvalidURLError(field_name, raw, f"must be one of {', '.join(NODE_CHECK_ACTIONS)}")
    return raw


def _factor(field_name: str, raw: str) -> float:
    """A factor > 1 (``network_check_factor``)."""
    _check_number_text(field_name, raw)
    if not _FLOAT_TEXT.fullmatch(raw) or not 1 < float(raw) <= 1e9:
        raise InvalidURLError(field_name, raw, "must be a number > 1 and <= 1e9")
    return float(raw)


def _mebibytes(field_name: str, raw: str) -> float:
    """MiB > 0 (``network_check_mib``)."""
    _check_number_text(field_name, raw)
    if not _FLOAT_TEXT.fullmatch(raw) or not 0 < float(raw) <= 1e6:
        raise InvalidURLError(field_name, raw, "must be a number of MiB > 0 and <= 1e6")
    return float(raw)


Converter = Callable[[str, str], Any]

#: Query keys understood for every backend (canonical name -> converter).
RENDEZVOUS_QUERY_KEYS: dict[str, Converter] = {
    "min_nodes": lambda f, v: to_int(f, v, 1),
    "max_nodes": lambda f, v: to_int(f, v, 1),
    "timeout": to_positive_float,
    "last_call_timeout": to_positive_float,
    "keep_alive_ttl": to_positive_float,
    "closed_run_ttl": _seconds_or_forever,
    "prefix": _prefix,
    "operation_timeout": to_positive_float,
    "rank_policy": _rank_policy,
    "reform": _reform,
    "node_rank": lambda f, v: to_int(f, v, 0),
    "node_labels": _node_labels,
    "node_order": lambda f, v: to_int(f, v, 0),
    "incarnation": lambda f, v: to_int(f, v, 0),
    # checks before joining (rdzv_core.node_checks, docs/node-health.md); node_check="" means none
    "node_check": _no_control_chars,
    "node_check_timeout": to_positive_float,
    "node_check_dirs": _node_check_dirs,
    "node_check_min_free_mb": _free_mb,
    "node_check_action": _node_check_action,
    "node_check_interval": to_positive_float,
    "node_check_plugins": to_bool,
    "node_name": lambda f, v: node_name(f, v),
    "quarantine_after": lambda f, v: to_int(f, v, 0),
    "quarantine_window": to_positive_float,
    "quarantine_cooldown": to_positive_float,
    "ledger_scope": lambda f, v: _one_of(f, v, LEDGER_SCOPES),
    # the network check of every formed round (rdzv_core.torch_api.netcheck, docs/node-health.md)
    "network_check": to_bool,
    "network_check_mib": _mebibytes,
    "network_check_factor": _factor,
    "network_check_timeout": to_positive_float,
}

#: Other names accepted for the canonical keys (torchelastic's and torch's names).
QUERY_ALIASES: dict[str, str] = {
    "min_workers": "min_nodes",
    "max_workers": "max_nodes",
    "etcd_prefix": "prefix",
    "join_timeout": "timeout",
}


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is safe as one key segment, else raise :class:`InvalidURLError`.

    A run id is 1-128 characters from ``A-Za-z0-9_.-=+:@~``, and not ``.`` or ``..``:
    it can never escape its key prefix.
    """
    if not isinstance(run_id, str) or not run_id:
        raise InvalidURLError("run_id", run_id, "missing: the run id is the URL's last path segment")
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise InvalidURLError("run_id", run_id[:40] + "...", f"longer than {MAX_RUN_ID_CHARS} characters")
    if run_id in (".", "..") or not _RUN_ID.fullmatch(run_id):
        raise InvalidURLError(
            "run_id", run_id, "may use only A-Z a-z 0-9 _ . - = + : @ ~ and must not be '.' or '..'"
        )
    return run_id


@dataclass(frozen=True)
class RendezvousURL:
    """A parsed rendezvous URL.

    Attributes:
        scheme: lower-case scheme (``"etcd"``, ``"file"``, ...).
        hosts: ``((host, port), ...)``; port ``None`` when neither given nor defaulted.
        path: the segments between the host list and the run id, joined by ``/``
            (``""`` if none); for ``file://`` the directory, without its leading ``/``.
        run_id: the last path segment (``""`` when the URL ends with ``/`` and no
            run id was required).
        params: converted query values, by canonical key name.
        username: user from the URL, or ``None``.
        password: password from the URL, or ``None`` (never shown by ``repr``).
        query_keys: the backend's own query keys and converters the URL was parsed with
            (:meth:`with_params` converts new values with them and :data:`RENDEZVOUS_QUERY_KEYS`).
        spelled: canonical key -> the name it was given under (an alias), for messages.
    """

    scheme: str
    hosts: tuple[tuple[str, int | None], ...]
    path: str
    run_id: str
    params: Mapping[str, Any] = field(default_factory=dict)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    query_keys: Mapping[str, Converter] = field(default_factory=dict, repr=False, compare=False)
    spelled: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def redacted(self) -> str:
        """The URL as text with the password replaced by ``***``."""
        auth = ""
        if self.username is not None or self.password is not None:
            auth = (self.username or "") + (":***" if self.password is not None else "") + "@"
        hosts = ",".join(_format_host(h, p) for h, p in self.hosts)
        path = "/".join(x for x in (self.path, self.run_id) if x)
        query = urllib.parse.urlencode({k: v for k, v in self.params.items()})
        return f"{self.scheme}://{auth}{hosts}/{path}" + (f"?{query}" if query else "")

    def __str__(self) -> str:
        return self.redacted()

    def key_name(self, key: str) -> str:
        """The name canonical query ``key`` was given under (``"min_workers"`` for ``min_nodes``), else ``key``."""
        return self.spelled.get(key, key)

    def with_params(self, values: Mapping[str, Any], *, replace: bool = True) -> RendezvousURL:
        """A copy with the query ``values`` set, as if they had been written in the URL's query.

        Keys may be aliases (:data:`QUERY_ALIASES`); each value (``str(value)`` if not a str)
        is converted by the same table as the URL's own (:data:`RENDEZVOUS_QUERY_KEYS` and
        :attr:`query_keys`). A key given here replaces the same key (under any name) in the
        URL; with ``replace=False`` only the keys the URL lacks are added.

        Raises:
            InvalidURLError: naming the key as given: unknown, a bad value, given twice
                (under two names), or ``min_nodes`` greater than ``max_nodes`` afterwards.
        """
        params, spelled = dict(self.params), dict(self.spelled)
        given: set[str] = set()
        for raw_key, value in values.items():
            raw = value if isinstance(value, str) else str(value)
            key = _canonical_key(raw_key, raw, self.query_keys)
            if key in given:
                raise InvalidURLError(raw_key, raw, "given more than once")
            given.add(key)
            if not replace and key in params:
                continue
            params[key] = _converter(key, self.query_keys)(raw_key, raw)
            spelled.pop(key, None)
            if raw_key != key:
                spelled[key] = raw_key
        _check_node_range(params, spelled)
        return dataclasses.replace(self, params=params, spelled=spelled)


def _converter(key: str, extra: Mapping[str, Converter]) -> Converter:
    return extra[key] if key in extra else RENDEZVOUS_QUERY_KEYS[key]


def _canonical_key(raw_key: str, raw_value: str, extra: Mapping[str, Converter]) -> str:
    """``raw_key``'s canonical name, or :class:`InvalidURLError` listing the valid keys."""
    key = QUERY_ALIASES.get(raw_key, raw_key)
    if key not in RENDEZVOUS_QUERY_KEYS and key not in extra:
        valid = ", ".join(sorted(set(RENDEZVOUS_QUERY_KEYS) | set(extra) | set(QUERY_ALIASES)))
        raise InvalidURLError(raw_key, raw_value, "unknown query key (credentials go in the URL's "
                                                  f"user:password@); valid keys: {valid}")
    return key


def _check_node_range(params: Mapping[str, Any], spelled: Mapping[str, str]) -> None:
    """Raise :class:`InvalidURLError` (naming the keys as given) if ``min_nodes`` > ``max_nodes``."""
    lo, hi = params.get("min_nodes"), params.get("max_nodes")
    if lo is not None and hi is not None and lo > hi:
        lo_name, hi_name = spelled.get("min_nodes", "min_nodes"), spelled.get("max_nodes", "max_nodes")
        raise InvalidURLError(lo_name, lo, f"greater than {hi_name}={hi}")


def _format_host(host: str, port: int | None) -> str:
    shown = f"[{host.replace('%', '%25')}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


_ZONE = re.compile(r"[A-Za-z0-9_.~\-]+")


def _ipv6_host(item: str, text: str) -> str:
    """The address inside ``[...]``: ``fe80::1`` or, with an RFC 6874 zone id, ``fe80::1%eth0``
    (written ``[fe80::1%25eth0]``; the result is the form ``socket.getaddrinfo`` takes)."""
    address, pct, zone = text.partition("%")
    if not address or not all(c in "0123456789abcdefABCDEF:." for c in address) or ":" not in address:
        raise InvalidURLError("host", item, "not an IPv6 address")
    if not pct:
        return address
    if not zone.startswith("25"):
        raise InvalidURLError("host", item, "an IPv6 zone id is written '%25' then the zone (RFC 6874): "
                                            "[fe80::1%25eth0]")
    if not _ZONE.fullmatch(zone[2:]):
        raise InvalidURLError("host", item, "the IPv6 zone id after '%25' must be an interface name or number "
                                            "(A-Z a-z 0-9 _ . ~ -)")
    return f"{address}%{zone[2:]}"


def _parse_host(item: str, default_port: int | None) -> tuple[str, int | None]:
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise InvalidURLError("host", item, "unterminated '[' in IPv6 address")
        host, rest = _ipv6_host(item, item[1:end]), item[end + 1 :]
        if rest and not rest.startswith(":"):
            raise InvalidURLError("host", item, "unexpected text after ']'")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text = item.partition(":")
        if not sep:
            port_text = None
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", host or ""):
            raise InvalidURLError("host", item, "not a host name or address")
    if port_text is None or port_text == "":
        if port_text == "":
            raise InvalidURLError("port", item, "empty port")
        return host, default_port
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 < int(port_text) < 65536:  # ASCII: "٣".isdigit()
        raise InvalidURLError("port", port_text, "must be an integer 1..65535")
    return host, int(port_text)


def split_scheme(url: str) -> tuple[str, str]:
    """The checks of a URL as a whole (the first steps of :func:`parse_url`): ``(scheme, rest)``.

    ``scheme`` is lower-cased; ``rest`` is the text after ``://``, without a fragment.
    A caller that adds query keys to a user's URL checks it with this first, so that
    an error echoes the URL as the user wrote it.

    Raises:
        InvalidURLError: naming ``url`` (not a str, control characters, no ``://``, a
            ``#fragment``; the password shown as ``***``) or ``scheme``.
    """
    if not isinstance(url, str):
        raise InvalidURLError("url", type(url).__name__, "a rendezvous URL is a str")
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise InvalidURLError("url", redact_text(url), "contains control characters")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidURLError("url", redact_text(url), "expected SCHEME://HOSTS/RUN_ID")
    scheme = scheme.lower()
    if not _SCHEME.fullmatch(scheme):
        raise InvalidURLError("scheme", scheme, "not a URL scheme")
    rest, fragment, _ = rest.partition("#")
    if fragment:  # even an empty one: "#" is not part of any URL this parses
        raise InvalidURLError("url", redact_text(url), "fragments ('#...') are not allowed")
    return scheme, rest


def parse_url(
    url: str,
    *,
    default_port: int | None = None,
    extra_keys: Mapping[str, Converter] | None = None,
    require_host: bool = False,
    require_run_id: bool = True,
) -> RendezvousURL:
    """Parse and validate a rendezvous URL.

    Args:
        url: the URL text.
        default_port: port for hosts that give none (the scheme's default).
        extra_keys: backend-specific query keys and their converters.
        require_host: the scheme needs at least one host.
        require_run_id: the URL must end with a run id.

    Returns:
        :class:`RendezvousURL`.

    Raises:
        InvalidURLError: naming the field (``url``, ``scheme``, ``host``, ``port``,
            ``run_id``, a query key, ``min_nodes``/``max_nodes``) and the value.
    """
    scheme, rest = split_scheme(url)
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    hosts, username, password = parse_netloc(netloc, default_port)
    if require_host and not hosts:
        raise InvalidURLError("host", netloc, f"{scheme}:// needs at least one HOST[:PORT]")
    parts = path.split("/") if slash else []
    segments = [_unquote("run_id" if i == len(parts) - 1 else "path", s) for i, s in enumerate(parts)]
    run_id = segments[-1] if segments else ""
    if require_run_id or run_id:
        validate_run_id(run_id)
    path_part = "/".join(segments[:-1])
    if any(s in ("", ".", "..") for s in segments[:-1]) and path_part:
        raise InvalidURLError("path", path_part, "empty, '.' or '..' segments are not allowed")
    extra = extra_keys or {}
    params, spelled = _parse_query(query, extra)
    _check_node_range(params, spelled)
    return RendezvousURL(scheme, hosts, path_part, run_id, params, username, password, extra, spelled)


def parse_netloc(
    netloc: str, default_port: int | None = None
) -> tuple[tuple[tuple[str, int | None], ...], str | None, str | None]:
    """``[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...]`` as ``(hosts, username, password)``.

    User and password are percent-decoded; a host without a port gets ``default_port``.

    Raises:
        InvalidURLError: naming ``host``, ``port``, ``username`` or ``password`` (shown as ``***``).
    """
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, has_pw, pw = userinfo.partition(":")
        username = _unquote("username", user) if user else None
        password = _unquote("password", pw, secret=True) if has_pw else None
    hosts = tuple(_parse_host(h, default_port) for h in netloc.split(",")) if netloc else ()
    return hosts, username, password


def parse_path(directory: str) -> str:
    """A directory as :attr:`RendezvousURL.path`: ``/a/b/`` -> ``a/b``, taken literally (no escapes).

    Raises:
        InvalidURLError: on ``path``: an empty, ``.`` or ``..`` segment (``/a//b``, ``/a/../b``).
    """
    path = directory.strip("/")
    if path and any(s in ("", ".", "..") for s in path.split("/")):
        raise InvalidURLError("path", path, "empty, '.' or '..' segments are not allowed")
    return path


_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _unquote(field: str, text: str, *, secret: bool = False) -> str:
    """Percent-decode one URL part as UTF-8, strictly: a ``%`` not followed by two hex digits, or
    escapes that are not UTF-8, raise :class:`InvalidURLError` naming ``field`` (the value shown as
    ``***`` when ``secret``) -- :func:`urllib.parse.unquote` would keep the first and replace the second."""
    shown = "***" if secret else text
    if _BAD_ESCAPE.search(text):
        raise InvalidURLError(field, shown, "'%' must start an escape of two hex digits (write a literal '%' as %25)")
    try:
        return urllib.parse.unquote(text, errors="strict")
    except UnicodeDecodeError:
        raise InvalidURLError(field, shown, "percent-escapes that are not UTF-8") from None


def _parse_query(query: str, extra: Mapping[str, Converter]) -> tuple[dict[str, Any], dict[str, str]]:
    """The converted query values by canonical key, and canonical key -> alias it was given under."""
    params: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidURLError("query", query, "not key=value pairs joined by '&'") from None
    for raw_key, raw_value in pairs:
        key = _canonical_key(raw_key, raw_value, extra)
        if key in params:
            raise InvalidURLError(raw_key, raw_value, "given more than once")
        params[key] = _converter(key, extra)(raw_key, raw_value)
        if raw_key != key:
            spelled[key] = raw_key
    return params, spelled


def redact_text(url: str) -> str:
    """``url`` with any ``user:password@`` password replaced by ``***`` -- also in text that is not
    a well-formed URL (``redis:/u:pw@h/x``, ``u:pw@h/x``), which error messages echo."""
    return re.sub(r"([^/@:]*:)[^/@]*@", r"\1***@", url)
