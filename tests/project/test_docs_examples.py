"""Every ```python example in README.md and docs/*.md runs (and does what it says)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _examples() -> list[tuple[str, int, str]]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for match in _BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            out.append((path.relative_to(ROOT).as_posix(), line, match.group(1)))
    return out


@pytest.mark.parametrize("where, line, code", _examples(), ids=[f"{w}:{n}" for w, n, _ in _examples()])
def test_example_runs(where: str, line: int, code: str, tmp_path, monkeypatch) -> None:
    from rdzv_core.plugins import hookspec

    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_example_{line}", "hookspec": hookspec, "Sequence": Sequence}
    exec(compile(code, f"{where}:{line}", "exec"), namespace)  # noqa: S102 - the point of the test
    plugin = namespace.get("plugin")
    if plugin is not None:  # a plugin example must register what it says
        specs = plugin.rdzv_register_backends()  # type: ignore[attr-defined]
        assert specs and all(spec.schemes for spec in specs)


def test_there_are_examples() -> None:
    assert len(_examples()) >= 3
