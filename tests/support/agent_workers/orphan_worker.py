"""A worker that leaves a helper behind, as data loaders, compile servers and sidecars do (no torch).

It starts a helper in a new session (``start_new_session=True``: its own session and
process group) that inherits the worker's stdout and stderr (the launcher's pipes) and
sleeps 600 s; the helper's pid goes to ``OUT/helper-<RANK>-<TORCHELASTIC_RESTART_COUNT>.pid``
(written atomically, after the helper started). Then the worker:

--fail-attempts K   exits 1 while ``TORCHELASTIC_RESTART_COUNT`` < K (K=-1, the default: always);
                    otherwise it blocks until ``--wait-for`` exists (at most 120 s), then exits 0
--wait-for PATH     the file the worker waits for once it no longer fails
--scrub-env         start the helper with an empty environment (nothing of the worker's)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

#: Seconds the helper sleeps: far longer than any test (it must be killed).
HELPER_SECONDS = 600


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fail-attempts", type=int, default=-1)
    p.add_argument("--wait-for", default=None)
    p.add_argument("--scrub-env", action="store_true")
    args = p.parse_args()

    rank = os.environ["RANK"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    helper = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({HELPER_SECONDS})"],
                              start_new_session=True, env={} if args.scrub_env else None)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"helper-{rank}-{attempt}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(helper.pid))
    os.replace(path + ".tmp", path)
    print(f"worker rank {rank} attempt {attempt}: helper pid {helper.pid}", file=sys.stderr, flush=True)
    if args.fail_attempts < 0 or attempt < args.fail_attempts:
        print(f"worker rank {rank} attempt {attempt}: failing", file=sys.stderr, flush=True)
        return 1
    deadline = time.monotonic() + 120
    while args.wait_for is None or not os.path.exists(args.wait_for):
        if time.monotonic() > deadline:
            return 9
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
