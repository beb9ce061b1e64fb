"""``file://`` specifics: several processes, ``kill -9`` mid-transaction, the directory, the URL.

The shared protocol suite (``conformance_tests``) covers the KV contract; this
module covers what only a server-less, multi-process store has.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rdzv_backends.file import DB_NAME, HISTORY_LIMIT, FileBackend
from rdzv_core import (
    BackendTimeout,
    Event,
    EventType,
    HistoryCompacted,
    InvalidURLError,
    KVError,
    open_backend,
)

PATIENCE = 30.0


def url(directory: Path, run_id: str = "run1", query: str = "") -> str:
    return f"file://{directory}/{run_id}" + (f"?{query}" if query else "")


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    """Start ``python -c script args...`` with stdin and stdout piped (text)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def read_line(proc: subprocess.Popen[str], timeout: float = PATIENCE) -> str:
    """The child's next stdout line, or fail after ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"child printed nothing in {timeout}s; stderr: {proc.communicate()[1][-2000:]}")
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"child exited with {proc.wait()}: {proc.communicate()[1][-2000:]}")
    return line.strip()


def integrity(path: Path) -> str:
    with sqlite3.connect(path, timeout=5.0) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


def test_directory_is_created_private(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b"
    with open_backend(url(directory)) as kv:
        kv.put("k", b"v")
    assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE((directory / DB_NAME).stat().st_mode) & 0o077 == 0


def test_state_persists_and_run_id_shares_the_file(tmp_path: Path) -> None:
    with open_backend(url(tmp_path, "run1")) as kv:
        entry = kv.put("k", b"kept")
    with open_backend(url(tmp_path, "other")) as kv, open_backend(f"file://{tmp_path}/") as base:
        assert kv.get("k") == entry and base.get("k") == entry
        assert kv.put("k2", b"x").revision == entry.revision + 1


@pytest.mark.parametrize(
    "bad",
    [
        "file://otherhost/tmp/x/run1",
        "file:///run1",
        "file:///tmp/x/run1?operation_timeout=abc",
        "file:///tmp/x/run1?operation_timeout=0",
        "file:///tmp/x/run1?no_such_key=1",
    ],
)
def test_bad_urls(bad: str) -> None:
    with pytest.raises(InvalidURLError):
        open_backend(bad)


def test_localhost_and_operation_timeout_accepted(tmp_path: Path) -> None:
    with open_backend(f"file://localhost{tmp_path}/r?operation_timeout=0.25") as kv:
        assert isinstance(kv, FileBackend) and kv.operation_timeout == 0.25


def test_not_a_database(tmp_path: Path) -> None:
    (tmp_path / DB_NAME).write_bytes(b"this is not an sqlite file at all, " * 100)
    with pytest.raises(KVError, match="not a database"):
        open_backend(url(tmp_path))


def test_two_processes_lose_no_increment(tmp_path: Path) -> None:
    per_process = 2000
    script = """
        import json, sys
        from rdzv_core import open_backend
        with open_backend(sys.argv[1]) as kv:
            print("ready", flush=True)
            sys.stdin.readline()  # start together
            print(json.dumps([kv.add("counter", 1) for _ in range(int(sys.argv[2]))]), flush=True)
    """
    open_backend(url(tmp_path)).close()  # create the store before the race
    procs = [spawn(script, url(tmp_path), str(per_process)) for _ in range(2)]
    try:
        for proc in procs:
            assert read_line(proc) == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(read_line(proc, 120.0)) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=PATIENCE)
    totals = sorted(t for r in results for t in r)
    assert totals == list(range(1, 2 * per_process + 1)), "two adds returned the same total"
    with open_backend(url(tmp_path)) as kv:
        assert kv.get("counter").value == str(2 * per_process).encode()


HOLD_SCRIPT = """
    import sys, time
    from rdzv_core import open_backend
    kv = open_backend(sys.argv[1])

    def body(txn):
        txn.write("crash/key", b"uncommitted", None)
        print("holding", flush=True)
        time.sleep(600)

    kv._write(body)
