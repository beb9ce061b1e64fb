"""What a node's environment says about it: its topology labels, its place in the allocation and its run's
incarnation.

**Labels**, for ``rank_policy=topology`` (``docs/ranks.md``).

In order of precedence: the ``node_labels`` query key (``rdzv-run --node-labels``), then
:data:`LABELS_ENV` (``rack=r1,switch=s3``), then Slurm's ``SLURM_TOPOLOGY_ADDR`` with
``SLURM_TOPOLOGY_ADDR_PATTERN`` (set by ``srun`` under the ``topology/tree`` plugin: the switches
from the top level down to the leaf, then the node, ``.``-separated, e.g. ``s0.s3.node7`` with
pattern ``switch.switch.node``): the switches become ``switch1=s0,switch2=s3`` (the node name
is the host tie-break already).

**Place in the allocation** (``docs/ranks.md``): the ``node_order`` query key, else the first of
:data:`ORDER_SOURCES` set (Slurm's ``SLURM_NODEID``, set by ``srun`` per node of a step; a Kubernetes
Indexed Job's ``JOB_COMPLETION_INDEX``). Newcomers to a round take group ranks in this order.

**Incarnation** (``docs/design.md``, "Incarnations"): the ``incarnation`` query key, else a
scheduler's restart counter (:data:`INCARNATION_SOURCES`: Slurm's ``SLURM_RESTART_COUNT``, set in a
requeued job), else 0. A requeued job keeps its job id, and so the run id derived from it; its
incarnation keeps it out of the earlier, closed run.

**Node name** (``docs/node-health.md``): the ``node_name`` query key, else the first of
:data:`NODE_NAME_SOURCES` set, else the host name: the identity the run's node ledger keeps failures under.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping

from .errors import InvalidURLError
from .url import node_name, parse_node_labels, to_int

__all__ = ["LABELS_ENV", "environment_labels", "ORDER_SOURCES", "environment_order", "INCARNATION_SOURCES",
           "incarnation_of", "NODE_NAME_SOURCES", "environment_node_name"]

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


#: The schedulers' variables holding a node's place in its allocation, first set wins.
ORDER_SOURCES: tuple[str, ...] = ("SLURM_NODEID", "JOB_COMPLETION_INDEX")


def environment_order(environ: Mapping[str, str] | None = None) -> int | None:
    """This node's place in its scheduler's allocation from the first of :data:`ORDER_SOURCES` set to a
    non-empty value (an int >= 0), else ``None``.

    Raises:
        InvalidURLError: the variable is not an integer >= 0 (names the variable and its value).
    """
    found = _scheduler_int(ORDER_SOURCES, environ, "the scheduler's node index orders the first round's ranks "
                           "(set node_order=N in the URL or --rdzv-conf to choose it)")
    return None if found is None else found[0]


def _scheduler_int(sources: tuple[str, ...], environ: Mapping[str, str] | None,
                   meaning: str) -> tuple[int, str] | None:
    """``(value, variable)`` of the first of ``sources`` set to a non-empty value (an int >= 0), else ``None``.

    Raises:
        InvalidURLError: that variable is not an integer >= 0 (names it, its value and ``meaning``).
    """
    env = os.environ if environ is None else environ
    for name in sources:
        raw = env.get(name, "")
        if raw != "":
            try:
                return to_int(name, raw, 0), name
            except InvalidURLError as exc:
                raise InvalidURLError(name, raw, f"{exc.reason}: {meaning}") from None
    return None


#: The schedulers' restart counters a run's incarnation is taken from when the query has none, first set wins.
INCARNATION_SOURCES: tuple[str, ...] = ("SLURM_RESTART_COUNT",)


def incarnation_of(query: Mapping[str, object], environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The run's incarnation and where it came from: ``(n, "query")`` if ``query`` (a URL's converted
    ``params``) has ``incarnation``, else ``(n, VARIABLE)`` from the first of :data:`INCARNATION_SOURCES`
    set to a non-empty value, else ``(0, "default")``. ``n`` is an int >= 0.

    Raises:
        InvalidURLError: the variable is not an integer >= 0 (names the variable and its value).
    """
    given = query.get("incarnation")
    if isinstance(given, int) and not isinstance(given, bool):
        return given, "query"
    found = _scheduler_int(INCARNATION_SOURCES, environ, "the scheduler's restart count is this run's "
                           "incarnation (set incarnation=N in the URL or --rdzv-conf to choose it)")
    return found if found is not None else (0, "default")


#: Where a node's name in the run's ledger comes from when the query has no ``node_name``, first set wins: the
#: launcher's own variable, Slurm's node name (set by ``slurmd`` in every step), a Kubernetes pod's node name
#: (``NODE_NAME``, from the manifests' ``spec.nodeName`` field reference); else the host name.
NODE_NAME_SOURCES: tuple[str, ...] = ("RDZV_NODE_NAME", "SLURMD_NODENAME", "NODE_NAME")


def environment_node_name(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(name, source)``: this node's name in the run's ledger from the first of :data:`NODE_NAME_SOURCES` set
    to a non-empty value, else ``(host name, "hostname")``.

    Raises:
        InvalidURLError: the variable holds no valid node name (names the variable and its value).
    """
    env = os.environ if environ is None else environ
    for name in NODE_NAME_SOURCES:
        raw = env.get(name, "")
        if raw != "":
            return node_name(name, raw), name
    return socket.gethostname(), "hostname"
