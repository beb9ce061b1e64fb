"""A run's incarnation (``docs/design.md``, "Incarnations"): where it comes from, how it is checked, the key root
it gives, and what the closed-run error, ``rdzv status``/``runs`` and torchrun's handlers make of it."""

from __future__ import annotations

import re
import uuid

import pytest

from rdzv_admin import runs_view
from rdzv_admin.cli import main as rdzv_main
from rdzv_core import InvalidURLError, create_handler, parse_backend_url
from rdzv_core.labels import incarnation_of
from rdzv_core.rendezvous import RendezvousParams, RunKeys
from rdzv_core.rendezvous.state_io import closed_message
from rdzv_core.rendezvous.record import parse_run_segment, run_segment
from rdzv_core.url import validate_run_id


def _memory(run_id: str, **query: str) -> str:
    pairs = {"min_nodes": "1", "last_call_timeout": "0.1", "timeout": "10", **query}
    return f"memory://inc{uuid.uuid4().hex[:8]}/{run_id}?" + "&".join(f"{k}={v}" for k, v in pairs.items())


@pytest.mark.parametrize("query, env, expected", [
    ({}, {}, (0, "default")),
    ({}, {"SLURM_RESTART_COUNT": "0"}, (0, "SLURM_RESTART_COUNT")),
    ({}, {"SLURM_RESTART_COUNT": "3"}, (3, "SLURM_RESTART_COUNT")),
    ({}, {"SLURM_RESTART_COUNT": ""}, (0, "default")),
    ({"incarnation": 2}, {"SLURM_RESTART_COUNT": "5"}, (2, "query")),  # the URL wins over the scheduler
    ({"incarnation": 0}, {"SLURM_RESTART_COUNT": "5"}, (0, "query")),
])
def test_the_incarnation_comes_from_the_query_then_the_restart_counter(query, env, expected):
    assert incarnation_of(query, env) == expected


@pytest.mark.parametrize("raw", ["-1", "x", "1.5", " 1", "1e3", "99999999"])
def test_a_bad_restart_counter_is_an_error_naming_the_variable_and_value(raw):
    with pytest.raises(InvalidURLError) as err:
        incarnation_of({}, {"SLURM_RESTART_COUNT": raw})
    assert err.value.field == "SLURM_RESTART_COUNT" and err.value.value == raw


@pytest.mark.parametrize("raw", ["-1", "x", "1.5", "", "1000001"])
def test_a_bad_incarnation_in_the_url_is_an_error_naming_the_key_and_value(raw):
    with pytest.raises(InvalidURLError) as err:
        parse_backend_url(f"memory://k/job?incarnation={raw}")
    assert err.value.field == "incarnation" and err.value.value == raw


def test_the_url_and_rdzv_conf_give_the_incarnation_to_the_parameters():
    parsed = parse_backend_url("memory://k/job?incarnation=4")[1]
    assert RendezvousParams.from_query(parsed.params).incarnation == 4
    assert RendezvousParams.from_query(parsed.with_params({"incarnation": "7"}).params).incarnation == 7
    assert RendezvousParams.from_query({}).incarnation == 0


@pytest.mark.parametrize("run_id", ["job", "123456", "slurm-77.0", "a=b+c:d@e~f", "x" * 128])
@pytest.mark.parametrize("incarnation", [0, 1, 12, 1_000_000])
def test_an_incarnations_root_is_its_own(run_id, incarnation):
    segment = run_segment(run_id, incarnation)
    assert parse_run_segment(segment) == (run_id, incarnation)
    keys, zero = RunKeys("p", run_id, incarnation), RunKeys("p", run_id)
    if incarnation:
        assert not keys.root.startswith(zero.tree) and not zero.root.startswith(keys.tree)
        with pytest.raises(InvalidURLError):  # no run id names an incarnation's root segment
            validate_run_id(segment[len("run_"):])
    else:
        assert keys.root == "p/run_" + run_id  # incarnation 0: the keys of every earlier version


@pytest.mark.parametrize("segment", ["run_", "job", "run_job%inc0", "run_job%inc", "run_job%inc01", "run_job%incx",
                                     "run_job%inc1%inc2", "run_%inc1"])
def test_other_segments_are_no_run_root(segment):
    assert parse_run_segment(segment) is None


def test_a_negative_incarnation_is_refused_by_the_parameters():
    with pytest.raises(ValueError, match="incarnation"):
        RendezvousParams(min_nodes=1, incarnation=-1)


@pytest.mark.parametrize("incarnation", [0, 3])
def test_the_closed_run_error_names_the_ways_out_in_one_line(incarnation):
    text = closed_message("job", incarnation)
    assert "\n" not in text and "run job" in text and "is closed" in text and "rdzv reset URL" in text
    assert f"incarnation={incarnation + 1}" in text
    assert (f"incarnation={incarnation} in the URL" in text) == bool(incarnation)


def test_the_handler_takes_the_incarnation_from_slurm_restart_count(monkeypatch):
    url = _memory("job")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    handler = create_handler(url)
    try:
        assert handler.params.incarnation == 2
        assert handler.next_rendezvous().world_size == 1
    finally:
        handler.shutdown()
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert not create_handler(url).is_closed()  # incarnation 0 of the id was never touched
    assert create_handler(url, incarnation=2).is_closed()


def test_a_bad_slurm_restart_count_refuses_the_handler(monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "again")
    with pytest.raises(InvalidURLError, match="SLURM_RESTART_COUNT"):
        create_handler(_memory("job"))


def test_torchrun_rdzv_conf_gives_the_incarnation(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_core.torch_api.torchrun import rendezvous_url

    params = RendezvousParameters("rdzv-memory", "k", "job", 1, 1, incarnation="3")
    assert rendezvous_url("memory", params).params["incarnation"] == 3
    with pytest.raises(InvalidURLError, match="incarnation"):
        rendezvous_url("memory", RendezvousParameters("rdzv-memory", "k", "job", 1, 1, incarnation="-2"))


def test_rdzv_runs_and_status_show_each_incarnation(tmp_path, capsys, monkeypatch):
    base = f"file://{tmp_path}/"
    for incarnation in (0, 1):
        handler = create_handler(f"{base}job?min_nodes=1&last_call_timeout=0.1&incarnation={incarnation}",
                                 local_addr="127.0.0.1")
        handler.next_rendezvous()
        if incarnation == 0:
            handler.shutdown()  # 0 closed, 1 live
    try:
        kv = parse_backend_url(base, require_run_id=False)
        rows = runs_view.list_runs(kv[0].spec.open(kv[1]), RendezvousParams(min_nodes=1))
        assert [(r["run_id"], r["incarnation"], r["state"]) for r in rows] == [("job", 0, "closed"),
                                                                                 ("job", 1, "final")]
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # inside the requeued job: its own incarnation
        rdzv_main(["status", f"{base}job"])
        assert re.search(r"^incarnation\s+1$", capsys.readouterr().out, re.MULTILINE)
        monkeypatch.delenv("SLURM_RESTART_COUNT")
        rdzv_main(["status", f"{base}job"])  # outside the job: the latest incarnation with state
        assert re.search(r"^incarnation\s+1$", capsys.readouterr().out, re.MULTILINE)
        rdzv_main(["status", f"{base}job?incarnation=0"])
        out = capsys.readouterr().out
        assert re.search(r"^incarnation\s+0$", out, re.MULTILINE) and re.search(r"^state\s+closed$", out, re.MULTILINE)
    finally:
        handler.shutdown()
