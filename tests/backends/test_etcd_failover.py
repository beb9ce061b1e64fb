"""Failover between the endpoints of a multi-host etcd URL when the first endpoint is silent.

A silent endpoint is a listening socket that never answers (as a member on a partitioned host: the
connection may even be accepted, nothing comes back). Found by the multi-host scenarios.
"""

from __future__ import annotations

import socket
import time

import pytest

from rdzv_core import open_backend


@pytest.fixture
def silent():
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:  # never accepts, never answers
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize("scheme", ["etcd-v2", "etcd-v3"])
def test_open_with_a_silent_first_endpoint_goes_to_the_one_that_answered(scheme, silent, rdzv_server_etcd) -> None:
    """With ``operation_timeout=1`` the open probes the silent endpoint (0.5 s) and then sends its first request
    to the endpoint that answered the probe -- before, it tried the silent one again and ran out of time
    ("cannot reach any of the 2 etcd endpoints")."""
    started = time.monotonic()
    kv = open_backend(f"{scheme}://{silent},{rdzv_server_etcd.address}/?operation_timeout=1")
    try:
        opened = time.monotonic() - started
        kv.put("failover/open", b"1")
        assert kv.get("failover/open").value == b"1"
        assert opened < 1.5, opened
    finally:
        kv.close()
