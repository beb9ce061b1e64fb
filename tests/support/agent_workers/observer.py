"""A read-only observer of rendezvous runs, run as a process on a multi-host test's host.

Usage: ``python observer.py BASE_URL`` (a URL without run id, e.g. ``redis://10.231.7.1:6379/``). It
opens one client and answers one JSON line per request line read from stdin: a run id gives
``Rendezvous(kv, RUN_ID, ...).describe()`` (``{"error": TYPE: MESSAGE}`` if that failed). A test
process cannot use a client of its own where the backend lives in another network namespace (gRPC
and connection pools connect from threads of their own), hence a process on the host.
"""

from __future__ import annotations

import json
import sys

from rdzv_core import RdzvError, Rendezvous, RendezvousParams, open_backend


def main() -> int:
    kv = open_backend(sys.argv[1])
    params = RendezvousParams(min_nodes=1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        run_id = line.strip()
        try:
            answer = Rendezvous(kv, run_id, params).describe()
        except RdzvError as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
