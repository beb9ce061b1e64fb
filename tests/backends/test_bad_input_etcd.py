"""Bad input to the etcd backends, against real servers: how fast, and naming what.

TLS files (checked when the URL is parsed), TLS settings the server refuses
(one handshake at open), ``protocol=http`` to an etcd with TLS and a URL
pointed at an HTTP server that is not etcd (one plain ``GET /version`` at
open). Each ``test_bad_input_*`` records ``time_to_error_s`` and
``bad_input`` (rendered into ``docs/reliability.md``). The URLs keep the
default ``operation_timeout`` (10 s): the error must not wait for it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Any, Iterator

import pytest

from conformance_tests.etcd_server import EtcdServer
from conformance_tests.servers import free_port, wait_for_port
from rdzv_backends._etcd.settings import DEFAULT_OPERATION_TIMEOUT
from rdzv_core import open_backend
from tests.support.agent_workers.harness import REPO
from tests.support.bad_input import FILE_CASES, open_bad

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary on PATH")

SCHEMES = ["etcd-v2", "etcd-v3"]
#: The error must come within half the default ``operation_timeout`` (seconds): it comes in about 0.01 s
#: (docs/reliability.md); a client that retried until its deadline would take the whole timeout. The rest is
#: slack for a loaded machine.
FAST = DEFAULT_OPERATION_TIMEOUT / 2
#: A gRPC C-core log line: severity letter, MMDD, time, thread id, file:line].
CORE_LOG_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.MULTILINE)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PEM files: the server's CA and certificates, another CA, and broken files."""
    trustme = pytest.importorskip("trustme")
    from cryptography.hazmat.primitives import serialization

    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client, foreign = ca.issue_cert("rdzv-client"), other.issue_cert("rdzv-client")
    foreign_server = other.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("bad-tls")
    f = {name: str(d / name) for name in (
        "ca.pem", "other-ca.pem", "server.pem", "server.key", "client.pem", "client.key",
        "foreign.pem", "foreign.key", "foreign-server.pem", "foreign-server.key", "not-pem.pem", "encrypted.key")}
    ca.cert_pem.write_to_path(f["ca.pem"])
    other.cert_pem.write_to_path(f["other-ca.pem"])
    server.cert_chain_pems[0].write_to_path(f["server.pem"])
    server.private_key_pem.write_to_path(f["server.key"])
    client.cert_chain_pems[0].write_to_path(f["client.pem"])
    client.private_key_pem.write_to_path(f["client.key"])
    foreign.cert_chain_pems[0].write_to_path(f["foreign.pem"])
    foreign.private_key_pem.write_to_path(f["foreign.key"])
    foreign_server.cert_chain_pems[0].write_to_path(f["foreign-server.pem"])
    foreign_server.private_key_pem.write_to_path(f["foreign-server.key"])
    with open(f["not-pem.pem"], "w") as out:
        out.write("this is not a PEM file\n")
    key = serialization.load_pem_private_key(client.private_key_pem.bytes(), password=None)
    with open(f["encrypted.key"], "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.BestAvailableEncryption(b"passphrase")))
    return f


def tls_server(f: dict[str, str]) -> EtcdServer:
    return EtcdServer(
        protocol="https", ca_file=f["ca.pem"], client_cert=(f["client.pem"], f["client.key"]),
        extra_args=("--cert-file", f["server.pem"], "--key-file", f["server.key"], "--trusted-ca-file", f["ca.pem"],
                    "--client-cert-auth"),
    )


@pytest.fixture(scope="module")
def tls_etcd(tls: dict[str, str]) -> Iterator[EtcdServer]:
    """An etcd serving TLS that demands client certificates signed by ``ca.pem``."""
    server = tls_server(tls)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer()
    server.start()
    yield server
    server.stop()


def query(f: dict[str, str], **files: str | None) -> str:
    """``protocol=https&cacert=...&cert=...&key=...`` from names in ``f`` (``None``: leave the key out)."""
    chosen = {"cacert": "ca.pem", "cert": "client.pem", "key": "client.key", **files}
    return "protocol=https" + "".join(f"&{k}={f[v]}" for k, v in chosen.items() if v is not None)


@pytest.mark.parametrize("case, files, field, named", FILE_CASES, ids=[c[0] for c in FILE_CASES])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_bad_input_tls_file(scheme: str, case: str, files: dict[str, str | None], field: str, named: str,
                            tls: dict[str, str], tls_etcd: EtcdServer, record_property: Any,
                            capfd: pytest.CaptureFixture[str]) -> None:
    error, elapsed = open_bad(f"{scheme}://{tls_etcd.address}/job?{query(tls, **files)}", f"TLS: {case}",
                              record_property)
    assert error.field == field
    assert tls[named] in str(error), f"the error must name the file {tls[named]}: {error}"
    assert elapsed < FAST, f"{case}: {elapsed:.2f} s"
    assert not CORE_LOG_LINE.search(capfd.readouterr().err)


#: (case, query files, field named, the file the error names or None, server fixture).
SERVER_CASES = [
    ("cacert does not sign the server certificate", {"cacert": "other-ca.pem"}, "cacert", "other-ca.pem", "tls"),
    ("client certificate of another CA", {"cert": "foreign.pem", "key": "foreign.key"}, "cert", "foreign.pem", "tls"),
    ("no client certificate for a server that demands one", {"cert": None, "key": None}, "cert", None, "tls"),
    ("protocol=https to a server without TLS", {}, "protocol", None, "plain"),
]


@pytest.mark.parametrize("case, files, field, named, which", SERVER_CASES, ids=[c[0] for c in SERVER_CASES])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_bad_input_tls_refused_by_the_server(
    scheme: str, case: str, files: dict[str, str | None], field: str, named: str | None, which: str,
    tls: dict[str, str], request: pytest.FixtureRequest, record_property: Any, capfd: pytest.CaptureFixture[str],
) -> None:
    server: EtcdServer = request.getfixturevalue("tls_etcd" if which == "tls" else "plain_etcd")
    error, elapsed = open_bad(f"{scheme}://{server.address}/job?{query(tls, **files)}", f"TLS: {case}",
                              record_property)
    assert error.field == field
    if named is not None:
        assert error.value == tls[named] and tls[named] in str(error)
    assert server.address in str(error), f"the error must name the server: {error}"
    assert elapsed < FAST, f"{case}: {elapsed:.2f} s"
    assert not CORE_LOG_LINE.search(capfd.readouterr().err)


def test_tls_checks_accept_good_files(tls: dict[str, str], tls_etcd: EtcdServer) -> None:
    for scheme in SCHEMES:
        with open_backend(f"{scheme}://{tls_etcd.address}/job?{query(tls)}") as kv:
            assert kv.put("ok", b"1").value == b"1"


# -- etcd:// to a server that is not etcd, or an etcd without v2 ------------------------------------
@pytest.fixture
def http_server(tmp_path: Any) -> Iterator[str]:
    """``python -m http.server`` on a free port (serving an empty directory): ``HOST:PORT``."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                            cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not wait_for_port("127.0.0.1", port, time.monotonic() + 30):
            pytest.fail("python -m http.server did not start")
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("scheme", ["etcd", "etcd-v2"])
def test_bad_input_etcd_v2_url_to_an_http_server_that_is_not_etcd(
    scheme: str, http_server: str, record_property: Any
) -> None:
    error, elapsed = open_bad(f"{scheme}://{http_server}/job", "etcd-v2 URL to an HTTP server that is not etcd",
                              record_property)
    assert error.field == "host" and error.value == http_server
    assert "not etcd" in str(error) and "etcd-v3" not in str(error) and "--enable-v2" not in str(error)
    assert elapsed < FAST


def test_bad_input_etcd_v3_url_to_an_http_server_that_is_not_etcd(http_server: str, record_property: Any) -> None:
    error, elapsed = open_bad(f"etcd-v3://{http_server}/job", "etcd-v3 URL to an HTTP server that is not etcd",
                              record_property)
    assert error.field == "host" and error.value == http_server
    assert "not etcd" in str(error) and "HTTP/2" not in str(error)
    assert elapsed < FAST


@pytest.mark.parametrize("scheme", ["etcd", *SCHEMES])
def test_bad_input_protocol_http_to_an_etcd_that_speaks_tls(scheme: str, tls_etcd: EtcdServer,
                                                             record_property: Any) -> None:
    error, elapsed = open_bad(f"{scheme}://{tls_etcd.address}/job", "protocol=http (the default) to an etcd with TLS",
                              record_property)
    assert error.field == "protocol" and error.value == "http"
    assert "speaks TLS" in str(error) and "add protocol=https" in str(error)
    assert tls_etcd.address in str(error)
    assert elapsed < FAST


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_plain_probe_skips_an_endpoint_that_refuses(scheme: str, plain_etcd: EtcdServer) -> None:
    with open_backend(f"{scheme}://127.0.0.1:{free_port()},{plain_etcd.address}/job") as kv:
        assert kv.put("probe", b"1").value == b"1"


def test_bad_input_etcd_url_to_an_etcd_without_v2_names_the_scheme_as_typed(record_property: Any) -> None:
    server = EtcdServer(enable_v2=False)
    server.start()
    try:
        error, elapsed = open_bad(f"etcd://{server.address}/job", "etcd:// URL to an etcd without the v2 API",
                                  record_property)
    finally:
        server.stop()
    assert error.field == "scheme" and error.value == "etcd", repr(error)
    assert "etcd-v2" not in str(error) and "etcd-v3://" in str(error)
    assert elapsed < FAST


# -- gRPC's C-core log ---------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import os, sys
    from rdzv_core import open_backend
    kv = open_backend(sys.argv[1])
    kv.put("k", b"v")
    print("opened", flush=True)
    sys.stdin.readline()  # the parent restarts the server with a certificate of another CA
    try:
        kv.get("k")
    except Exception as exc:
        print(type(exc).__name__, flush=True)
    print("GRPC_VERBOSITY=" + os.environ.get("GRPC_VERBOSITY", "(unset)"), flush=True)
""")


