"""A node's topology labels from its environment, for ``rank_policy=topology`` (``docs/ranks.md``).

In order of precedence: the ``node_labels`` query key (``rdzv-run --node-labels``), then
:data:`LABELS_ENV` (``rack=r1,switch=s3``), then Slurm's ``SLURM_TOPOLOGY_ADDR`` with
``SLURM_TOPOLOGY_ADDR_PATTERN`` (set by ``srun`` under the ``topology/tree`` plugin: the switches
from the top level down to the leaf, then the node, ``.``-separated, e.g. ``s0.s3.node7`` with
pattern ``switch.switch.node``): the switches become ``switch1=s0,switch2=s3`` (the node name
is the host tie-break already).
"""

from __future__ import annotations

import os
from typing import Mapping

from .url import parse_node_labels

__all__ = ["LABELS_ENV", "environment_labels"]

#: The environment variable a node's labels may be given in (read by the handler, also under plain torchrun).
LABELS_ENV = "RDZV_NODE_LABELS"


def environment_labels(environ: Mapping[str, str] | None = None) -> str:
    """This node's labels as ``KEY=VALUE[,...]`` text from the environment (``""``: none).

    Raises:
        InvalidURLError: :data:`LABELS_ENV` is set but not ``KEY=VALUE[,KEY=VALUE...]`` (names it).
    """
    env = os.environ if environ is None else environ
    text = env.get(LABELS_ENV, "").strip()
    if text:
        parse_node_labels(LABELS_ENV, text)
        return text
    addr, pattern = env.get("SLURM_TOPOLOGY_ADDR", ""), env.get("SLURM_TOPOLOGY_ADDR_PATTERN", "")
    names, kinds = addr.split("."), pattern.split(".")
    if not addr or len(names) != len(kinds):
        return ""
    switches = [name for name, kind in zip(names, kinds, strict=True) if kind == "switch" and name]
    text = ",".join(f"switch{i}={name}" for i, name in enumerate(switches, 1))
    try:
        parse_node_labels("SLURM_TOPOLOGY_ADDR", text)
    except ValueError:
        return ""  # a switch name these labels cannot hold: not ours to refuse
    return text
