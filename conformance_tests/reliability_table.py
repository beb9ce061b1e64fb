"""Run the fault tests and render their results as the tables of ``docs/reliability.md``.

::

    python -m conformance_tests.reliability_table --write docs/reliability.md
    python -m conformance_tests.reliability_table --from-xml results.xml      # render only, to stdout

It runs ``conformance_tests/test_faults.py`` and, in a source checkout,
``tests/test_fault_matrix.py`` with ``pytest -n 2 --junitxml`` against the
backend URLs CI uses (``--rdzv-url`` to choose others; the PostgreSQL example's
server fixture is loaded when ``rdzv_postgres`` is installed), reads the
outcome and the measured times (``record_property``) of every test, and
replaces what lies between the two ``results`` markers of the target file
(everything else in the file is kept as written). The tests themselves fail on
a broken expectation; this script only reports.
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
MATRIX = os.path.join(os.path.dirname(HERE), "tests", "test_fault_matrix.py")

SERVER_FAULTS = {
    "test_server_restart_mid_rendezvous": "server killed and restarted mid-rendezvous",
    "test_server_killed_mid_watch": "server killed mid-watch",
    "test_server_paused_longer_than_ttl": "server paused (SIGSTOP) longer than the TTL",
    "test_final_round_across_a_short_restart": "final round across a short restart (TTL 4 s)",
}
BAD_INPUT = ("test_corrupt_round_record_names_the_key_and_reset_recovers", "test_corrupt_counter_is_a_state_error",
             "test_value_above_the_limit_fails_at_once", "test_multi_set_with_one_value_above_the_limit_writes_nothing")
PAUSED_OPS = ("get", "put", "list", "add", "refresh", "watch", "store.get", "store.set")
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
        out += ["### Agent kill matrix (`tests/test_fault_matrix.py`)", "",
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
    out += ["### Bad input", ""]
    rows = []
    for test in BAD_INPUT:
        cases = list(dict.fromkeys(r.case for r in results if r.test == test))
        for case in cases or [""]:
            label = f"`{test}`" + (f" [{case}]" if case else "")
            rows.append([label] + [_cell(_find(results, test, b, case)) for b in backends])
    out += _table(["test"] + list(backends), rows) + [""]
    solo = [r for r in results if not r.backend and r.test not in SERVER_FAULTS]
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
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", args.n, f"--junitxml={xml_path}",
               os.path.join(HERE, "test_faults.py")] + ([MATRIX] if os.path.exists(MATRIX) else [])
        cmd += ["-p", "rdzv_postgres.testing"] if has_pg and any(u.startswith("postgresql") for u in urls) else []
        for url in urls:
            cmd += ["--rdzv-url", url]
        status = subprocess.call(cmd, cwd=os.path.dirname(HERE))
    body = render(read_results(xml_path, backends), backends, command)
    if args.write:
        _splice(args.write, body)
        print(f"wrote the results of {xml_path} into {args.write}")
    else:
        print(body)
    return status


if __name__ == "__main__":
    sys.exit(main())