@pytest.mark.parametrize("user_verbosity", [None, "INFO"])
def test_grpc_core_log_is_silent_unless_the_user_set_it(
    user_verbosity: str | None, tls: dict[str, str], tmp_path: Any
) -> None:
    """A server whose certificate changed to one of another CA: gRPC's handshakes fail after open."""
    server = tls_server(tls)
    server.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
        if user_verbosity is not None:
            env["GRPC_VERBOSITY"] = user_verbosity
        url = f"etcd-v3://{server.address}/job?{query(tls)}&operation_timeout=2"
        child = subprocess.Popen([sys.executable, "-c", _CHILD, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "opened"
            server.kill()
            server.extra_args = ("--cert-file", tls["foreign-server.pem"], "--key-file", tls["foreign-server.key"],
                                 "--trusted-ca-file", tls["ca.pem"], "--client-cert-auth")
            server.ca_file = tls["other-ca.pem"]
            server.start()  # same port: the server now shows a certificate cacert does not sign
            out, err = child.communicate("\n", timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        server.stop()
    assert "BackendConnectionError" in out, (out, err)
    if user_verbosity is None:
        assert "GRPC_VERBOSITY=NONE" in out
        assert not CORE_LOG_LINE.search(err), err[:2000]
    else:
        assert f"GRPC_VERBOSITY={user_verbosity}" in out, "a user's GRPC_VERBOSITY is left alone"
        assert CORE_LOG_LINE.search(err), "with the user's GRPC_VERBOSITY=INFO gRPC logs as asked"
