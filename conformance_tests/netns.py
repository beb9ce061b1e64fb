"""Network-namespace plumbing of the multi-host harness (:mod:`conformance_tests.multihost`).

``ip`` commands, the harness's namespace names (``PREFIX-PID-START-...``: the creating process's pid and
start time, so a stale one can be told from a live run's), the processes inside a namespace (by their
``/proc/PID/ns/net``), removal, and running a function in a thread that joined a namespace (``setns``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, TypeVar

__all__ = ["PREFIX", "NETNS_DIR", "ETC_NETNS", "MultiHostError", "unavailable_reason", "ip", "start_ticks",
           "owner_alive", "namespaces", "ns_inode", "pids_in", "wait_entered", "kill_and_wait", "remove_namespace",
           "cleanup_stale", "in_netns"]

T = TypeVar("T")

#: First part of every namespace name this harness creates.
PREFIX = "rdzvmh"
NETNS_DIR = "/run/netns"
ETC_NETNS = "/etc/netns"
_CLONE_NEWNET = 0x40000000
_OWNED = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-")
_TOOLS = ("ip", "unshare")


class MultiHostError(RuntimeError):
    """The harness could not set up or change the hosts (the message says which command failed)."""


def unavailable_reason() -> str | None:
    """Why hosts cannot be made here (not Linux, not root, a missing tool), or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"multi-host tests need Linux network namespaces (platform {sys.platform})"
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, veth pairs, a bridge)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"multi-host tests need {', '.join(missing)} on PATH (iproute2, util-linux)"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise :class:`MultiHostError` with its stderr if it fails and ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise MultiHostError(f"'ip {' '.join(args)}' failed ({done.returncode}): {done.stderr.strip()}")
    return done


def start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_alive(name: str) -> bool:
    """Whether the process that created namespace ``name`` is still running (same PID, same start)."""
    match = _OWNED.match(name)
    if match is None:
        return True  # not ours: never touched
    pid, start = int(match.group(1)), int(match.group(2))
    return start_ticks(pid) == start


def namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    done = ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def ns_inode(netns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(NETNS_DIR, netns))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _net_of(pid: int | str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None  # gone, or a zombie (no namespace links)
    return st.st_dev, st.st_ino


def pids_in(netns: str) -> list[int]:
    """PIDs of the live (non-zombie) processes in network namespace ``netns``."""
    target = ns_inode(netns)
    if target is None:
        return []
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _net_of(entry) == target]


def wait_entered(pid: int, netns: str, timeout: float = 10.0) -> bool:
    """Wait until process ``pid`` is in ``netns`` (``ip netns exec`` has switched); ``False`` if it ended first
    or ``timeout`` seconds passed."""
    target = ns_inode(netns)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = _net_of(pid)
        if current is None or current == target:
            return current is not None
        time.sleep(0.002)
    return False


def kill_and_wait(netns: str, pids: Iterable[int] | None, timeout: float = 10.0,
                   reap: Callable[[], None] = lambda: None) -> None:
    """SIGKILL ``pids`` (default: every process in ``netns``) and wait until they are gone."""
    deadline = time.monotonic() + timeout
    targets = set(pids_in(netns) if pids is None else pids)
    while targets and time.monotonic() < deadline:
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reap()
        time.sleep(0.01)
        live = set(pids_in(netns))
        targets = live if pids is None else targets & live


def remove_namespace(netns: str) -> None:
    kill_and_wait(netns, None)
    ip("netns", "delete", netns, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, netns), ignore_errors=True)


def cleanup_stale() -> list[str]:
    """Remove the namespaces (and ``/etc/netns`` directories) of harness runs whose creator is gone.

    Namespaces of live runs, and any not made by this harness, are left alone. Returns the names removed.
    """
    removed = []
    for netns in namespaces():
        if _OWNED.match(netns) and not owner_alive(netns):
            remove_namespace(netns)
            removed.append(netns)
    with contextlib.suppress(OSError):
        for leftover in os.listdir(ETC_NETNS):
            if _OWNED.match(leftover) and not owner_alive(leftover) and ns_inode(leftover) is None:
                shutil.rmtree(os.path.join(ETC_NETNS, leftover), ignore_errors=True)
                removed.append(leftover)
    return removed


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Run ``fn()`` in a new thread that has joined network namespace ``netns``; its result or exception."""
    result: list[Any] = []

    def body() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
            try:
                if hasattr(os, "setns"):  # Python 3.12+
                    os.setns(fd, _CLONE_NEWNET)
                else:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        code = ctypes.get_errno()
                        raise OSError(code, f"setns({netns}): {os.strerror(code)}")
            finally:
                os.close(fd)
            result.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=body, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
