"""c10d Store throughput: ``set`` / ``get`` / ``add`` per second, 1 and 8 clients.

Each *client* is a thread with a connection of its own: an
:class:`rdzv_core.torch_api.store.KVStore` over its own backend client (``open_backend``),
or a ``torch.distributed.TCPStore`` client of the TCPStore the parent hosts (the
baseline). Clients are spread over the worker processes like the agents
(``memory`` keeps all of them in one process: its keyspace is per process).
All clients of one measurement start on one ``multiprocessing.Event`` and each
runs its operation in a loop for ``duration`` seconds; the rate is the number of
completed operations divided by ``duration``.

Operations: ``set`` writes a 32-byte value to one of 100 keys of the client's
own; ``get`` reads one key every client shares (present, so it never blocks);
``add`` adds 1 to ONE counter every client shares — contended, as c10d's barrier
counters are.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .harness import CellTimeout, LazyPool, split

__all__ = ["OPS", "measure_store", "StoreClients"]

OPS = ("set", "get", "add")
_VALUE = b"v" * 32


def _open_store(target: dict[str, Any]) -> tuple[Any, Any]:
    """One client: ``(store, backend or None)``."""
    import datetime

    if target["kind"] in ("tcpstore", "torch"):  # the TCPStore the parent hosts (torch:c10d's server)
        import torch.distributed as dist

        host, port = target["endpoint"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
        return store, None
    from rdzv_core import open_backend
    from rdzv_core.torch_api.store import KVStore

    kv = open_backend(target["url"])
    return KVStore(kv, target["prefix"], datetime.timedelta(seconds=60)), kv


class StoreClients:
    """The worker-side state: the clients this worker opened (see :func:`handle`)."""

    def __init__(self) -> None:
        self.clients: list[tuple[Any, Any]] = []

    def open(self, target: dict[str, Any], k: int) -> None:
        self.close()
        self.clients = [_open_store(target) for _ in range(k)]
        if self.clients:
            self.clients[0][0].set("shared-get", _VALUE)

    def run(self, op: str, n: int, event: Any, duration: float, tag: str) -> dict[str, Any]:
        return _run(self.clients[:n], op, event, duration, tag)

    def close(self) -> None:
        for _, kv in self.clients:
            if kv is not None:
                kv.close()
        self.clients = []


def _run(clients: list[tuple[Any, Any]], op: str, event: Any, duration: float, tag: str) -> dict[str, Any]:
    counts = [0] * len(clients)
    errors: list[str] = []
    release = threading.Event()

    def loop(i: int, store: Any) -> None:
        release.wait()
        end = time.monotonic() + duration
        n = 0
        try:
            while time.monotonic() < end:
                if op == "set":
                    store.set(f"{tag}-c{i}-{n % 100}", _VALUE)
                elif op == "get":
                    store.get("shared-get")
                else:
                    store.add(f"{tag}-counter", 1)
                n += 1
        except Exception as exc:  # reported with the result; the measurement stops for this client
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        counts[i] = n

    threads = [threading.Thread(target=loop, args=(i, c[0]), daemon=True) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    event.wait(120.0)
    release.set()
    for t in threads:
        t.join(duration + 60.0)
    return {"ops": sum(counts), "per_client": counts, "errors": errors}


def measure_store(pools: LazyPool, client_counts: list[int], duration: float) -> dict[str, Any]:
    """Ops/s of each operation for each client count on one store target.

    The workers answer ``("tp_open", k)`` with ``("opened", None)`` and
    ``("tp_run", op, n, event_index, duration, tag)`` with ``("armed", None)`` then
    ``("ran", {"ops": ..., "per_client": [...], "errors": [...]})``.

    Returns:
        ``{"<clients>": {"set": ops_per_s, "get": ..., "add": ..., "errors": [...]}}``; a
        failed target returns ``{"error": text}``.
    """
    out: dict[str, Any] = {}
    try:
        pool = pools.get()
        pool.call([("tp_open", k) for k in split(max(client_counts), pool.procs)], "opened", 120.0)
        for clients in client_counts:
            row: dict[str, Any] = {"errors": []}
            for op in OPS:
                index, event = pool.next_event()
                tag = f"t{clients}{op}{index}"
                pool.call([("tp_run", op, k, index, duration, tag) for k in split(clients, pool.procs)],
                          "armed", 60.0)
                event.set()
                answers = pool.gather("ran", time.monotonic() + duration + 90.0)
                row[op] = round(sum(a["ops"] for a in answers) / duration, 1)
                row["errors"].extend(e for a in answers for e in a["errors"])
            out[str(clients)] = row
        pool.call([("tp_close",)] * pool.procs, "closed", 60.0)
    except (CellTimeout, RuntimeError) as exc:
        out["error"] = str(exc)[:500]
        pools.kill()
    return out
