"""Reading the records ``benchmarks/trainer.py`` workers write (without importing torch, as the trainer does)."""

from __future__ import annotations

import json
import os

__all__ = ["read_records"]


def read_records(out: str, node: str, kind: str = "step") -> list[dict[str, object]]:
    """The records of ``kind`` (``"step"`` or ``"start"``) that node ``node``'s workers wrote under ``out`` so
    far, in file order (a line being written is skipped; no file yet: none)."""
    try:
        with open(os.path.join(out, f"steps-{node}.jsonl")) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("kind") == kind:
            found.append(record)
    return found