"""


def test_kill_9_while_holding_the_write_lock(tmp_path: Path) -> None:
    with open_backend(url(tmp_path, query="operation_timeout=0.3")) as kv:
        before = kv.put("crash/before", b"x").revision
        proc = spawn(HOLD_SCRIPT, url(tmp_path))
        try:
            assert read_line(proc) == "holding"
            assert kv.get("crash/before") is not None, "readers must not wait for a writer (WAL)"
            started = time.monotonic()
            with pytest.raises(BackendTimeout):
                kv.put("crash/blocked", b"x")
            assert 0.25 <= time.monotonic() - started < 5.0
        finally:
            proc.kill()
            proc.communicate(timeout=PATIENCE)
        assert proc.returncode == -9
        entry = kv.put("crash/after", b"ok")  # operation_timeout=0.3: fails if still locked
        assert entry.revision == before + 1, "the killed transaction must leave no revision behind"
        assert kv.get("crash/key") is None and kv.get("crash/blocked") is None
        assert kv.watch("crash/", before, 0) == [Event(EventType.PUT, "crash/after", entry.revision, b"ok")]
    assert integrity(tmp_path / DB_NAME) == "ok"


def test_kill_9_during_a_write_storm(tmp_path: Path) -> None:
    script = """
        import os, sys
        from rdzv_core import open_backend
        kv = open_backend(sys.argv[1])
        blob = os.urandom(200_000)
        print("ready", flush=True)
        while True:
            kv.add("storm/n", 1)
            kv.put("storm/blob", blob, ttl=0.05)
    """
    with open_backend(url(tmp_path, query="operation_timeout=2")) as kv:
        for round_ in range(3):
            proc = spawn(script, url(tmp_path))
            try:
                assert read_line(proc) == "ready"
                deadline = time.monotonic() + PATIENCE
                start = kv.get("storm/n")
                target = (0 if start is None else int(start.value)) + 30
                after = kv.list("storm/")[1]
                while (e := kv.get("storm/n")) is None or int(e.value) < target:
                    assert time.monotonic() < deadline, "the writer made no progress"
                    after = max([after, *(ev.revision for ev in kv.watch("storm/", after, 1.0))])
            finally:
                proc.kill()
                proc.communicate(timeout=PATIENCE)
            n = int(kv.get("storm/n").value)
            assert kv.add("storm/n", 1) == n + 1
            with sqlite3.connect(tmp_path / DB_NAME) as raw:
                head = raw.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0]
                assert raw.execute("SELECT max(revision) FROM events").fetchone()[0] == head
        assert integrity(tmp_path / DB_NAME) == "ok"


def test_write_lock_held_by_another_thread_times_out(tmp_path: Path) -> None:
    holder = FileBackend(str(tmp_path))
    waiter = FileBackend(str(tmp_path), operation_timeout=0.3)
    holding, release = threading.Event(), threading.Event()

    def body(txn: object) -> None:
        holding.set()
        release.wait(PATIENCE)

    thread = threading.Thread(target=holder._write, args=(body,))
    thread.start()
    try:
        assert holding.wait(PATIENCE)
        with pytest.raises(BackendTimeout):
            waiter.put("k", b"x")
    finally:
        release.set()
        thread.join(PATIENCE)
    assert waiter.put("k", b"x").value == b"x"
    holder.close()
    waiter.close()


def test_expiry_seen_by_a_lone_watcher(tmp_path: Path) -> None:
    """Another process writes a key with a TTL and exits; only our watcher touches the store."""
    ttl = 0.5
    script = """
        import sys, time
        from rdzv_core import open_backend
        with open_backend(sys.argv[1]) as kv:
            started = time.time()
            kv.put("ttl/k", b"v", ttl=float(sys.argv[2]))
            print(started, flush=True)
    """
    with open_backend(url(tmp_path)) as kv:
        after = kv.list("")[1]
        proc = spawn(script, url(tmp_path), str(ttl))
        written = float(read_line(proc))
        proc.communicate(timeout=PATIENCE)
        events: list[Event] = []
        deadline = time.monotonic() + PATIENCE
        while not any(e.type is EventType.DELETE for e in events) and time.monotonic() < deadline:
            events += kv.watch("ttl/", events[-1].revision if events else after, 5.0)
        seen = time.time()
        assert [e.type for e in events] == [EventType.PUT, EventType.DELETE]
        late = seen - written - ttl
        assert -0.02 <= late <= FileBackend.capabilities.ttl_resolution + 0.5, f"expiry seen {late:.3f}s late"


def test_history_limit_is_exact(tmp_path: Path) -> None:
    with FileBackend(str(tmp_path)) as kv:
        start = kv.list("")[1]
        for i in range(HISTORY_LIMIT):
            kv.put("h/k", str(i).encode())
        events = kv.watch("h/", start, 0)
        assert events and events[0].revision == start + 1
        kv.put("h/k", b"one more")
        with pytest.raises(HistoryCompacted):
            kv.watch("h/", start, 0)
        assert kv.watch("h/", start + 1, 0)[0].revision == start + 2


def _child_add(kv: FileBackend) -> None:
    kv.add("forked", 1)
    kv.close()


@pytest.mark.skipif(sys.platform == "win32", reason="fork() is POSIX")
def test_usable_after_fork(tmp_path: Path) -> None:
    with FileBackend(str(tmp_path)) as kv:
        kv.add("forked", 1)  # the pool now holds a connection the child must not use
        proc = multiprocessing.get_context("fork").Process(target=_child_add, args=(kv,))
        proc.start()
        proc.join(PATIENCE)
        assert proc.exitcode == 0
        assert kv.add("forked", 1) == 3
    assert integrity(tmp_path / DB_NAME) == "ok"


def test_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    """An existing directory keeps its mode; only a missing one is created 0700."""
    os.chmod(tmp_path, 0o755)
    with open_backend(url(tmp_path)) as kv:
        kv.put("k", b"v")
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755
