"""The conformance suite catches broken backends, and its failures name the broken contract.

The deliberately broken backends of :mod:`conformance_tests.broken` are
registered through a throwaway distribution (an ``rdzv`` entry point in a
``*.dist-info`` on ``PYTHONPATH``, so the helper processes of the suite see them
too). For each, the relevant conformance tests run in a subprocess pytest; the
test asserts which ones FAIL and that the failure message names the contract.
``memory://`` runs the same selection as the control: everything passes there,
so the failures come from the bugs, not from the machine. The runs go in
parallel (about 20 s: the slowest waits out the suite's 15 s patience for an
expiry that never comes).

Also checked statically: every skip in the suite states its reason, and no test
returns early on a capability (which would pass silently instead of skipping).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import conformance_tests

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

SUITE = Path(conformance_tests.__file__).parent
RUN_TIMEOUT = 150.0


@dataclass(frozen=True)
class Case:
    """Tests to run against one scheme: ``fail`` maps test -> text its failure message must contain."""

    tests: tuple[str, ...]
    fail: dict[str, str] = field(default_factory=dict)


CASES: dict[str, Case] = {
    "broken-cas": Case(
        tests=("test_protocol.py::test_cas_stale_revision_fails",
               "test_protocol.py::test_concurrent_cas_has_one_winner",
               "test_protocol.py::test_compare_and_delete", "test_protocol.py::test_put_get_roundtrip"),
        fail={
            "test_cas_stale_revision_fails": "compare_and_swap with a stale revision must raise CompareFailedError",
            "test_concurrent_cas_has_one_winner": "compare_and_swap must be atomic",
        },
    ),
    "broken-ttl": Case(
        tests=("test_protocol_ttl_watch.py::test_ttl_expiry_is_a_delete_event",
               "test_protocol_ttl_watch.py::test_refresh_absent_key"),
        fail={"test_ttl_expiry_is_a_delete_event": "expiry never reached watch as a DELETE"},
    ),
    "broken-watch": Case(
        tests=("test_protocol_ttl_watch.py::test_watch_sees_every_change_in_order",
               "test_protocol_ttl_watch.py::test_watch_returns_history_immediately"),
        fail={"test_watch_sees_every_change_in_order": "watch must return every change under the prefix (deletes too)"},
    ),
    "broken-multiprocess": Case(
        tests=("test_capabilities.py::test_multi_process_shares_one_keyspace",
               "test_capabilities.py::test_persistent_state_outlives_its_writer",
               "test_protocol.py::test_put_get_roundtrip"),
        fail={
            "test_multi_process_shares_one_keyspace": "declares multi_process=True, but another process did not see",
            "test_persistent_state_outlives_its_writer": "declares persistent=True, but a key written by a process",
        },
    ),
}
# The control: a correct backend runs every selected test; none may fail.
CASES["memory"] = Case(tests=tuple(sorted({t for c in CASES.values() for t in c.tests})))


@dataclass(frozen=True)
class Outcome:
    status: str  # "passed", "failed", "error" or "skipped"
    message: str


def _outcomes(junit_xml: Path) -> dict[str, Outcome]:
    """Test name (without the parameter) -> :class:`Outcome`, from a pytest JUnit XML report."""
    out: dict[str, Outcome] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message = f"{node.get('message', '')}\n{node.text or ''}"
                break
        out[name] = Outcome(status, message)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Outcome]]:
    """Run every case in its own pytest process, all at once; scheme -> test -> outcome."""
    root = tmp_path_factory.mktemp("broken-backends")
    dist = root / "rdzv_broken_backends-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rdzv-broken-backends\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[rdzv]\nbroken = conformance_tests.broken:plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    started = {}
    for scheme, case in CASES.items():
        report = root / f"{scheme}.xml"
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rdzv-url", f"{scheme}://catch/",
                f"--junitxml={report}", *(str(SUITE / t) for t in case.tests)]
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started[scheme] = (proc, report)
    results: dict[str, dict[str, Outcome]] = {}
    try:
        for scheme, (proc, report) in started.items():
            output, _ = proc.communicate(timeout=RUN_TIMEOUT)
            assert report.exists(), f"pytest against {scheme}:// wrote no report:\n{output[-3000:]}"
            results[scheme] = _outcomes(report)
            results[scheme]["<output>"] = Outcome("", output)
    finally:
        for proc, _ in started.values():
            proc.kill()
            proc.wait()
    return results


@pytest.mark.parametrize("scheme", [s for s in CASES if s != "memory"])
def test_suite_fails_a_broken_backend_naming_the_contract(runs: dict[str, dict[str, Outcome]], scheme: str) -> None:
    case, outcomes = CASES[scheme], runs[scheme]
    log = outcomes["<output>"].message[-3000:]
    for test in (t.split("::")[1] for t in case.tests):
        assert test in outcomes, f"{test} did not run against {scheme}://:\n{log}"
        got = outcomes[test]
        if test in case.fail:
            assert got.status == "failed", f"{test} should FAIL against {scheme}:// but {got.status}:\n{got.message}"
            assert case.fail[test] in got.message, (
                f"{test} failed against {scheme}:// without naming the contract {case.fail[test]!r}:\n{got.message}"
            )
        else:  # the rest of the backend works: the failures point at the one bug
            assert got.status == "passed", f"{test} should pass against {scheme}:// but {got.status}:\n{got.message}"


def test_control_memory_backend_passes_the_same_selection(runs: dict[str, dict[str, Outcome]]) -> None:
    outcomes = runs["memory"]
    for test in (t.split("::")[1] for t in CASES["memory"].tests):
        got = outcomes.get(test)
        assert got is not None, f"{test} did not run against memory://:\n{outcomes['<output>'].message[-3000:]}"
        if got.status == "skipped":  # memory:// declares multi_process=False and persistent=False
            assert "declares" in got.message, f"{test} skipped without naming the capability: {got.message}"
        else:
            assert got.status == "passed", f"{test} {got.status} against memory://:\n{got.message}"


# -- static checks of the suite's source ---------------------------------------------------------
SKIPS = {"skip", "xfail", "importorskip"}
SKIP_MARKS = {"skip", "skipif", "xfail"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _has_reason(call: ast.Call, positional: bool) -> bool:
    texts = [kw.value for kw in call.keywords if kw.arg in ("reason", "msg")]
    if positional and call.args:
        texts.append(call.args[0])
    for text in texts:
        if isinstance(text, ast.JoinedStr) or (isinstance(text, ast.Constant) and isinstance(text.value, str)
                                               and text.value.strip()):
            return True
    return False


def _suite_files() -> list[Path]:
    return sorted(p for p in SUITE.glob("*.py") if p.name.startswith("test_"))


@pytest.mark.parametrize("path", _suite_files(), ids=lambda p: p.name)
def test_every_skip_in_the_suite_states_its_reason(path: Path) -> None:
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in {f"pytest.{s}" for s in SKIPS - {"importorskip"}}:
            ok = _has_reason(node, positional=True)
        elif name in {f"pytest.mark.{m}" for m in SKIP_MARKS}:
            ok = _has_reason(node, positional=name.endswith(".skip"))
        else:
            continue  # pytest.importorskip states "could not import ..." itself
        if not ok:
            missing.append(f"{path.name}:{node.lineno}: {name}(...) without a reason")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("path", _suite_files(), ids=lambda p: p.name)
def test_no_test_returns_early_on_a_capability(path: Path) -> None:
    """``if not capabilities.x: return`` would pass silently; the suite must ``pytest.skip`` instead."""
    early = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and "capabilities" in ast.unparse(node.test):
            if any(isinstance(stmt, ast.Return) for stmt in node.body):
                early.append(f"{path.name}:{node.lineno}: returns early on {ast.unparse(node.test)}")
    assert not early, "\n".join(early)
