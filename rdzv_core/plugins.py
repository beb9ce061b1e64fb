"""Backend registry on pluggy; built-in backends register through the same hook as plugins.

A plugin is any object with a :func:`hookimpl`-marked ``rdzv_register_backends``
function, published under the entry-point group ``rdzv``::

    # pyproject.toml of a plugin distribution
    [project.entry-points.rdzv]
    postgres = "rdzv_postgres:plugin"

    # rdzv_postgres/__init__.py
    from rdzv_core.plugins import BackendSpec, hookimpl

    class plugin:
        @staticmethod
        @hookimpl
        def rdzv_register_backends():
            return [BackendSpec(schemes=("postgresql",), open=_open, capabilities=..., ...)]

Rules (after conda's plugin manager): two distributions claiming one scheme is a
:class:`~rdzv_core.errors.PluginError` naming both; a plugin that fails to load
logs a warning and the others keep working; an unknown scheme raises
:class:`~rdzv_core.errors.UnknownBackendError` listing the known schemes and,
for the built-in ones not installed, the extra that adds them.

The registry also owns a URL's meaning: :func:`parse_backend_url` parses it once, with
the rules of the backend its scheme names, and :func:`open_backend` opens that backend.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, cast

import pluggy

from .errors import InvalidURLError, PluginError, UnknownBackendError
from .kv import Capabilities, KVBackend
from .url import RENDEZVOUS_QUERY_KEYS, Converter, RendezvousURL, parse_url, split_scheme, validate_run_id

__all__ = [
    "ENTRY_POINT_GROUP",
    "hookimpl",
    "hookspec",
    "BackendSpec",
    "BackendInfo",
    "Registry",
    "get_registry",
    "backend_plugin",
    "parse_backend_url",
    "open_backend",
    "list_backends",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rdzv"
hookspec = pluggy.HookspecMarker(ENTRY_POINT_GROUP)
hookimpl = pluggy.HookimplMarker(ENTRY_POINT_GROUP)

#: Schemes this project ships whose client may be missing, and what adds them.
KNOWN_EXTRAS: dict[str, str] = {
    "etcd": "pip install 'rdzv[etcd-v2]'",
    "etcd-v2": "pip install 'rdzv[etcd-v2]'",
    "etcd-v3": "pip install 'rdzv[etcd-v3]'",
    "etcd3": "pip install 'rdzv[etcd-v3]'",
    "redis": "pip install 'rdzv[redis]'",
    "rediss": "pip install 'rdzv[redis]'",
    "postgresql": "pip install rdzv-postgres (examples/rdzv-postgres)",
    "postgres": "pip install rdzv-postgres (examples/rdzv-postgres)",
}


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin tells the registry about one backend.

    Attributes:
        schemes: URL schemes it serves, the first being its name (e.g. ``("etcd-v3", "etcd3")``).
        open: factory ``(RendezvousURL) -> KVBackend``; imports the client library
            lazily so that registering costs nothing.
        capabilities: :class:`~rdzv_core.kv.Capabilities`.
        default_port: port used for hosts without one (int or ``None``).
        query_keys: backend-specific query keys -> converter ``(field, raw) -> value``.
        requires_host: URLs of this scheme must name a host.
        uses_path: the backend reads :attr:`RendezvousURL.path` (``file://``'s
            directory). When ``False`` (the default) a URL with a path before the
            run id is refused, so that ``/team-a/job`` and ``/team-b/job`` can
            never silently name one run. A torchrun ``--rdzv-endpoint`` of such a backend is an
            absolute directory (:func:`rdzv_core.torch_api.torchrun.endpoint_url`).
        description: one line for ``rdzv backends``.
        server_endpoints: how many servers a URL of it names, for ``rdzv backends``: ``"one"``, ``"many"``
            (a client that fails over among them), ``"none"`` (no server), or the plugin's own words;
            ``None``: not said (shown as ``?``).
        default_endpoint: the host (keyspace) name an empty torchrun ``--rdzv-endpoint`` stands for;
            ``None``: an endpoint is required.

    Whether a backend's keyspace is only its process's (torchrun's run id ``none`` then meets no other
    job) is :attr:`Capabilities.multi_process <rdzv_core.kv.Capabilities.multi_process>`.
    """

    schemes: tuple[str, ...]
    open: Callable[[RendezvousURL], KVBackend]
    capabilities: Capabilities
    default_port: int | None = None
    query_keys: Mapping[str, Converter] = field(default_factory=dict)
    requires_host: bool = False
    uses_path: bool = False
    description: str = ""
    server_endpoints: str | None = None
    default_endpoint: str | None = None

    @property
    def name(self) -> str:
        """The backend's name: its first scheme."""
        return self.schemes[0]


