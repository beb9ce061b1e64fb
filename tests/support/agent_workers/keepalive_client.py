"""Keys kept alive from a multi-host test's host: ``python keepalive_client.py URL COUNT TTL``.

Puts ``COUNT`` keys with ``TTL`` and refreshes each with a :class:`~rdzv_core.rendezvous.keepalive.KeepAlive` over one
client of ``URL``; prints ``{"ready": true}``, then answers each stdin line with a JSON report: the keys found
lapsed (``lapses``), the longest time between two successful refreshes of a key (``worst_gap``, s, the put
counting as the first) and how many refreshes worked (``refreshed``).
"""

from __future__ import annotations

import json
import sys
import threading
import time

from rdzv_core import open_backend
from rdzv_core.rendezvous.keepalive import KeepAlive


def main() -> int:
    url, count, ttl = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    kv = open_backend(url)
    lock = threading.Lock()
    last: dict[str, float] = {}
    report = {"lapses": [], "worst_gap": 0.0, "refreshed": 0}

    def refreshed(key: str, error: BaseException | None) -> None:
        if error is None:
            with lock:
                now = time.monotonic()
                report["worst_gap"] = max(report["worst_gap"], now - last[key])
                report["refreshed"] += 1
                last[key] = now

    def lapsed(key: str) -> None:
        with lock:
            report["lapses"].append(key)

    alive = []
    for i in range(count):
        key = f"ka/{i}"
        kv.put(key, b"x", ttl=ttl)
        last[key] = time.monotonic()
        alive.append(KeepAlive(kv, key, ttl, value=b"x", on_refresh=lambda e, k=key: refreshed(k, e),
                               on_lapse=lambda k=key: lapsed(k)))
        time.sleep(ttl / 3 / count)  # refreshes spread over the interval
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        with lock:
            print(json.dumps(report), flush=True)
    for ka in alive:
        ka.stop()
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
