"""pytest plugin of the conformance suite (loaded through the ``pytest11`` entry point).

What a backend author provides — at most three things:

1. ``--rdzv-url URL`` (repeatable): the backend's base URL *without* a run id,
   ending in ``/``; e.g. ``--rdzv-url "myscheme://127.0.0.1:1234/"``.
   Placeholders: ``{tmp}`` becomes a fresh temporary directory of the session;
   ``{server:NAME}`` becomes ``HOST:PORT`` of the server controller returned by
   the fixture ``rdzv_server_NAME`` (define one in your ``conftest.py``; this
   project ships ``rdzv_server_redis``, ``rdzv_server_etcd`` and ``rdzv_server_sentinel``).
   Without any ``--rdzv-url`` the suite runs against ``memory://`` and ``file://{tmp}/``.
2. Optionally, a server controller (for the ``faults`` group): the object the
   ``rdzv_server_NAME`` fixture returns, with ``address`` (``"HOST:PORT"``),
   ``kill()``, ``start()``, ``pause()`` and ``resume()``.
3. Optionally, override the ``kv_factory`` fixture to open backends yourself.

Run: ``pytest --pyargs conformance_tests --rdzv-url "myscheme://host:1234/"``;
select groups with ``-m protocol``, ``-m rendezvous``, ``-m store``, ``-m faults``.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import uuid
from typing import Any, Callable, Iterator

import pytest

from rdzv_core import KVBackend, list_backends, open_backend

from .multihost import rdzv_hosts, rdzv_hosts_module  # noqa: F401  (fixtures)
from .servers import rdzv_server_etcd, rdzv_server_redis, rdzv_server_sentinel  # noqa: F401  (fixtures)

#: The scenarios' fixtures ``run_id`` and ``agents``, registered with this plugin.
pytest_plugins = ["conformance_tests.agents"]

DEFAULT_URLS = ("memory://conformance/", "file://{tmp}/")
_PLACEHOLDER = re.compile(r"\{server:([A-Za-z0-9_]+)\}")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rdzv", "rdzv conformance suite")
    group.addoption(
        "--rdzv-url",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of a backend to test (repeatable); default: memory and file",
    )


#: The suite's markers, registered by the plugin so that ``--strict-markers`` works in a plugin author's CI.
MARKERS = {
    "protocol": "KV protocol contract (rdzv conformance suite)",
    "rendezvous": "rendezvous state-machine scenarios (rdzv conformance suite)",
    "store": "c10d Store contract (rdzv conformance suite)",
    "faults": "server faults and bad input; some need a server controller (rdzv conformance suite)",
    "multihost": "hosts in network namespaces (conformance_tests.multihost); skipped unless root",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rdzv_base_url" in metafunc.fixturenames:
        urls = metafunc.config.getoption("--rdzv-url") or list(DEFAULT_URLS)
        metafunc.parametrize("rdzv_base_url", urls, indirect=True, ids=[_url_id(u) for u in urls])


def _url_id(url: str) -> str:
    return url.split("://", 1)[0]


@pytest.fixture(scope="session")
def rdzv_tmp_dir() -> Iterator[str]:
    """A temporary directory for the whole session (the ``{tmp}`` placeholder)."""
    with tempfile.TemporaryDirectory(prefix="rdzv-conformance-") as path:
        yield path


@pytest.fixture
def rdzv_base_url(request: pytest.FixtureRequest, rdzv_tmp_dir: str) -> str:
    """The backend base URL under test, placeholders resolved, ending in ``/``."""
    url: str = request.param
    url = url.replace("{tmp}", rdzv_tmp_dir)
    for name in _PLACEHOLDER.findall(url):
        server = request.getfixturevalue(f"rdzv_server_{name}")
        url = url.replace(f"{{server:{name}}}", server.address)
    base, _, query = url.partition("?")
    if not base.endswith("/"):
        base += "/"
    return base + (f"?{query}" if query else "")


@pytest.fixture
def rdzv_server(request: pytest.FixtureRequest) -> Any:
    """The server controller behind the URL under test, or a skip saying why there is none."""
    url: str = request.getfixturevalue("rdzv_base_url")
    raw: str = request.node.callspec.params["rdzv_base_url"]
    names = _PLACEHOLDER.findall(raw)
    if not names:
        pytest.skip(f"{_url_id(url)}: no server controller (URL has no {{server:NAME}} placeholder)")
    return request.getfixturevalue(f"rdzv_server_{names[0]}")


@contextlib.contextmanager
def backends_opened(url_of: Callable[..., str]) -> Iterator[Callable[..., KVBackend]]:
    """Yield ``open_(*args, **kwargs)`` -> ``open_backend(url_of(*args, **kwargs))``; every backend it
    opened is closed on exit. For fixtures that hand a test several independent clients."""
    opened: list[KVBackend] = []

    def open_(*args: Any, **kwargs: Any) -> KVBackend:
        backend = open_backend(url_of(*args, **kwargs))
        opened.append(backend)
        return backend

    try:
        yield open_
    finally:
        for backend in opened:
            backend.close()


@pytest.fixture
def kv_factory(rdzv_base_url: str) -> Iterator[Callable[[], KVBackend]]:
    """Open independent backend clients for the URL under test; all are closed after the test."""
    with backends_opened(lambda: rdzv_base_url) as factory:
        yield factory


@pytest.fixture
def kv(kv_factory: Callable[[], KVBackend]) -> KVBackend:
    """One open backend client."""
    return kv_factory()


@pytest.fixture
def key_prefix() -> str:
    """A fresh key prefix (``"conformance/<uuid>/"``) so tests never see each other's keys."""
    return f"conformance/t{uuid.uuid4().hex}/"


@pytest.fixture
def capabilities(rdzv_base_url: str) -> Any:
    """The :class:`~rdzv_core.kv.Capabilities` the backend under test declares."""
    scheme = rdzv_base_url.split("://", 1)[0]
    return list_backends()[scheme].spec.capabilities


@pytest.fixture
def rdzv_url(rdzv_base_url: str) -> Callable[..., str]:
    """Build a full rendezvous URL: ``rdzv_url(run_id=None, **query)``; a fresh run id by default."""

    def build(run_id: str | None = None, **query: Any) -> str:
        base, _, fixed = rdzv_base_url.partition("?")
        rid = run_id or f"run{uuid.uuid4().hex[:12]}"
        pairs = [fixed] if fixed else []
        pairs += [f"{k}={v}" for k, v in query.items()]
        return base + rid + (("?" + "&".join(pairs)) if pairs else "")

    return build
