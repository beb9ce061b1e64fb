"""Server fixtures' plumbing shared by the backend tests."""

from __future__ import annotations

from typing import Iterator, TypeVar

from conformance_tests.redis_server import RedisServer

S = TypeVar("S", bound=RedisServer)


def serve(server: S) -> Iterator[S]:
    """Start ``server``, yield it, stop it (the body of a fixture: ``yield from serve(RedisServer())``)."""
    server.start()
    try:
        yield server
    finally:
        server.stop()
