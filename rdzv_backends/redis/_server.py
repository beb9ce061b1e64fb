"""What a Redis server must not be, read with ``INFO`` when a backend opens (no ``CONFIG`` rights needed).

* **Evicting** (``maxmemory`` > 0 with a ``maxmemory-policy`` other than ``noeviction``): Redis would
  delete keys under memory pressure, and an evicted round record, ticket or keep-alive key looks like
  a delete to the rendezvous (a round destroyed, a member lost, a version counter set back).
  Refused unless the URL says ``allow_eviction=true`` (then a WARNING).
* **Cluster mode** (``cluster_enabled:1``): every write is one Lua script over this backend's
  bookkeeping keys, which a cluster spreads over slots of different nodes, and a cluster's
  asynchronous replication can lose acknowledged writes on failover. Always refused.
* **A replica** (``role:slave``): it refuses every write (``READONLY``). Always refused, naming its
  master.
"""

from __future__ import annotations

import logging
from typing import Mapping

from rdzv_core.errors import UnsuitableServerError

__all__ = ["parse_info", "check_server", "ALLOW_EVICTION"]

log = logging.getLogger(__name__)

#: The query key that accepts an evicting server.
ALLOW_EVICTION = "allow_eviction"


def parse_info(text: bytes | str) -> dict[str, str]:
    """The ``field:value`` lines of an ``INFO`` reply (section headers and blank lines skipped)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            fields[name.strip()] = value.strip()
    return fields


def check_server(info: Mapping[str, str], where: str, allow_eviction: bool) -> tuple[str, ...]:
    """Judge a server by its ``INFO`` fields (:func:`parse_info`).

    Args:
        info: the ``INFO`` fields (at least the ``memory`` and ``cluster`` sections'; a field absent
            counts as harmless: ``maxmemory`` 0, cluster mode off).
        where: the server as shown in messages, ``"HOST:PORT"``.
        allow_eviction: accept an evicting server (the URL's ``allow_eviction=true``).

    Returns:
        warnings, one line each (an evicting server that ``allow_eviction`` accepts); each is logged
        at WARNING too.

    Raises:
        UnsuitableServerError: cluster mode (``field`` ``cluster_enabled``); a replica (``field`` ``role``);
            an evicting server without ``allow_eviction`` (``field`` ``maxmemory-policy``, ``value`` the policy).
    """
    if info.get("cluster_enabled", "0") not in ("", "0"):
        raise UnsuitableServerError(
            "cluster_enabled", info["cluster_enabled"],
            f"Redis at {where} runs in cluster mode (cluster_enabled:{info['cluster_enabled']}), which rdzv does not "
            "support: its writes are Lua scripts over keys a cluster spreads across nodes, and a cluster's failover "
            "can lose acknowledged writes; use a single Redis server (redis://), Redis Sentinel (redis+sentinel://), "
            "or etcd (etcd-v3://h1,h2,h3/...) for replication")
    if info.get("role") == "slave":
        master = f"{info.get('master_host', '?')}:{info.get('master_port', '?')}"
        raise UnsuitableServerError(
            "role", "replica",
            f"Redis at {where} is a read-only replica (of {master}): point redis:// at the master, or use Redis "
            "Sentinel (redis+sentinel://SENTINELS/RUN_ID?master_name=NAME) to follow the master through failovers")
    policy = info.get("maxmemory_policy", "noeviction")
    maxmemory = _int(info.get("maxmemory", "0"))
    if maxmemory <= 0 or policy == "noeviction":
        return ()
    shown = info.get("maxmemory_human") or f"{maxmemory} bytes"
    what = (f"Redis at {where} evicts keys (maxmemory-policy {policy} with maxmemory {shown}): rendezvous keys "
            f"would vanish")
    if not allow_eviction:
        raise UnsuitableServerError(
            "maxmemory-policy", policy,
            f"{what}; set maxmemory-policy noeviction, or pass ?{ALLOW_EVICTION}=true")
    warning = f"{what}; accepted ({ALLOW_EVICTION}=true): an evicted key looks like a delete to the rendezvous"
    log.warning("%s", warning)
    return (warning,)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0
