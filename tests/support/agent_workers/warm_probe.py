"""Probe for warm workers: reports what the worker sees, then ends as ``argv[1]`` says for this restart.

Writes ``$WARM_PROBE_OUT/<RANK>-<TORCHELASTIC_RESTART_COUNT>.json`` with ``sys.argv``, the environment,
``__name__``, ``__file__``, ``sys.path[0]``, cwd, ``__main__`` globals, a pickle round trip of a class
defined here, signal dispositions, session/process group, parent-death signal, scheduling policy, open
fds, and whether it runs in a warm process (its command line names the warm boot). Then, for restart
``N``, action ``argv[1].split(",")[N]``: ``ok`` (exit 0), ``exit3`` (``sys.exit(3)``), ``raise`` (an
uncaught exception), ``record`` (an exception under torch's ``@record``), ``signal`` (SIGUSR1 to itself),
``hang`` (wait for ever). Local rank 0 does the action only after the other local ranks (exit 0) are gone,
so every run ends the same way.
"""

import ctypes
import json
import os
import pickle
import re
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record


class Payload:
    """Pickled by reference to ``__main__``."""

    def __init__(self, value: int) -> None:
        self.value = value


MAIN_KEYS = sorted(globals())
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGUSR1", "SIGCHLD", "SIGXFSZ", "SIGALRM")


def _disposition(sig: signal.Signals) -> str:
    handler = signal.getsignal(sig)
    return getattr(handler, "__name__", None) or str(handler)


def report() -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    pdeath = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(pdeath), 0, 0, 0)  # PR_GET_PDEATHSIG
    main = sys.modules["__main__"]
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode()
    return {
        "argv": sys.argv,
        "env": dict(os.environ),
        "name": __name__,
        "file": __file__,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "main_keys": MAIN_KEYS,
        "main_is_this": main.__dict__ is globals(),
        "loader": type(main.__dict__.get("__loader__")).__name__,
        "spec": re.sub(r" at 0x[0-9a-f]+", "", repr(globals().get("__spec__"))),
        "package": repr(globals().get("__package__")),
        "doc": __doc__.splitlines()[0],
        "pickle": pickle.loads(pickle.dumps(Payload(7))).value,
        "pickled_as": pickle.dumps(Payload(7)).count(b"__main__") + pickle.dumps(Payload(7)).count(b"warm_probe"),
        "signals": {name: _disposition(getattr(signal, name)) for name in SIGNALS},
        "session_leader": os.getsid(0) == os.getpid() and os.getpgid(0) == os.getpid(),
        "pdeathsig": pdeath.value,
        "sched": os.sched_getscheduler(0),
        "nice": os.nice(0),
        "fds": sorted(os.listdir("/proc/self/fd")),
        "stdin": os.path.realpath("/proc/self/fd/0"),
        "write_through": sys.stdout.write_through,
        "warm": "_warm_boot.py" in cmdline,
        "pid": os.getpid(),
        "create_time": _create_time(),
    }


def _create_time() -> float:
    import psutil

    return psutil.Process().create_time()


def _wait_gone(pid: int) -> None:
    """Until ``pid`` exited (gone, or a zombie waiting for the launcher)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.01)


@record
def act(action: str) -> None:
    if action == "record":
        raise RuntimeError("recorded failure")
    if action == "raise":
        _fail()
    if action == "exit3":
        sys.exit(3)
    if action == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(60)
    if action == "hang":
        while True:
            time.sleep(1)


def _fail() -> None:
    raise ValueError("plain failure")


if __name__ == "__main__":
    out = os.environ["WARM_PROBE_OUT"]
    rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    data = report()
    print(f"probe stdout rank {rank} restart {restart}")
    print(f"probe stderr rank {rank} restart {restart}", file=sys.stderr)
    tmp = os.path.join(out, f".{rank}-{restart}.json")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.rename(tmp, os.path.join(out, f"{rank}-{restart}.json"))
    actions = sys.argv[1].split(",")
    action = actions[min(restart, len(actions) - 1)]
    if int(os.environ["LOCAL_RANK"]) != 0:
        sys.exit(0)
    for other in range(1, int(os.environ["LOCAL_WORLD_SIZE"])):
        path = os.path.join(out, f"{rank + other}-{restart}.json")
        while not os.path.exists(path):
            time.sleep(0.01)
        with open(path) as f:
            _wait_gone(json.load(f)["pid"])
    if action == "raise":
        _fail()
    act(action)
