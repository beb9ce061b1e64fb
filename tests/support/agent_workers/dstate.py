"""Put this process in uninterruptible sleep (``D``) for a while, honestly: a vfork-style wait.

``clone(CLONE_VFORK | SIGCHLD)`` without ``CLONE_VM``: the child gets a copy of the
memory (as with ``fork``), and the parent waits in the kernel (``wait_for_vfork_done``,
a killable uninterruptible sleep: ``/proc/PID/stat`` shows ``D``, psutil ``disk-sleep``)
until the child exits. Linux x86_64/aarch64 only.

``python dstate.py SECONDS [MARKER]``: touches MARKER (if given), then sits in D for SECONDS.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

CLONE_VFORK = 0x4000
SIGCHLD = 17
SYS_CLONE = {"x86_64": 56, "aarch64": 220}


def supported() -> bool:
    return sys.platform == "linux" and os.uname().machine in SYS_CLONE


def uninterruptible_sleep(seconds: float) -> None:
    """Block in ``D`` state for ``seconds`` (the child sleeps, then exits)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pid = libc.syscall(SYS_CLONE[os.uname().machine], CLONE_VFORK | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        try:
            time.sleep(seconds)
        finally:
            os._exit(0)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone(CLONE_VFORK) failed")
    os.waitpid(pid, 0)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        open(sys.argv[2], "w").close()
    uninterruptible_sleep(float(sys.argv[1]))
