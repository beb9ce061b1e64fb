"""Bad input to the Redis backend, against real ``redis-server``s: how fast, and naming what.

TLS files (checked when the URL is parsed, as etcd's: ``rdzv_backends/_tls.py``), TLS settings the server
refuses (seen at open), and a ``redis://`` URL to a TLS-only port. Each ``test_bad_input_*`` records
``time_to_error_s`` and ``bad_input``. The URLs keep the default ``operation_timeout`` (10 s): the error
must not wait for it.
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Any, Iterator

import pytest
from tests.support.bad_input import FILE_CASES, open_bad  # the same cases and helper as the etcd tests
from tests.support.servers import serve

from conformance_tests.redis_server import RedisTLSServer
from rdzv_backends.redis._settings import DEFAULT_OPERATION_TIMEOUT
from rdzv_core import BackendConnectionError, InvalidURLError, open_backend

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH")

#: The error must come within half the default ``operation_timeout`` (seconds): it comes in a few ms; a client
#: that retried until its deadline would take the whole timeout. The rest is slack for a loaded machine.
FAST = DEFAULT_OPERATION_TIMEOUT / 2


@pytest.fixture(scope="module")
def mtls() -> Iterator[RedisTLSServer]:
    """A TLS-only server that demands a client certificate signed by its CA."""
    yield from serve(RedisTLSServer(auth_clients="yes"))


@pytest.fixture(scope="module")
def files(mtls: RedisTLSServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The server's CA and client files, and foreign, broken, encrypted and combined ones."""
    trustme = pytest.importorskip("trustme")
    from cryptography.hazmat.primitives import serialization

    foreign = trustme.CA().issue_cert("rdzv-client")
    d = tmp_path_factory.mktemp("redis-bad-tls")
    f = {"ca.pem": mtls.ca_path, "client.pem": mtls.client_cert_path, "client.key": mtls.client_key_path,
         **{name: str(d / name) for name in ("foreign.pem", "foreign.key", "not-pem.pem", "encrypted.key",
                                             "combined.pem")}}
    foreign.cert_chain_pems[0].write_to_path(f["foreign.pem"])
    foreign.private_key_pem.write_to_path(f["foreign.key"])
    with open(f["not-pem.pem"], "w") as out:
        out.write("this is not a PEM file\n")
    with open(f["client.key"], "rb") as key_file:
        key_pem = key_file.read()
    key = serialization.load_pem_private_key(key_pem, password=None)
    with open(f["encrypted.key"], "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.BestAvailableEncryption(b"passphrase")))
    with open(f["combined.pem"], "wb") as out, open(f["client.pem"], "rb") as cert_file:
        out.write(cert_file.read() + key_pem)
    return f


def url(server: RedisTLSServer, f: dict[str, str], **chosen: str | None) -> str:
    """``rediss://`` to ``server`` with ``cacert``/``cert``/``key`` from names in ``f`` (``None``: left out)."""
    names = {"cacert": "ca.pem", "cert": "client.pem", "key": "client.key", **chosen}
    return f"rediss://{server.address}/run?" + "&".join(f"{k}={f[v]}" for k, v in names.items() if v is not None)


@pytest.mark.parametrize("case, chosen, field, named", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_input_tls_file(case: str, chosen: dict[str, str | None], field: str, named: str, mtls: RedisTLSServer,
                            files: dict[str, str], record_property: Any) -> None:
    error, elapsed = open_bad(url(mtls, files, **chosen), f"rediss TLS: {case}", record_property)
    assert error.field == field
    assert files[named] in str(error), f"the error must name the file {files[named]}: {error}"
    assert elapsed < FAST, f"{case}: {elapsed:.2f} s"


def test_tls_files_are_checked_before_redis_py_is_needed(files: dict[str, str], monkeypatch: Any) -> None:
    """As etcd's: the files are judged when the URL is parsed, before the client library is imported."""
    import rdzv_backends.redis.backend as backend

    monkeypatch.setattr(backend, "open_url", lambda *a, **k: pytest.fail("the backend was reached"))
    with pytest.raises(InvalidURLError) as info:
        open_backend(f"rediss://127.0.0.1:1/run?cacert={files['ca.pem']}&cert={files['client.pem']}"
                     f"&key={files['encrypted.key']}")
    assert info.value.field == "key" and "encrypted" in str(info.value)


def test_cert_file_holding_its_key_is_accepted_without_key(mtls: RedisTLSServer, files: dict[str, str]) -> None:
    with open_backend(url(mtls, files, cert="combined.pem", key=None)) as kv:
        assert kv.put("t/combined", b"1").value == b"1"


#: (case, query files, the file the error names or None).
REFUSED_CASES = [
    ("client certificate of another CA", {"cert": "foreign.pem", "key": "foreign.key"}, "foreign.pem"),
    ("no client certificate for a server that demands one", {"cert": None, "key": None}, None),
]


@pytest.mark.parametrize("case, chosen, named", REFUSED_CASES, ids=[c[0] for c in REFUSED_CASES])
@pytest.mark.parametrize("seen_by", ["redis-py's error", "the handshake check"])
def test_bad_input_tls_certificate_refused_by_the_server(
    case: str, chosen: dict[str, str | None], named: str | None, seen_by: str, mtls: RedisTLSServer,
    files: dict[str, str], record_property: Any, monkeypatch: Any,
) -> None:
    if seen_by == "the handshake check":
        # redis-py may meet the closed connection while writing ("EOF occurred in violation of protocol",
        # no alert in sight): then open's own handshake reads the alert.
        import rdzv_backends.redis._errors as errors

        monkeypatch.setattr(errors, "refused_certificate", lambda exc, cert_given=True: None)
    error, elapsed = open_bad(url(mtls, files, **chosen), f"rediss TLS: {case}", record_property)
    assert error.field == "cert"
    assert error.value == (files[named] if named else None)
    assert mtls.address in str(error)
    assert ("demands" if named is None else "refused") in str(error)
    assert elapsed < FAST, f"{case}: {elapsed:.2f} s"


def test_bad_input_no_client_certificate_for_a_tls_1_2_server_that_demands_one(record_property: Any) -> None:
    """Under TLS 1.2 OpenSSL ends the handshake with ``handshake_failure`` (not ``certificate_required``)."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(contextlib.contextmanager(serve)(
            RedisTLSServer(auth_clients="yes", extra_args=("--tls-protocols", "TLSv1.2"))))
        error, elapsed = open_bad(server.url(), "rediss TLS 1.2: no client certificate for a server that demands one",
                                  record_property)
    assert error.field == "cert" and error.value is None
    assert "may demand a client certificate" in str(error) and server.address in str(error)
    assert elapsed < FAST


def test_bad_input_plain_redis_url_to_a_tls_only_port(mtls: RedisTLSServer, record_property: Any) -> None:
    error, elapsed = open_bad(f"redis://{mtls.address}/run", "redis:// URL to a TLS-only Redis port",
                              record_property, BackendConnectionError)
    assert "may require TLS (then use rediss://)" in str(error)
    assert elapsed < FAST


def test_no_tls_hint_for_a_port_nobody_listens_on() -> None:
    from conformance_tests.servers import free_port

    with pytest.raises(BackendConnectionError) as info:
        open_backend(f"redis://127.0.0.1:{free_port()}/run")
    assert "rediss" not in str(info.value)
