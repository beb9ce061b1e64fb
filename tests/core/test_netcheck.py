"""The network check of a formed round (rdzv_core.torch_api.netcheck): the outlier rule, its settings, the
ledger's immediate quarantine. Handlers running it: ``test_netcheck_handlers.py``."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("torch.distributed.elastic.rendezvous")

from rdzv_core import ConfigError, open_backend  # noqa: E402
from rdzv_core.errors import InvalidURLError  # noqa: E402
from rdzv_core.plugins import parse_backend_url  # noqa: E402
from rdzv_core.rendezvous.ledger import NodeLedger, QuarantinePolicy  # noqa: E402
from rdzv_core.rendezvous.record import RunKeys  # noqa: E402
from rdzv_core.torch_api.netcheck import Link, NetcheckSettings, node_rates, outliers  # noqa: E402

FAST, SLOW = 1000.0, 10.0


def _ring(n: int, rate=lambda s, r: FAST) -> list[Link]:
    """The links of both passes of a ring of ``n`` (shift 2 only for n >= 3), rate given per (sender, receiver)."""
    return [Link(r, (r + s) % n, s, rate(r, (r + s) % n)) for s in (1, 2) if s % n for r in range(n)]


# -- the outlier rule -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_node_whose_sends_are_slow_is_the_outlier_and_its_receivers_are_not(n: int) -> None:
    links = _ring(n, lambda s, r: SLOW if s == 1 else FAST)  # egress shaping on rank 1
    assert outliers(links, 4.0) == [1]
    rates = node_rates(links)
    assert rates[1] == SLOW and all(rates[r] == FAST for r in range(n) if r != 1)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_node_whose_receives_are_slow_is_the_outlier_and_its_senders_are_not(n: int) -> None:
    assert outliers(_ring(n, lambda s, r: SLOW if r == 2 else FAST), 4.0) == [2]


def test_one_dead_link_makes_no_outlier_but_a_node_with_no_link_left_is_one() -> None:
    assert outliers(_ring(4, lambda s, r: 0.0 if (s, r) == (0, 1) else FAST), 4.0) == []
    assert outliers(_ring(4, lambda s, r: 0.0 if 3 in (s, r) else FAST), 4.0) == [3]


def test_two_nodes_cannot_tell_which_end_is_slow() -> None:
    links = _ring(2, lambda s, r: SLOW if s == 0 else FAST)
    assert len(links) == 2 and outliers(links, 4.0) == []


def test_uniform_links_and_links_within_the_factor_make_no_outlier() -> None:
    assert outliers(_ring(5), 4.0) == []
    assert outliers(_ring(5, lambda s, r: FAST / 3 if s == 0 else FAST), 4.0) == []
    assert outliers([Link(0, 1, 1, 0.0), Link(1, 2, 1, 0.0), Link(2, 0, 1, 0.0)], 4.0) == []  # median 0


def test_a_stall_of_milliseconds_on_a_fast_link_is_not_slow_with_the_slack() -> None:
    mib = 2**20  # 1 MiB per link at 1 GiB/s: 1 ms; node 2's links took 5 ms (a busy process), 0.1 s of slack
    links = _ring(8, lambda s, r: 2**30 / 5 if 2 in (s, r) else 2**30)
    assert outliers(links, 4.0) == [2]
    assert outliers(links, 4.0, nbytes=mib, slack=0.1) == []
    slow = _ring(8, lambda s, r: 2**20 if s == 2 else 2**30)  # 1 s for 1 MiB: slow with or without the slack
    assert outliers(slow, 4.0, nbytes=mib, slack=0.1) == [2]


# -- settings ----------------------------------------------------------------------------------------

def test_settings_come_from_the_url_with_their_defaults() -> None:
    _, url = parse_backend_url("memory://x/job?network_check=1&network_check_mib=0.5")
    settings = NetcheckSettings.from_query(url.params)
    assert settings == NetcheckSettings(enabled=True, mib=0.5, factor=4.0, timeout=30.0)
    assert NetcheckSettings.from_query({}).enabled is False


@pytest.mark.parametrize("query, field", [("network_check=maybe", "network_check"),
                                          ("network_check_mib=0", "network_check_mib"),
                                          ("network_check_factor=1", "network_check_factor"),
                                          ("network_check_timeout=-1", "network_check_timeout")])
def test_a_bad_value_names_its_query_key(query: str, field: str) -> None:
    with pytest.raises(InvalidURLError) as raised:
        parse_backend_url(f"memory://x/job?{query}")
    assert raised.value.field == field


def test_a_bad_setting_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as raised:
        NetcheckSettings.from_query({"network_check_factor": 0.5})
    assert (raised.value.field, raised.value.value) == ("network_check_factor", 0.5)


# -- the ledger: quarantined at once ----------------------------------------------------------------------

def test_quarantine_now_quarantines_at_the_first_offence_unless_quarantine_is_off() -> None:
    kv = open_backend("memory://netcheck-ledger/")
    try:
        keys = RunKeys("torchelastic/p2p", f"run{uuid.uuid4().hex[:6]}")
        ledger = NodeLedger(kv, keys, QuarantinePolicy(after=2, cooldown=60))
        assert not ledger.offend("a", "network", "slow").quarantined()
        entry = ledger.offend("b", "network", "links at 1 MiB/s", quarantine_now=True)
        assert entry.quarantined() and entry.quarantines == 1 and "network" in entry.why
        assert 59 <= (entry.until or 0) - ledger.clock() <= 60
        off = NodeLedger(kv, keys, QuarantinePolicy(after=0))
        assert not off.offend("c", "network", "slow", quarantine_now=True).quarantined()
    finally:
        kv.close()
