"""The operator command ``rdzv``: outcomes and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from rdzv_core import Rendezvous, RendezvousParams, open_backend
# Imported at collection, not inside a test: pytest rewrites this distribution's modules at import (ast.parse), and
# CPython 3.11's AST state is shared between threads (cpython#106905; 3.11 tracebacks ast.parse their source lines):
# imported inside a test while other tests' threads ran, it failed twice ("AST constructor recursion depth mismatch").
from rdzv_admin.cli import main


def _rdzv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rdzv_admin.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_backends_lists_builtins_as_json() -> None:
    out = _rdzv("backends", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    for scheme in ("memory", "file", "redis", "etcd-v2", "etcd-v3"):
        assert rows[scheme]["distribution"] == "rdzv"


def test_status_close_reset_on_a_live_run(tmp_path) -> None:
    url = f"file://{tmp_path}/job{uuid.uuid4().hex[:6]}"
    kv = open_backend(url.rsplit("/", 1)[0] + "/")
    member = Rendezvous(kv, url.rsplit("/", 1)[1], RendezvousParams(min_nodes=1, keep_alive_ttl=30))
    result = member.next_round()
    status = json.loads(_rdzv("status", url, "--json").stdout)
    assert (status["status"], status["version"], status["participants"]) == ("final", result.version, 1)
    assert [m["rank"] for m in status["alive"]] == [0]
    assert _rdzv("close", url).returncode == 1  # no terminal, no --yes: refuses
    assert not member.is_closed()
    assert _rdzv("close", url, "--yes").returncode == 0
    assert member.is_closed()
    assert _rdzv("reset", url, "--yes").returncode == 0
    after_reset = _rdzv("status", url, "--json")
    assert after_reset.returncode == 1  # nothing stored: not healthy for a probe
    gone = json.loads(after_reset.stdout)
    assert (gone["status"], gone["counter"], gone["verdict"]) == ("absent", None, "absent")
    assert len(gone["warnings"]) == 1, gone  # nothing stored: started yet? a typo in the URL or run id?
    assert status["warnings"] == [] and status["verdict"] == "healthy"  # a live run has none
    member.leave()
    kv.close()


def test_check_reports_every_protocol_check(tmp_path) -> None:
    out = _rdzv("check", f"file://{tmp_path}/", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["checks"] and all(report["checks"].values())


@pytest.mark.parametrize("args, code", [(("status", "nosuch://h/run"), 2), (("status", "file:///tmp/x/.."), 2)])
def test_errors_are_one_line_with_exit_code(args: tuple[str, ...], code: int) -> None:
    out = _rdzv(*args)
    assert out.returncode == code
    assert len(out.stderr.strip().splitlines()) == 1


def test_status_and_reset_survive_corrupt_state(tmp_path) -> None:
    """Garbage written straight into a run: ``status`` reports it (exit 1 for a corrupt counter, naming the key and
    ``rdzv reset``), ``reset`` deletes it, and the run id then forms a round again."""
    run_id = f"job{uuid.uuid4().hex[:6]}"
    url = f"file://{tmp_path}/{run_id}"
    kv = open_backend(f"file://{tmp_path}/")
    member = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1, keep_alive_ttl=30))
    result = member.next_round()
    member.leave()
    rank_0 = member.keys.alive(result.version, result.round_id, 0)
    kv.put(rank_0, b"\xffnot json")
    status = json.loads(_rdzv("status", url, "--json").stdout)
    assert [m["key"] for m in status["alive"]] == [rank_0] and "corrupt" in status["alive"][0]
    assert status["verdict"] == "degraded"  # rank 0 has no live keep-alive record
    assert _rdzv("status", url).returncode == 1
    joined = member.keys.joined(result.version, result.round_id)
    kv.put(joined, b"many")
    out = _rdzv("status", url)
    assert out.returncode == 1
    assert joined in out.stderr and "rdzv reset" in out.stderr
    assert _rdzv("reset", url, "--yes").returncode == 0
    assert json.loads(_rdzv("status", url, "--json").stdout)["status"] == "absent"
    again = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1, keep_alive_ttl=30))
    assert (again.next_round().world_size, again.current is not None) == (1, True)
    again.leave()
    kv.close()


def test_status_reports_a_corrupt_or_lagging_version_counter(rdzv_url, kv, capsys) -> None:
    """The version counter numbers rounds: garbage in it, or a value below the round record's version, would make
    the next round fail or reuse an old round's keys. ``status`` shows it, reports it (table and --json) and exits 1
    with a one-line hint to reset the run."""
    url = rdzv_url(keep_alive_ttl=30)
    run_id = url.split("?")[0].rsplit("/", 1)[1]
    member = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    member.next_round()
    version = member.next_round().version
    counter_key = member.keys.version_counter

    def status(*extra: str) -> tuple[int, str, str]:
        code = main(["status", url, *extra])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = status("--json")
    assert code == 0 and err == ""
    healthy = json.loads(out)
    assert (healthy["counter"], healthy["problems"]) == (version, [])
    assert status()[0] == 0

    for garbage, expect_counter in ((b"not a number", None), (str(version - 1).encode(), version - 1)):
        kv.put(counter_key, garbage)
        code, out, err = status("--json")
        report = json.loads(out)
        assert code == 1
        assert report["counter"] == expect_counter and len(report["problems"]) == 1
        assert counter_key in report["problems"][0]
        assert len(err.strip().splitlines()) == 1 and "rdzv reset" in err
        code, out, err = status()
        assert code == 1 and "PROBLEM" in out and counter_key in out
        assert len(err.strip().splitlines()) == 1 and "rdzv reset" in err

    kv.delete(counter_key)  # lost: the next round would be version 1 again
    code, out, _ = status("--json")
    assert code == 1 and json.loads(out)["counter"] is None

    kv.put(counter_key, str(version).encode())
    member.set_closed()  # a closed run has no round version to compare with; the counter is still shown
    code, out, _ = status("--json")
    assert code == 0 and (json.loads(out)["status"], json.loads(out)["counter"]) == ("closed", version)
    member.leave()


def test_status_shows_each_members_keep_alive_age(rdzv_url, kv, capsys) -> None:
    """Each member's keep-alive: seconds since its last refresh and until it expires (backend's ``ttl_remaining``)."""
    url = rdzv_url(keep_alive_ttl=30)
    run_id = url.split("?")[0].rsplit("/", 1)[1]
    member = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    member.next_round()
    try:
        assert main(["status", url, "--json"]) == 0
        (alive,) = json.loads(capsys.readouterr().out)["alive"]
        if alive["ttl_left"] is None:
            pytest.skip("this backend does not report remaining TTLs (optional)")
        assert 20 < alive["ttl_left"] <= 31 and 0 <= alive["keep_alive_age"] < 10
        assert alive["ttl_left"] + alive["keep_alive_age"] == pytest.approx(30, abs=1.01)
        assert main(["status", url]) == 0
        assert "refreshed" in capsys.readouterr().out
    finally:
        member.leave()


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """``rdzv backends | head -0``: exit 141 (as a shell tool on SIGPIPE), nothing on stderr, buffered or not."""
    import os

    for unbuffered in ("", "1"):
        proc = subprocess.Popen([sys.executable, "-m", "rdzv_admin.cli", "backends"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # long before the command has imported anything and written
        err = proc.stderr.read()
        assert proc.wait(60) == 141 and err == b"", err


def test_started_with_stdout_closed_gives_no_traceback() -> None:
    """``rdzv backends >&-``: the output is lost, which is an error (exit 1, one line), as for ``ls >&-``."""
    import os

    def close_stdout() -> None:
        os.close(1)

    proc = subprocess.run([sys.executable, "-m", "rdzv_admin.cli", "backends"], stdout=None,
                          stderr=subprocess.PIPE, preexec_fn=close_stdout, timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert b"Traceback" not in proc.stderr


def test_status_warns_of_members_without_a_keep_alive(rdzv_url, kv, capsys) -> None:
    """A final round whose member's keep-alive key is gone (died, left, stalled): a warning, verdict ``degraded``
    and exit status 1 (table and --json), so that a monitoring probe sees it."""
    url = rdzv_url(keep_alive_ttl=30)
    run_id = url.split("?")[0].rsplit("/", 1)[1]
    member = Rendezvous(kv, run_id, RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    member.next_round()
    assert main(["status", url, "--json"]) == 0
    healthy = json.loads(capsys.readouterr().out)
    assert (healthy["warnings"], healthy["verdict"]) == ([], "healthy")
    member.leave()  # deletes its keep-alive key; the round record stays final
    assert main(["status", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "final" and report["alive"] == [] and len(report["warnings"]) == 1
    assert report["verdict"] == "degraded"
    assert main(["status", url]) == 1


def test_reset_of_a_live_run_names_the_live_members(tmp_path) -> None:
    """Resetting under live members is allowed with --yes, but they are named on stderr first."""
    url = f"file://{tmp_path}/job{uuid.uuid4().hex[:6]}"
    kv = open_backend(url.rsplit("/", 1)[0] + "/")
    member = Rendezvous(kv, url.rsplit("/", 1)[1], RendezvousParams(min_nodes=1, keep_alive_ttl=30,
                                                                    last_call_timeout=0.1))
    member.next_round()
    out = _rdzv("reset", url)  # no terminal, no --yes
    assert out.returncode == 1 and "rank 0" in out.stderr
    out = _rdzv("reset", url, "--yes")
    assert out.returncode == 0 and "rank 0" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert json.loads(_rdzv("status", url, "--json").stdout)["status"] == "absent"
    assert member.num_nodes_waiting() >= 1  # the member is told its round is gone
    member.leave()
    kv.close()


def test_status_of_an_unreachable_backend_exits_3_with_the_verdict_in_json() -> None:
    """Exit codes for a probe: 3 when the backend cannot be reached (1 is for an unhealthy run), --json saying so."""
    from conformance_tests.servers import free_port

    url = f"redis://127.0.0.1:{free_port()}/job?operation_timeout=2"  # nothing listens there
    out = _rdzv("status", url, "--json")
    assert out.returncode == 3, out.stderr
    assert json.loads(out.stdout)["verdict"] == "unreachable"
    assert len(out.stderr.strip().splitlines()) == 1
    assert _rdzv("status", url).returncode == 3
    assert _rdzv("check", url.split("job")[0]).returncode == 3


def test_backends_shows_default_ports_and_server_endpoints() -> None:
    """Redis: agents on many hosts, but one server endpoint; the default ports are shown (6379, 2379)."""
    rows = json.loads(_rdzv("backends", "--json").stdout)
    assert (rows["redis"]["default_port"], rows["redis"]["server_endpoints"], rows["redis"]["multi_host"]) == \
        (6379, "one", True)
    for scheme in ("etcd", "etcd-v2", "etcd-v3"):
        assert (rows[scheme]["default_port"], rows[scheme]["server_endpoints"]) == (2379, "many")
    assert rows["file"]["default_port"] is None and rows["file"]["server_endpoints"] == "none"
    table = _rdzv("backends")
    assert table.returncode == 0
    redis_row = next(line.split() for line in table.stdout.splitlines() if line.startswith("redis "))
    assert redis_row[3:6] == ["6379", "yes", "one"], redis_row
    header, *lines = table.stdout.splitlines()
    for column in ("port", "server endpoints", "tls"):  # every row's cell starts under its heading
        at = header.index(column)
        assert all(line[at - 1] == " " and line[at] != " " for line in lines), (column, table.stdout)


def test_runs_lists_open_and_closed_runs_with_age(tmp_path) -> None:
    base = f"file://{tmp_path}/"
    kv = open_backend(base)
    member = Rendezvous(kv, "open-run", RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    member.next_round()
    closer = Rendezvous(kv, "done-run", RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    closer.next_round()
    closer.set_closed()
    closer.leave()
    stopped = Rendezvous(kv, "stopped-run", RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1))
    stopped.next_round()
    stopped.leave()  # its job stopped by a signal: the run stays open, nobody in it
    out = _rdzv("runs", base, "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["run_id"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"open-run", "done-run", "stopped-run"}
    assert (rows["stopped-run"]["state"], rows["stopped-run"]["members"]) == ("stopped", 0)
    assert (rows["open-run"]["state"], rows["open-run"]["version"], rows["open-run"]["members"]) == ("final", 1, 1)
    assert (rows["done-run"]["state"], rows["done-run"]["version"], rows["done-run"]["members"]) == ("closed", None, 0)
    assert rows["stopped-run"]["age"] is None  # nobody left to date it
    for name in ("open-run", "done-run"):
        assert 0 <= rows[name]["age"] < 60
    text = _rdzv("runs", base)
    assert text.returncode == 0 and len(text.stdout.splitlines()) == 4  # a header and one line per run
    assert _rdzv("runs", f"file://{tmp_path}/?prefix=elsewhere", "--json").stdout.strip() == "[]"
    member.leave()
    kv.close()


def test_status_follows_a_requeued_job_to_its_latest_incarnation(tmp_path, monkeypatch) -> None:
    """Incarnations 0 and 1 ended (0 closed, 1 stopped: its member gone), 2 trains: ``rdzv status`` of the run's
    URL, outside the job, shows 2 and is healthy; the URL's incarnation, or the job's restart counter, choose."""
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    base = f"file://{tmp_path}/"
    kv = open_backend(base)

    def member(incarnation: int) -> Rendezvous:
        node = Rendezvous(kv, "job", RendezvousParams(min_nodes=1, keep_alive_ttl=30, last_call_timeout=0.1,
                                                      incarnation=incarnation))
        node.next_round()
        return node

    first = member(0)
    first.set_closed()
    first.leave()
    member(1).leave()  # stopped, never closed: its round has no live member
    live = member(2)
    status = _rdzv("status", base + "job", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    shown = json.loads(status.stdout)
    assert (shown["incarnation"], shown["verdict"], [m["rank"] for m in shown["alive"]]) == (2, "healthy", [0])
    assert json.loads(_rdzv("status", base + "job?incarnation=1", "--json").stdout)["verdict"] == "degraded"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # inside the first start's job: its own incarnation
    assert json.loads(_rdzv("status", base + "job", "--json").stdout)["incarnation"] == 0
    live.leave()
    kv.close()
