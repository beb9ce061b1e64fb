"""Run the fault tests and render their results as the tables of ``docs/reliability.md``.

::

    python -m conformance_tests.reliability_table --write docs/reliability.md
    python -m conformance_tests.reliability_table --from-xml results.xml      # render only, to stdout

It runs ``conformance_tests/test_faults.py`` and, in a source checkout, the
fault tests under ``tests/`` (:data:`SOURCE_TESTS`: the agent kill matrix,
network faults through a TCP proxy, leader failure in a three-member etcd
cluster, a member's clock 30 s ahead) with ``pytest -n 2 --junitxml`` against
the backend URLs CI uses (``--rdzv-url`` to choose others: they parametrize
``test_faults.py`` and the kill matrix; the other three files choose their
backends themselves, :data:`OWN_SCHEMES`). The PostgreSQL example's server
fixture (``-p rdzv_postgres.testing``) is loaded when ``rdzv_postgres`` is
installed and a ``postgresql`` URL is used. It reads the outcome and the
measured times (``record_property``) of every test, and replaces what lies
between the two ``results`` markers of the target file (everything else in the
file is kept as written). The tests themselves fail on a broken expectation;
this script only reports. Exit status: pytest's (0 when only rendering).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["main", "Result", "read_results", "render"]

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
CI_URLS = ("memory://conformance/", "file://{tmp}/", "redis://{server:redis}/", "etcd-v2://{server:etcd}/",
           "etcd-v3://{server:etcd}/", "postgresql://{server:postgres}/?history_limit=1000")
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
#: Fault tests of a source checkout (in :data:`TESTS`), run when present.
SOURCE_TESTS = ("backends/test_fault_matrix.py", "backends/test_network_faults.py", "backends/test_etcd_cluster.py",
                "core/test_clock_offset.py", "backends/test_bad_input.py", "backends/test_bad_input_etcd.py",
                "backends/test_bad_input_redis.py", "multihost/test_multihost_partitions.py",
                "multihost/test_multihost_etcd_cluster.py", "multihost/test_multihost_rendezvous.py")
#: Tests of bad input (URLs, TLS files, run ids, query values) that record ``bad_input`` and ``time_to_error_s``.
BAD_INPUT_PREFIX = "test_bad_input_"
#: Backends the network, cluster and clock tests parametrize themselves (whatever ``--rdzv-url`` says).
OWN_SCHEMES = ("redis", "etcd-v2", "etcd-v3")

SERVER_FAULTS = {
    "test_server_restart_mid_rendezvous": "server killed and restarted mid-rendezvous",
    "test_server_killed_mid_watch": "server killed mid-watch",
    "test_server_paused_longer_than_ttl": "server paused (SIGSTOP) longer than the TTL",
    "test_final_round_across_a_short_restart": "final round across a short restart (TTL 4 s)",
}
BAD_INPUT = ("test_corrupt_round_record_names_the_key_and_reset_recovers", "test_corrupt_counter_is_a_state_error",
             "test_value_above_the_limit_fails_at_once", "test_multi_set_with_one_value_above_the_limit_writes_nothing")
PAUSED_OPS = ("get", "put", "list", "add", "refresh", "watch", "store.get", "store.set")
NETWORK_FAULTS = {
    "test_black_hole_fails_each_operation_within_one_operation_timeout": "black hole: every operation",
    "test_drop_fails_each_operation_promptly_with_connection_error": "drop: every operation",
    "test_keepalive_outlives_a_black_hole_shorter_than_its_ttl": "keep-alive through a 2 s black hole (TTL 4 s)",
    "test_next_rendezvous_succeeds_once_the_network_is_back": "next round after black hole, drop, pass",
    "test_store_calls_into_a_black_hole_end_within_the_store_timeout":
        "black hole: c10d Store calls (Store timeout 1 s, operation_timeout 10 s)",
    "test_store_calls_over_dropped_connections_raise_torchs_network_error":
        "drop: c10d Store calls (Store timeout 1 s, operation_timeout 10 s)",
    "test_next_rendezvous_into_a_black_hole_raises_torchs_connection_error":
        "black hole: the handler's next_rendezvous (timeout 3 s)",
}
NET_OPS = ("open", "get", "list", "put", "create", "compare_and_swap", "compare_and_delete", "delete", "add",
           "refresh", "watch")
NET_MODES = (("test_black_hole_fails_each_operation_within_one_operation_timeout", "black hole"),
             ("test_drop_fails_each_operation_promptly_with_connection_error", "drop"))
ERROR_ABBREV = {"BackendTimeoutError": "timeout", "BackendConnectionError": "conn. error"}
CLUSTER_FAULTS = {
    "test_leader_killed_mid_rendezvous": "leader killed mid-rendezvous",
    "test_leader_killed_during_a_final_round": "leader killed during a final round",
    "test_write_right_after_leader_death_is_not_held_for_the_whole_deadline": "`put` right after the leader's death",
    "test_compare_guarded_writes_right_after_leader_death": "compare-guarded writes right after the leader's death",
}
#: Partitions between hosts in network namespaces (root only; their cells show the ``summary`` they record).
PARTITIONS = {
    "test_a_partitioned_node_is_replaced_at_once_and_rejoins_after_the_heal":
        "a node host cut off mid-training, healed after 30 s",
    "test_a_server_partition_of_any_length_changes_nothing":
        "the server host cut off mid-training: 1 s, then longer than the TTL",
    "test_the_leaders_host_cut_off_during_a_rendezvous_and_during_training":
        "the etcd leader's host cut off during a rendezvous, then during training (3 members)",
    "test_a_node_cut_off_during_its_join_is_left_out": "a node cut off during its join",
    "test_a_node_cut_off_during_its_confirmation_is_left_out": "a node cut off during its confirmation",
    "test_a_spare_cut_off_disturbs_nobody_and_replaces_a_member_after_the_heal": "a spare cut off",
}
CLOCK_FAULTS = {"test_agent_with_clock_30s_ahead_is_not_evicted": "one member's clock 30 s ahead (libfaketime)"}
PHASES = ("setup", "join", "last_call", "confirm", "final")


@dataclass
class Result:
    """One test case: ``test`` (function), ``backend`` (URL id or ``""``), ``case`` (other parameters),
    ``outcome`` (``pass``, ``FAIL``, ``xfail``, ``skip``), ``detail`` (skip or xfail reason, failure message)
    and ``props`` (recorded properties)."""

    test: str
    backend: str
    case: str
    outcome: str
    detail: str = ""
    props: dict[str, str] = field(default_factory=dict)


def _split(name: str, backends: Sequence[str]) -> tuple[str, str, str]:
    test, _, params = name.partition("[")
    params = params.rstrip("]")
    for backend in sorted(backends, key=len, reverse=True):
        if params == backend or params.startswith(backend + "-"):
            return test, backend, params[len(backend) + 1:]
    return test, "", params


def read_results(path: str, backends: Sequence[str]) -> list[Result]:
    """Parse a junit XML file written by pytest into :class:`Result` s."""
    out = []
    for case in ET.parse(path).iter("testcase"):
        test, backend, params = _split(case.get("name", ""), backends)
        outcome, detail = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, detail = "FAIL", (child.get("message") or "").splitlines()[0][:160]
            elif child.tag == "skipped":
                kind = "xfail" if child.get("type") == "pytest.xfail" else "skip"
                outcome, detail = kind, child.get("message") or ""
        props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        out.append(Result(test, backend, params, outcome, detail, props))
    return out


def _cell(r: Result | None, text: str = "") -> str:
    if r is None:
        return "—"
    if r.outcome == "skip":
        return "skipped"
    mark = {"pass": "pass", "FAIL": "**FAIL**", "xfail": "xfail"}[r.outcome]
    return f"{mark} · {text}" if text and r.outcome != "skip" else mark


def _find(results: list[Result], test: str, backend: str, case: str = "") -> Result | None:
    for r in results:
        if r.test == test and r.backend == backend and r.case == case:
            return r
    return None


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _server_fault_text(r: Result) -> str:
    p = r.props
    if r.test == "test_server_restart_mid_rendezvous" and "recovery_s" in p:
        return f"down {p['downtime_s']} s, round {p['recovery_s']} s after restart"
    if r.test == "test_server_killed_mid_watch" and "watch_end_s" in p:
        return f"watch ended {p['watch_end_s']} s after kill ({p['watch_outcome']})"
    if r.test == "test_server_paused_longer_than_ttl" and "ttl_after_pause" in p:
        times = [float(p[f"paused_{op}_s"]) for op in PAUSED_OPS if f"paused_{op}_s" in p]
        return f"ops {min(times):.1f}–{max(times):.1f} s; TTL keys {p['ttl_after_pause']}"
    if r.test == "test_final_round_across_a_short_restart" and "round_survived" in p:
        return f"down {p['downtime_s']} s, round survived: {p['round_survived']}"
    return r.detail[:80] if r.outcome == "FAIL" else ""


def _ops_text(p: dict[str, str]) -> str:
    """``ops A–B s (errors)``, and the watch's time, from a network-fault test's properties."""
    times = [p[f"{op}_s"] for op in NET_OPS if op != "watch" and f"{op}_s" in p]
    if not times:
        return ""
    errors = sorted({p[f"{op}_error"] for op in NET_OPS if op != "watch" and f"{op}_error" in p})
    text = f"ops {min(times, key=float)}–{max(times, key=float)} s ({', '.join(errors)})"
    return text + (f", watch {p['watch_s']} s" if "watch_s" in p else "")


def _fault_text(r: Result) -> str:
    """What a network, cluster or clock test measured, for its cell (a failure's message if nothing)."""
    p = r.props
    if "summary" in p:
        text = p["summary"]
    elif r.test in dict(NET_MODES):
        text = _ops_text(p)
    elif r.test.startswith("test_store_calls_"):
        times = [v for k, v in p.items() if k.startswith("store.") and k.endswith("_s")]
        errors = sorted({v for k, v in p.items() if k.startswith("store.") and k.endswith("_error")})
        text = f"{len(times)} calls {min(times, key=float)}–{max(times, key=float)} s ({', '.join(errors)})" \
            if times else ""
    elif "raised_after_s" in p:
        text = f"RendezvousConnectionError after {p['raised_after_s']} s"
    elif r.test == "test_keepalive_outlives_a_black_hole_shorter_than_its_ttl" and "hole_s" in p:
        text = f"black hole {p['hole_s']} s"
    elif "recovery_s" in p:
        after = "pass" if r.test in NETWORK_FAULTS else "the kill"
        text = f"round {p['recovery_s']} s after {after}"
    elif "store_s" in p:
        lapsed = p.get("keepalive_lapsed", "?").replace("False", "no").replace("True", "YES")
        text = f"Store set+get {p['store_s']} s; keep-alives lapsed: {lapsed}"
    elif "put_s" in p:
        text = f"put {p['put_s']} s"
    elif "guarded_s" in p:
        text = f"all five {p['guarded_s']} s"
    elif "skew_s" in p:
        text = f"clock skew {p['skew_s']} s"
    else:
        text = ""
    return text or (r.detail[:80] if r.outcome == "FAIL" else "")


def _group(results: list[Result], title: str, tests: dict[str, str]) -> list[str]:
    """A scenario x backend table for tests that choose their own backends (:data:`OWN_SCHEMES`),
    then the reasons of any skips; nothing when none of ``tests`` ran."""
    mine = [r for r in results if r.test in tests]
    if not mine:
        return []
    columns = [b for b in OWN_SCHEMES if any(r.backend == b for r in mine)]
    columns += sorted({r.backend for r in mine} - set(columns))
    rows = [[name] + [_cell(r, _fault_text(r)) if (r := _find(results, test, b)) else "—" for b in columns]
            for test, name in tests.items()]
    out = [f"### {title}", ""] + _table(["scenario"] + columns, rows) + [""]
    skips = sorted({r.detail for r in mine if r.outcome == "skip"})
    return out + ([f"Skipped: {reason}" for reason in skips] + [""] if skips else [])


def _network_ops(results: list[Result]) -> list[str]:
    """Seconds (and error) of each operation through the black hole and the drop, per backend."""
    columns = [(test, mode, b) for b in OWN_SCHEMES for test, mode in NET_MODES
               if (r := _find(results, test, b)) and r.props]
    if not columns:
        return []

    def cell(test: str, b: str, op: str) -> str:
        p = _find(results, test, b).props  # type: ignore[union-attr]
        if f"{op}_s" not in p:
            return "—"
        error = p.get(f"{op}_error", "")
        return f"{p[f'{op}_s']} {ERROR_ABBREV.get(error, error)}".strip()

    out = [f"Seconds each operation took through the proxy (`operation_timeout=1`), and what it raised "
           f"({', '.join(f'{short}: `{name}`' for name, short in ERROR_ABBREV.items())}; a watch through the black "
           "hole has a 1 s timeout and may also return `[]`):", ""]
    rows = [[f"`{op}`"] + [cell(test, b, op) for test, _, b in columns] for op in NET_OPS]
    return out + _table(["operation"] + [f"{b}: {mode}" for _, mode, b in columns], rows) + [""]


def render(results: list[Result], backends: Sequence[str], command: str) -> str:
    """The markdown that goes between the markers."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"_Produced from a test run on {when} ({platform.machine()}, {os.cpu_count()} CPUs, Python "
           f"{platform.python_version()}) by:_", "", "```", command, "```", ""]
    out += ["### Server faults", ""]
    rows = [[title] + [_cell(r, _server_fault_text(r)) if (r := _find(results, test, b)) else "—" for b in backends]
            for test, title in SERVER_FAULTS.items()]
    out += _table(["scenario"] + list(backends), rows) + [""]
    servers = [b for b in backends if (r := _find(results, "test_server_paused_longer_than_ttl", b)) and r.props]
    if servers:
        out += ["Seconds each operation took against the paused server (`operation_timeout=1`):", ""]
        rows = [[f"`{op}`"] + [_find(results, "test_server_paused_longer_than_ttl", b).props.get(  # type: ignore[union-attr]
            f"paused_{op}_s", "—") for b in servers] for op in PAUSED_OPS]
        out += _table(["operation"] + servers, rows) + [""]
    matrix = [r for r in results if r.test == "test_survivors_reform_after_an_agent_dies"]
    if matrix:
        out += ["### Agent kill matrix (`tests/backends/test_fault_matrix.py`)", "",
                "Seconds from V stopping to the survivors' new round, SIGKILL / SIGTERM run, and the bound:", ""]
        seen = set(r.case for r in matrix)
        phases = [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))
        rows = []
        for phase in phases:
            row = [f"`{phase}`"]
            for b in backends:
                r = _find(results, "test_survivors_reform_after_an_agent_dies", b, phase)
                p = r.props if r else {}
                times = [("died" if p.get(f"{sig}_recovery_s") == "inf" else p.get(f"{sig}_recovery_s", "?"))
                         for sig in ("SIGKILL", "SIGTERM")]
                text = f"{times[0]} / {times[1]} s ≤ {p['bound_s']} s" if "SIGTERM_recovery_s" in p else ""
                row.append(_cell(r, text) if r else "—")
            rows.append(row)
        out += _table(["V stopped at"] + list(backends), rows) + [""]
    out += _group(results, "Network faults (`tests/backends/test_network_faults.py`)", NETWORK_FAULTS)
    out += _network_ops(results)
    out += _group(results, "etcd leader failure, three-member cluster (`tests/backends/test_etcd_cluster.py`)",
                  CLUSTER_FAULTS)
    out += _group(results, "Clock offset (`tests/core/test_clock_offset.py`)", CLOCK_FAULTS)
    out += _group(results, "Partitions between hosts (`tests/multihost/test_multihost_*.py`)", PARTITIONS)
    out += ["### Bad input", ""]
    rows = []
    for test in BAD_INPUT:
        cases = list(dict.fromkeys(r.case for r in results if r.test == test))
        for case in cases or [""]:
            label = f"`{test}`" + (f" [{case}]" if case else "")
            rows.append([label] + [_cell(_find(results, test, b, case)) for b in backends])
    out += _table(["test"] + list(backends), rows) + [""]
    out += _bad_input_times(results)
    own = set(NETWORK_FAULTS) | set(CLUSTER_FAULTS) | set(CLOCK_FAULTS) | set(PARTITIONS)
    solo = [r for r in results if not r.backend and r.test not in SERVER_FAULTS and r.test not in own
            and not r.test.startswith(BAD_INPUT_PREFIX)]
    if solo:
        out += ["### State-machine cases run once (`memory://`)", ""]
        out += _table(["test", "outcome"], [[f"`{r.test}`" + (f" [{r.case}]" if r.case else ""), _cell(r)]
                                            for r in solo]) + [""]
    bugs = sorted({r.detail for r in results if r.outcome == "xfail"})
    if bugs:
        out += ["### Reasons of the expected failures in this run (strict xfail)", ""]
        out += [f"- {reason}" for reason in bugs] + [""]
    failed = [f"{r.test}[{r.backend}{'-' if r.backend and r.case else ''}{r.case}]: {r.detail}"
              for r in results if r.outcome == "FAIL"]
    if failed:
        out += ["### Failures in this run", ""] + [f"- {f}" for f in failed] + [""]
    return "\n".join(out)


def _bad_input_times(results: list[Result]) -> list[str]:
    """The table of bad input held at the front door: what was given, where, the outcome, seconds to the error."""
    mine = [r for r in results if r.test.startswith(BAD_INPUT_PREFIX)]
    if not mine:
        return []
    rows = []
    for r in sorted(mine, key=lambda r: (r.test, r.backend, r.case)):
        seconds = r.props.get("time_to_error_s", "—")
        what = r.props.get("bad_input") or f"`{r.test}`" + (f" [{r.case}]" if r.case else "")
        rows.append([what, r.backend or "—", _cell(r), seconds])
    return ["### Bad input: time to a clear error (`tests/backends/test_bad_input*.py`)", ""] + _table(
        ["input", "backend", "outcome", "seconds to the error"], rows) + [""]


def _splice(path: str, body: str) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers to replace")
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + "\n" + body + "\n" + END + tail)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns pytest's exit status (0 when only rendering)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rdzv-url", action="append", default=[], help="backend URL (repeatable); default: CI's")
    parser.add_argument("--write", metavar="FILE", help="replace the results section of FILE (else print)")
    parser.add_argument("--from-xml", metavar="FILE", help="render this junit XML instead of running the tests")
    parser.add_argument("-n", default="2", help="pytest-xdist workers (default 2)")
    args = parser.parse_args(argv)
    has_pg = importlib.util.find_spec("rdzv_postgres") is not None
    urls = args.rdzv_url or [u for u in CI_URLS if has_pg or not u.startswith("postgresql")]
    backends = list(dict.fromkeys(u.split("://", 1)[0] for u in urls))
    status = 0
    command = "python -m conformance_tests.reliability_table" + "".join(f" --rdzv-url '{u}'" for u in args.rdzv_url)
    if args.write:
        command += f" --write {args.write}"
    if args.from_xml:
        xml_path = args.from_xml
    else:
        xml_path = os.path.join(tempfile.mkdtemp(prefix="rdzv-reliability-"), "results.xml")
        tests = [path for name in SOURCE_TESTS if os.path.exists(path := os.path.join(TESTS, name))]
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", args.n, f"--junitxml={xml_path}",
               os.path.join(HERE, "test_faults.py"), *tests]
        cmd += ["-p", "rdzv_postgres.testing"] if has_pg and any(u.startswith("postgresql") for u in urls) else []
        for url in urls:
            cmd += ["--rdzv-url", url]
        status = subprocess.call(cmd, cwd=os.path.dirname(HERE))
    body = render(read_results(xml_path, list(dict.fromkeys([*backends, *OWN_SCHEMES]))), backends, command)
    if args.write:
        _splice(args.write, body)
        print(f"wrote the results of {xml_path} into {args.write}")
    else:
        print(body)
    return status


if __name__ == "__main__":
    sys.exit(main())
