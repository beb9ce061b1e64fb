"""The agent's view of its handler: rdzv's ``RdzvHandler`` is an ``ElasticHandler`` (a declared protocol); torch's
own handlers are not, and the agent then goes without the extras (no round version, no backend endpoints, no
release) instead of failing."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous  # noqa: E402

from rdzv_agent import master_address as master  # noqa: E402
from rdzv_agent.launch import launcher  # noqa: E402
from rdzv_agent.supervision import health  # noqa: E402
from rdzv_agent.elastic import elastic_handler  # noqa: E402
from rdzv_core import create_handler  # noqa: E402
from rdzv_core.torch_api.handler import ElasticHandler, RdzvHandler  # noqa: E402


def test_rdzv_handler_implements_the_protocol_with_methods_not_the_state_machine() -> None:
    handler = create_handler(f"memory://k{uuid.uuid4().hex[:8]}/job?min_nodes=1&max_nodes=1", local_addr="127.0.0.1")
    assert isinstance(handler, RdzvHandler) and isinstance(handler, ElasticHandler)
    assert elastic_handler(handler) is handler
    assert handler.round_version() is None and health.round_version(handler) is None, "before a round"
    handler.next_rendezvous()
    version = handler.round_version()
    assert isinstance(version, int) and version >= 1 and health.round_version(handler) == version
    assert handler.params.min_nodes == 1 and handler.endpoints == ()
    assert handler.publish_progress({0: (5, 1.0)}, ttl=10.0) is True
    launcher._release(handler)  # leaves the round through the protocol
    assert handler.round_version() is None
    handler.shutdown()


def test_torchs_own_handler_gets_none_of_the_extras() -> None:
    static = StaticTCPRendezvous("127.0.0.1", 1, 0, 1, "run", 1)
    assert not isinstance(static, ElasticHandler) and elastic_handler(static) is None
    assert health.round_version(static) is None
    assert master.local_address("10.1.2.3", static) == "10.1.2.3"
    launcher._release(static)  # nothing to release: no error
