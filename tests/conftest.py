"""Which backends the launcher-level scenarios run over, and how many launcher tests run at once.

The conformance plugin runs every test that takes ``rdzv_base_url`` once per ``--rdzv-url``. Tests marked
``agent_scenario`` exercise the launcher (``rdzv-run``, torchrun with the ``rdzv-*`` handlers) on top of the
handler: what they check does not depend on the backend (the agent knows only the handler), and each takes
seconds to minutes of real processes. They run over :data:`AGENT_SCENARIO_BACKENDS` only -- the embedded
default -- and over Redis where a test has no ``file`` variant; they are deselected for the other URLs
(the suite's wall time on 2 cores); ``--rdzv-every-backend`` runs them over all.
Every backend is covered by the conformance suite, by the membership scenarios that depend on a backend's
watch and TTL (``tests/multihost/test_membership.py``: a frozen node, a spare) and by the multi-host scenarios.

Modules marked ``launchers`` start launchers (``rdzv-run``, ``torchrun``: ``import torch``, 2-3 s of CPU each) or
torch workers; most other tests wait (TTLs, last calls, partitions) far more than they compute. Under
``pytest -n N --dist loadgroup`` (``scripts/test.sh``: its main run, and a selection) the launcher tests are
split by test id into ``--launcher-streams`` groups (default :data:`LAUNCHER_STREAMS`), each run by one worker, so
at most that many run at once while the other workers take the waiting tests (docs/testing.md, "Suite time")."""

from __future__ import annotations

import sys
import zlib

import pytest

#: URL schemes (or ``backend`` fixture ids) the ``agent_scenario`` tests run over.
AGENT_SCENARIO_BACKENDS = ("file",)
#: The scheme a launcher-level test without a ``file`` variant runs over.
AGENT_SCENARIO_FALLBACK = "redis"
#: Launcher tests (marker ``launchers``) that run at once under ``--dist loadgroup`` by default: one per core here
#: (``--launcher-streams N`` to choose).
LAUNCHER_STREAMS = 2


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--rdzv-every-backend", action="store_true", default=False,
                     help="run the agent_scenario tests over every --rdzv-url, not only "
                          f"{', '.join(AGENT_SCENARIO_BACKENDS)}")
    parser.addoption("--launcher-streams", type=int, default=LAUNCHER_STREAMS, metavar="N",
                     help="under --dist loadgroup, run the launchers tests in N groups: at most N at once "
                          f"(default {LAUNCHER_STREAMS})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "agent_scenario: launcher-level scenario, run over "
                            f"{' and '.join(AGENT_SCENARIO_BACKENDS)} only (tests/conftest.py)")
    config.addinivalue_line("markers", "launchers: starts launchers or torch workers (CPU-bound); under --dist "
                            "loadgroup at most --launcher-streams run at once (tests/conftest.py)")


def _backend_of(item: pytest.Item) -> str | None:
    """The scheme of the backend ``item`` runs over (``rdzv_base_url`` or a ``backend`` fixture), if any."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    url = params.get("rdzv_base_url")
    if isinstance(url, str):
        return url.split("://", 1)[0]
    backend = params.get("backend")
    return backend if isinstance(backend, str) else None


def _group_launcher_tests(items: list[pytest.Item], streams: int) -> None:
    """Give each ``launchers`` test one of ``streams`` ``xdist_group`` names, by a stable hash of
    its id (every xdist worker must compute the same groups), and the ``scheduler`` tests one group (one Slurm
    cluster); ``--dist loadgroup`` runs a group on one worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if item.get_closest_marker("scheduler") is not None:
            item.add_marker(pytest.mark.xdist_group("scheduler"))
        elif item.get_closest_marker("launchers") is not None:
            stream = zlib.crc32(item.nodeid.encode()) % streams
            item.add_marker(pytest.mark.xdist_group(f"launchers-{stream}"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    streams = config.getoption("--launcher-streams")
    if streams < 1:
        raise pytest.UsageError(f"--launcher-streams: {streams} is not a positive number of streams")
    _group_launcher_tests(items, streams)
    if config.getoption("--rdzv-every-backend"):
        return
    def test_of(item: pytest.Item) -> str:
        return item.nodeid.split("[", 1)[0]

    covered = {test_of(item) for item in items if _backend_of(item) in AGENT_SCENARIO_BACKENDS}
    keep, drop = [], []
    for item in items:
        scheme = _backend_of(item)
        chosen = scheme is None or scheme in AGENT_SCENARIO_BACKENDS or (
            scheme == AGENT_SCENARIO_FALLBACK and test_of(item) not in covered)
        (keep if chosen or item.get_closest_marker("agent_scenario") is None else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    """Fail the run when ``--dist loadgroup`` would not group: xdist marks a grouped test by appending
    ``@group`` to its node id on the worker, which pytest 9.2's structured node ids ignore (pytest-xdist#1386),
    and the tests would then be spread over every worker without a word.

    Raises:
        pytest.UsageError: on an xdist worker under ``--dist loadgroup``, a test marked ``xdist_group`` kept its
            plain node id.
    """
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            message = (f"--dist loadgroup does not group with pytest {pytest.__version__} ({item.nodeid} has no "
                       "'@group' suffix; pytest-xdist#1386): install the test extra's pytest (<9.2)")
            print(message, file=sys.stderr)  # xdist's controller does not show a worker's UsageError
            raise pytest.UsageError(message)
