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


@pytest.mark.launchers  # starts launchers (tests/conftest.py)
def test_a_late_member_without_the_check_strands_nobody_and_nobody_is_charged(procs, tmp_path) -> None:
    """Three ``rdzv-run --network-check`` nodes and a fourth without it, started once the three have joined (the
    highest rank, as a node coming late from another host): every node's worker starts in the same round, nobody
    is quarantined, every launcher exits 0."""
    from rdzv_core import open_backend
    from rdzv_core.rendezvous import Rendezvous, RendezvousParams
    from tests.support.launch_runs import new_run, records
    from tests.support.waiting import eventually

    late = "D"
    run_id = new_run(procs)
    base = f"file://{tmp_path}/rdzv/"
    url = (f"{base}{run_id}?min_nodes=2&max_nodes=4&last_call_timeout=6&keep_alive_ttl=2&timeout=120"
           "&network_check_timeout=8")
    done = tmp_path / "done"
    outs = {name: str(tmp_path / f"out-{name}") for name in "ABCD"}
    launchers = {name: procs.start(["--rdzv", url, *(["--network-check"] if name != late else []),
                                    "--monitor-interval", "0.1", WORKER, "--wait-for", str(done), "--out", outs[name]],
                                   name) for name in "ABC"}
    kv = open_backend(base)
    try:
        observer = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1))
        eventually(lambda: observer.describe().get("joined") == 3, 120, "A, B and C joined",
                   lambda: "\n".join(x.tail() for x in launchers.values()))
        launchers[late] = procs.start(["--rdzv", url, "--monitor-interval", "0.1", WORKER, "--wait-for", str(done),
                                       "--out", outs[late]], late)
        tails = lambda: "\n".join(x.tail() for x in launchers.values())  # noqa: E731
        eventually(lambda: all(records(outs[n]) for n in "ABCD"), 120, "every node's worker", tails)
        assert {records(outs[n])[0]["env"]["WORLD_SIZE"] for n in "ABCD"} == {"4"}, tails()
        assert all(not observer.ledger.read(n).offences for n in "ABCD"), [observer.ledger.read(n) for n in "ABCD"]
        done.touch()
        assert [launcher.wait(90) for launcher in launchers.values()] == [0, 0, 0, 0], tails()
    finally:
        kv.close()
