"""docs/plugins.md stays true: its support matrix matches the registry, its capability list the dataclass."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance_tests import matrix
from rdzv_core import Capabilities, list_backends

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
FIX = "run: python -m conformance_tests.matrix --write docs/plugins.md"


@pytest.fixture(scope="module")
def documented() -> dict[str, tuple[str, ...]]:
    """Backend name cell (e.g. ``"`memory`"``) -> its row, from the table in docs/plugins.md."""
    rows = matrix.parse(matrix.extract(DOC.read_text(encoding="utf-8")))
    return {r[0]: r for r in rows}


def test_every_installed_backend_has_its_row(documented: dict[str, tuple[str, ...]]) -> None:
    for row in matrix.rows():
        assert row[0] in documented, f"docs/plugins.md has no row for installed backend {row[0]}; {FIX}"
        assert documented[row[0]] == row, (
            f"docs/plugins.md row for {row[0]} disagrees with the registry:\n"
            f"  doc:      {documented[row[0]]}\n  registry: {row}\n{FIX}"
        )


def test_rows_without_an_installed_backend_are_third_party(documented: dict[str, tuple[str, ...]]) -> None:
    """A row may outlive its backend only if a plugin distribution (not this project) provides it."""
    installed = {r[0] for r in matrix.rows()}
    for name, row in documented.items():
        if name not in installed:
            assert row[2] != "rdzv", f"docs/plugins.md lists {name}, which rdzv no longer provides; {FIX}"


def test_table_header_is_the_capability_list(documented: dict[str, tuple[str, ...]]) -> None:
    header = matrix.extract(DOC.read_text(encoding="utf-8")).splitlines()[0]
    assert header == matrix.render([]).splitlines()[0], f"docs/plugins.md table header is stale; {FIX}"
    assert all(len(row) == len(matrix.HEADER) for row in documented.values())


def test_capabilities_section_names_every_field() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Capabilities", 1)[1].split("## Support matrix", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    assert documented == set(Capabilities.__dataclass_fields__), "docs/plugins.md: capability table is stale"


def test_matrix_covers_every_scheme() -> None:
    cells = " ".join(row[1] for row in matrix.rows())
    for scheme in list_backends():
        assert f"`{scheme}`" in cells


def test_write_replaces_only_the_block(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{matrix.BEGIN}\nold table\n{matrix.END}\nafter\n", encoding="utf-8")
    assert matrix.main(["--write", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("before\n") and text.endswith(f"{matrix.END}\nafter\n")
    assert matrix.parse(matrix.extract(text)) == matrix.rows()


def test_missing_markers_are_an_error() -> None:
    with pytest.raises(ValueError, match="support matrix"):
        matrix.replace_block("no markers here", matrix.render())
