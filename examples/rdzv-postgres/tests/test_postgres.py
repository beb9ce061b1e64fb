"""What the conformance suite cannot check generically: URL rules, auth, TLS, errors, restarts.

The suite itself runs with (see README.md)::

    python -m pytest --pyargs conformance_tests -p rdzv_postgres.testing \\
        --rdzv-url 'postgresql://{server:postgres}/?history_limit=1000'
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from typing import Iterator

import psycopg
import pytest

import rdzv_postgres
from conformance_tests.servers import free_port
from rdzv_core import (
    BackendConnectionError,
    BackendTimeoutError,
    BackendUnavailableError,
    InvalidURLError,
    KVBackend,
    list_backends,
    open_backend,
)
from rdzv_postgres import backend
from rdzv_postgres.testing import PostgresServer


@pytest.fixture
def server(rdzv_server_postgres: PostgresServer) -> PostgresServer:
    return rdzv_server_postgres


def _open(url: str) -> KVBackend:
    return open_backend(url)


def test_registered_through_the_entry_point_without_importing_psycopg() -> None:
    code = ("import sys, rdzv_core; b = rdzv_core.list_backends();"
            "print(b['postgresql'].distribution, 'psycopg' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["rdzv-postgres", "False"], out.stderr
    assert list_backends()["postgres"].spec.name == "postgresql"


def test_declared_capabilities_are_the_backends() -> None:
    assert rdzv_postgres.CAPABILITIES == backend.CAPABILITIES == backend.PostgresBackend.capabilities


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("postgresql://h1:5432,h2:5432/run", "host"),
        ("postgresql://127.0.0.1:5432/mydb/run", "path"),
        ("postgresql://127.0.0.1:5432/run?namespace=Bad-Name", "namespace"),
        ("postgresql://127.0.0.1:5432/run?history_limit=5", "history_limit"),
        ("postgresql://127.0.0.1:5432/run?sslmode=sometimes", "sslmode"),
        ("postgresql://127.0.0.1:5432/run?dbnmae=x", "dbnmae"),
        ("postgresql:///run", "host"),
    ],
)
def test_bad_urls_name_the_field(url: str, field: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        open_backend(url)
    assert info.value.field == field


def test_dbname_query_key_and_run_id(server: PostgresServer) -> None:
    server.sql("CREATE DATABASE jobs")
    with _open(server.url("my-run", dbname="jobs", namespace="nsjobs")) as kv:
        kv.put("a", b"1")
    with psycopg.connect(host=server.host, port=server.port, user=server.user, dbname="jobs") as conn:
        assert conn.execute("SELECT value FROM nsjobs_kv WHERE key = 'a'").fetchone() == (b"1",)
    with pytest.raises(InvalidURLError) as info:
        _open(server.url("my-run", dbname="no_such_db"))
    assert info.value.field == "dbname"


def test_namespaces_are_separate_keyspaces(server: PostgresServer) -> None:
    with _open(server.url(namespace="ns_one")) as one, _open(server.url(namespace="ns_two")) as two:
        one.put("k", b"one")
        assert two.get("k") is None
        assert two.list("")[0] == []


def test_password_auth_and_no_password_in_errors(server: PostgresServer) -> None:
    password = f"pw-{uuid.uuid4().hex}"
    server.sql(f"CREATE ROLE rdzv_password LOGIN PASSWORD '{password}'")
    server.sql("GRANT CREATE ON SCHEMA public TO rdzv_password")
    base = f"postgresql://rdzv_password:{password}@{server.address}/run?namespace=authns"
    with _open(base) as kv:
        assert kv.put("k", b"v").value == b"v"
        assert password not in repr(kv)
    wrong = base.replace(password, "not-" + password)
    with pytest.raises(InvalidURLError) as info:
        _open(wrong)
    assert info.value.field == "password"
    assert password not in str(info.value) and "not-" not in str(info.value)


def test_connection_refused_is_backend_connection_error() -> None:
    with pytest.raises(BackendConnectionError) as info:
        _open(f"postgresql://127.0.0.1:{free_port()}/run?operation_timeout=2")
    assert "127.0.0.1" in str(info.value)


def test_kill_and_restart_keeps_data_and_clients_recover(server: PostgresServer) -> None:
    kv = _open(server.url(namespace="restart"))
    try:
        entry = kv.put("k", b"before")
        server.kill()
        with pytest.raises(BackendUnavailableError):
            kv.get("k")
        server.start()
        # The pool dropped the broken connection; the next call connects anew (maybe after one more failure).
        for _ in range(3):
            try:
                got = kv.get("k")
                break
            except BackendUnavailableError:
                continue
        else:
            pytest.fail("the client never recovered after the server came back")
        assert got == entry, "acknowledged write lost in a kill -9 (fsync=off only risks an OS crash)"
        assert kv.put("k", b"after").revision > entry.revision
    finally:
        kv.close()


def test_paused_server_is_a_timeout_not_a_hang(server: PostgresServer) -> None:
    """A server that answers nothing (SIGSTOP) cannot enforce statement_timeout: the client's watchdog does."""
    kv = _open(server.url(namespace="paused", operation_timeout="1"))
    try:
        kv.put("k", b"v")
        server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(BackendTimeoutError):
                kv.get("k")
            assert time.monotonic() - started < 2 * 1 + 1 + 2.0, "the call was not cut at its deadline"
        finally:
            server.resume()
        assert kv.get("k").value == b"v", "the client did not recover once the server answered again"
    finally:
        kv.close()


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[PostgresServer, str]]:
    """A server that demands TLS from the role ``rdzv_tls``; yields it and its CA file."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    srv = PostgresServer(settings={"ssl": "on"})
    paths = {name: f"{srv.data_dir}/{name}" for name in ("ca.pem", "server.pem", "server.key")}
    ca.cert_pem.write_to_path(paths["ca.pem"])
    cert.cert_chain_pems[0].write_to_path(paths["server.pem"])
    cert.private_key_pem.write_to_path(paths["server.key"])
    for path in paths.values():
        srv.own(path)
    srv.settings.update({"ssl_cert_file": paths["server.pem"], "ssl_key_file": paths["server.key"]})
    try:
        srv.start()
        srv.sql("CREATE ROLE rdzv_tls LOGIN")
        srv.sql("GRANT CREATE ON SCHEMA public TO rdzv_tls")
        yield srv, paths["ca.pem"]
    finally:
        srv.stop()


def test_tls_verify_full(tls_server: tuple[PostgresServer, str]) -> None:
    srv, ca = tls_server
    url = f"postgresql://rdzv_tls@{srv.address}/run?namespace=tlsns&sslmode=verify-full&sslrootcert={ca}"
    with _open(url) as kv:
        assert kv.put("k", b"secret").value == b"secret"
        assert kv.watch("", 0, 0)[0].value == b"secret"


def test_tls_required_by_the_server_fails_without_it(tls_server: tuple[PostgresServer, str]) -> None:
    srv, _ = tls_server
    with pytest.raises((BackendConnectionError, InvalidURLError)):
        _open(f"postgresql://rdzv_tls@{srv.address}/run?namespace=tlsns&sslmode=disable")


def test_tls_wrong_ca_is_rejected(tls_server: tuple[PostgresServer, str], tmp_path) -> None:
    trustme = pytest.importorskip("trustme")
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    srv, _ = tls_server
    with pytest.raises(BackendConnectionError):
        _open(f"postgresql://rdzv_tls@{srv.address}/run?sslmode=verify-full&sslrootcert={other}")