@dataclass(frozen=True)
class BackendInfo:
    """A registered backend: its spec and the distribution that provides it."""

    spec: BackendSpec
    distribution: str


class _HookSpecs:
    @hookspec
    def rdzv_register_backends(self) -> Sequence[BackendSpec]:  # type: ignore[empty-body]
        """Return the :class:`BackendSpec` objects this plugin provides.

        Called once per process, when the registry first loads (the first
        ``open_backend``/``create_handler``/``list_backends`` call). Since 0.1.
        """


class Registry:
    """The schemes known in this process, loaded from the ``rdzv`` entry points."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self._pm.add_hookspecs(_HookSpecs)
        self._by_scheme: dict[str, BackendInfo] = {}
        self._loaded = False
        self._lock = threading.Lock()
        self.load_errors: dict[str, str] = {}

    def register(self, plugin: Any, distribution: str) -> None:
        """Register a plugin object directly (tests and embedders); entry points do the same."""
        with self._lock:
            self._add(plugin, distribution)

    def _add(self, plugin: Any, distribution: str) -> None:
        name = f"{distribution}:{getattr(plugin, '__name__', type(plugin).__name__)}"
        if self._pm.has_plugin(name):
            name = f"{name}:{id(plugin)}"
        self._pm.register(plugin, name=name)
        for impl in self._pm.hook.rdzv_register_backends.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            specs = cast(Sequence[BackendSpec], impl.function())
            for spec in specs:
                if not isinstance(spec, BackendSpec):
                    raise PluginError(f"{distribution!r} returned {spec!r}, not a BackendSpec")
                for scheme in spec.schemes:
                    other = self._by_scheme.get(scheme)
                    if other is not None:
                        raise PluginError(
                            f"scheme {scheme!r} is claimed by two distributions: "
                            f"{other.distribution!r} and {distribution!r}; uninstall one of them"
                        )
                    self._by_scheme[scheme] = BackendInfo(spec, distribution)

    def _load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist is not None else "unknown"
                try:
                    plugin = ep.load()
                except Exception as exc:  # a broken plugin must not break the others
                    self.load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
                    log.warning("rdzv plugin %r from %s failed to load: %s", ep.name, dist, exc)
                    continue
                self._add(plugin, dist)

    def backends(self) -> dict[str, BackendInfo]:
        """Scheme -> :class:`BackendInfo` for every registered scheme."""
        self._load()
        return dict(sorted(self._by_scheme.items()))

    def lookup(self, scheme: str) -> BackendInfo:
        """The backend for ``scheme``.

        Raises:
            UnknownBackendError: no installed backend claims it; lists the known ones.
        """
        known = self.backends()
        info = known.get(scheme)
        if info is None:
            hint = f" ({KNOWN_EXTRAS[scheme]} adds it)" if scheme in KNOWN_EXTRAS else ""
            raise UnknownBackendError(
                "scheme", scheme, f"was not recognized{hint}. Choose one of: {', '.join(known) or '(none)'}"
            )
        return info


def backend_plugin(*specs: BackendSpec) -> Any:
    """An entry-point object whose ``rdzv_register_backends`` hook returns ``specs``.

    Example (the built-ins do exactly this)::

        plugin = backend_plugin(BackendSpec(schemes=("memory",), open=_open, capabilities=...))
    """

    class _Plugin:
        @staticmethod
        @hookimpl
        def rdzv_register_backends() -> list[BackendSpec]:
            return list(specs)

    _Plugin.__name__ = _Plugin.__qualname__ = f"plugin[{','.join(s.name for s in specs)}]"
    return _Plugin


_REGISTRY: Registry | None = None
_REGISTRY_LOCK = threading.Lock()


def get_registry() -> Registry:
    """The process-wide :class:`Registry` (created on first use)."""
    global _REGISTRY
    with _REGISTRY_LOCK:
        if _REGISTRY is None:
            _REGISTRY = Registry()
        return _REGISTRY


def list_backends() -> dict[str, BackendInfo]:
    """Every registered scheme -> :class:`BackendInfo` (spec with capabilities, distribution)."""
    return get_registry().backends()


def parse_backend_url(
    url: str | RendezvousURL, *, require_run_id: bool = True
) -> tuple[BackendInfo, RendezvousURL]:
    """Find the backend for ``url``'s scheme and parse the URL with that backend's rules.

    A :class:`RendezvousURL` is not parsed again: it is checked against the backend's
    rules (hosts without a port get its default port; its query keys must be the
    backend's) and returned with the backend's :attr:`~RendezvousURL.query_keys`.

    Raises:
        UnknownBackendError: no installed backend claims the scheme.
        InvalidURLError: the URL or one of its values is invalid.
    """
    if isinstance(url, RendezvousURL):
        info = get_registry().lookup(url.scheme)
        parsed = _conform(url, info.spec, require_run_id)
    else:
        scheme, _ = split_scheme(url)  # the URL as a whole is checked before its scheme is looked up
        info = get_registry().lookup(scheme)
        spec = info.spec
        parsed = parse_url(url, default_port=spec.default_port, extra_keys=spec.query_keys,
                           require_host=spec.requires_host, require_run_id=require_run_id)
    _check_path_and_credentials(parsed, info.spec)
    return info, parsed


def _conform(url: RendezvousURL, spec: BackendSpec, require_run_id: bool) -> RendezvousURL:
    """``url`` (built, not parsed) checked against ``spec`` as :func:`~rdzv_core.url.parse_url` would."""
    if spec.requires_host and not url.hosts:
        raise InvalidURLError("host", "", f"{url.scheme}:// needs at least one HOST[:PORT]")
    if require_run_id or url.run_id:
        validate_run_id(url.run_id)
    for key, value in url.params.items():
        if key not in RENDEZVOUS_QUERY_KEYS and key not in spec.query_keys:
            raise InvalidURLError(key, value, f"not a query key of {url.scheme}:// URLs")
    hosts = tuple((h, spec.default_port if p is None else p) for h, p in url.hosts)
    return dataclasses.replace(url, hosts=hosts, query_keys=spec.query_keys)


def _check_path_and_credentials(parsed: RendezvousURL, spec: BackendSpec) -> None:
    scheme = parsed.scheme
    if parsed.path and not spec.uses_path:
        raise InvalidURLError(
            "path",
            parsed.path,
            f"{scheme}:// URLs take no path before the run id ({scheme}://HOST/RUN_ID); "
            "keys of different jobs are separated by the run id (and ?prefix= where the backend has it)",
        )
    if (parsed.username or parsed.password) and not spec.capabilities.auth:
        raise InvalidURLError(
            "user", parsed.username or "", f"{scheme}:// backends take no credentials (user:password@); remove them"
        )


def open_backend(url: str | RendezvousURL) -> KVBackend:
    """Open the KV backend named by ``url`` (the run id segment may be empty).

    Returns:
        A :class:`KVBackend`; close it (or use it as a context manager) when done.

    Raises:
        UnknownBackendError, InvalidURLError: see :func:`parse_backend_url`.
        BackendUnavailableError: the server cannot be reached.
    """
    info, parsed = parse_backend_url(url, require_run_id=False)
    return info.spec.open(parsed)
