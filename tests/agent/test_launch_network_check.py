"""``rdzv-run --network-check``: folded into the rendezvous URL as the ``network_check`` query key."""

from __future__ import annotations

import pytest

from rdzv_agent.launch.args import parse_args
from rdzv_agent.launch.config import build_config
from rdzv_core.errors import ConfigError
from tests.support.agent_workers.harness import WORKER


def test_network_check_becomes_the_urls_query_key(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PET_NODE_CHECK", raising=False)
    base = f"file://{tmp_path}/run?network_check_mib=2"
    url = build_config(parse_args(["--rdzv", base, "--network-check", WORKER])).url
    assert (url.params["network_check"], url.params["network_check_mib"]) == (True, 2.0)
    assert "network_check" not in build_config(parse_args(["--rdzv", base, WORKER])).url.params
    conf = build_config(parse_args(["--rdzv", base, "--rdzv-conf", "network_check=1", WORKER])).url
    assert conf.params["network_check"] is True
    assert build_config(parse_args(["--standalone", "--network_check", WORKER])).target.url.params["network_check"]
    with pytest.raises(ConfigError, match="--network-check.*static rendezvous"):
        build_config(parse_args(["--nnodes", "2", "--master-port", "29555", "--network-check", WORKER]))
