"""The network-fault proxy itself (conformance_tests.proxy), against a loopback echo server.

The fault tests trust the proxy's modes; these tests pin them down: ``drop`` resets
open connections and has the kernel refuse new ones even while the proxy's own
thread is stalled (a loaded machine), and ``pass`` serves again on the same port.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import pytest

from conformance_tests.proxy import Mode, TCPProxy


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A loopback TCP server that echoes every chunk back, one thread per connection."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()
    stop.set()
    server.close()


def _roundtrip(address: tuple[str, int], payload: bytes = b"ping") -> bytes:
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(payload)
        return sock.recv(65536)


def test_pass_forwards_both_ways(echo: tuple[str, int]) -> None:
    with TCPProxy(*echo) as proxy:
        assert _roundtrip((proxy.host, proxy.port)) == b"ping"
        # counted once written on (the client may read the echo first): wait, don't sample
        assert proxy.wait_for_chunks("to_server", 0, 5) and proxy.wait_for_chunks("to_client", 0, 5)


def test_drop_resets_open_connections_and_refuses_new_ones_while_the_proxy_is_stalled(
        echo: tuple[str, int]) -> None:
    with TCPProxy(*echo) as proxy:
        address = (proxy.host, proxy.port)
        open_conn = socket.create_connection(address, timeout=5)
        open_conn.sendall(b"a")
        assert open_conn.recv(10) == b"a"
        proxy.set_mode(Mode.DROP)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            open_conn.sendall(b"b")
            if not open_conn.recv(10):  # an orderly close would be a FIN, not the promised reset
                raise AssertionError("the open connection was closed, not reset")
        open_conn.close()
        # Stall the proxy's loop thread: a refusal must not need it to run.
        assert proxy._loop is not None
        stalled, release = threading.Event(), threading.Event()
        proxy._loop.call_soon_threadsafe(lambda: (stalled.set(), release.wait(10)))
        assert stalled.wait(5)
        try:
            t0 = time.monotonic()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(address, timeout=5)
            assert time.monotonic() - t0 < 1.0
        finally:
            release.set()
        proxy.set_mode(Mode.PASS)
        assert (proxy.host, proxy.port) == address, "the proxy moved to another port"
        assert _roundtrip(address, b"back") == b"back"


def test_blackhole_accepts_and_holds_then_delivers_after_pass(echo: tuple[str, int]) -> None:
    with TCPProxy(*echo) as proxy:
        proxy.set_mode(Mode.BLACKHOLE)
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(b"held")
            sock.settimeout(0.3)
            with pytest.raises(socket.timeout):
                sock.recv(10)
            proxy.set_mode(Mode.PASS)
            sock.settimeout(5)
            assert sock.recv(10) == b"held"


def test_drop_twice_then_pass_still_serves(echo: tuple[str, int]) -> None:
    with TCPProxy(*echo) as proxy:
        for _ in range(2):
            proxy.set_mode(Mode.DROP)
            proxy.set_mode(Mode.DROP)
            proxy.set_mode(Mode.PASS)
            assert _roundtrip((proxy.host, proxy.port)) == b"ping"
