"""``file://`` specifics: several processes, ``kill -9`` mid-transaction, the directory, the URL,
the shared watch poller, and rows planted by other tools.

The shared protocol suite (``conformance_tests``) covers the KV contract; this
module covers what only a server-less, multi-process store has. Corruption is
planted with Python's ``sqlite3`` module directly, as a user with the
``sqlite3`` shell would.
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

from rdzv_backends.file import DB_NAME, HISTORY_LIMIT, POLLER_LINGER, FileBackend
from rdzv_backends.file._sql import map_error
from rdzv_core import (
    BackendClosedError,
    BackendTimeoutError,
    CorruptEntryError,
    Event,
    EventType,
    HistoryCompactedError,
    InvalidURLError,
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
    """Garbage bytes: CorruptEntryError (not BackendUnavailableError, which callers retry) naming the file."""
    (tmp_path / DB_NAME).write_bytes(b"this is not an sqlite file at all, " * 100)
    with pytest.raises(CorruptEntryError, match="not a database") as info:
        open_backend(url(tmp_path))
    assert info.value.key is None and str(tmp_path / DB_NAME) in str(info.value)


@pytest.mark.parametrize("hold, timeout", [(0.5, 10.0), (3.0, 0.5)])
def test_opening_a_fresh_file_waits_for_another_connections_first_write(
    tmp_path: Path, hold: float, timeout: float
) -> None:
    """A new, empty store file is in rollback-journal mode, and an open whose
    switch to WAL met another connection's first write (its RESERVED lock, as another opener's
    switch holds it) raised BackendTimeoutError at once: SQLite skips the busy handler there. The open
    now waits for it, for up to ``operation_timeout``, and only then says the file stayed locked."""
    raw = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None, check_same_thread=False)
    raw.execute("BEGIN IMMEDIATE")
    timer = threading.Timer(hold, raw.execute, ("COMMIT",))
    started = time.monotonic()
    timer.start()
    try:
        if hold < timeout:
            with open_backend(url(tmp_path, query=f"operation_timeout={timeout}")) as kv:
                assert hold - 0.1 <= time.monotonic() - started < timeout
                assert kv.put("k", b"v").revision == 1
        else:
            with pytest.raises(BackendTimeoutError, match=f"stayed locked for more than operation_timeout={timeout}s"):
                open_backend(url(tmp_path, query=f"operation_timeout={timeout}"))
            assert timeout - 0.1 <= time.monotonic() - started < hold
    finally:
        timer.join()
        raw.close()


def test_a_busy_error_that_did_not_wait_says_so() -> None:
    """SQLite can answer SQLITE_BUSY without waiting (it skips the busy handler where the wait
    could deadlock): the message then gives the time it took, not a wait it never made."""
    exc = map_error(sqlite3.OperationalError("database is locked"), "/x/rdzv.sqlite3", 30.0, 0.002)
    assert isinstance(exc, BackendTimeoutError) and "gave up after 0.002s" in str(exc)
    assert "stayed locked" not in str(exc)
    slow = map_error(sqlite3.OperationalError("database is locked"), "/x/rdzv.sqlite3", 30.0, 30.1)
    assert "stayed locked for more than operation_timeout=30.0s" in str(slow)


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
            with pytest.raises(BackendTimeoutError):
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
        for _ in range(3):
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
        with pytest.raises(BackendTimeoutError):
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
        with pytest.raises(HistoryCompactedError):
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


# -- rows this backend did not write ------------------------------------------------------------
def plant(directory: Path, sql: str, *args: object) -> None:
    """Run one statement on the store with Python's sqlite3 module (another tool's write)."""
    with sqlite3.connect(directory / DB_NAME, timeout=PATIENCE) as raw:
        raw.execute(sql, args)
    raw.close()


def assert_corrupt(call: object, key: str | None) -> CorruptEntryError:
    with pytest.raises(CorruptEntryError) as info:
        call()  # type: ignore[operator]
    assert info.value.key == key, f"CorruptEntryError must name {key!r}, named {info.value.key!r}: {info.value}"
    return info.value


@pytest.mark.parametrize(
    "column,bad",
    [("value", "text value"), ("value", 42), ("value", 1.5), ("revision", "abc"), ("revision", 0),
     ("expires", "soon")],
    ids=["value-text", "value-integer", "value-real", "revision-text", "revision-zero", "expires-text"],
)
def test_foreign_row_raises_corrupt_entry_and_delete_removes_it(tmp_path: Path, column: str, bad: object) -> None:
    key = "c/bad"
    with FileBackend(str(tmp_path)) as kv:
        kv.put(key, b"ok", ttl=60)
        healthy = kv.put("c/good", b"fine")
        plant(tmp_path, f"UPDATE kv SET {column} = ? WHERE key = ?", bad, key)
        for call in (
            lambda: kv.get(key),
            lambda: kv.list("c/"),
            lambda: kv.list(""),
            lambda: kv.add(key, 1),
            lambda: kv.create(key, b"x"),
            lambda: kv.compare_and_swap(key, b"x", 1),
            lambda: kv.compare_and_delete(key, 1),
            lambda: kv.refresh(key, 5.0),
        ):
            error = assert_corrupt(call, key)
            assert str(tmp_path / DB_NAME) in str(error)
        assert kv.get("c/good") == healthy, "other keys must stay readable"
        assert kv.delete(key) is True
        assert kv.get(key) is None and kv.list("c/")[0] == [healthy]
        assert kv.add(key, 2) == 2
    assert integrity(tmp_path / DB_NAME) == "ok"


def test_put_replaces_a_foreign_row_without_reading_it(tmp_path: Path) -> None:
    with FileBackend(str(tmp_path)) as kv:
        kv.put("k", b"v")
        plant(tmp_path, "UPDATE kv SET value = 'text' WHERE key = 'k'")
        entry = kv.put("k", b"new")
        assert kv.get("k") == entry


def test_non_decimal_counter_on_add(tmp_path: Path) -> None:
    with FileBackend(str(tmp_path)) as kv:
        plant(tmp_path, "INSERT INTO kv (key, value, revision) VALUES ('n', ?, 1)", b"twelve")
        assert kv.get("n").value == b"twelve"  # a BLOB is a valid value, just not a counter
        assert_corrupt(lambda: kv.add("n", 1), "n")
        assert kv.get("n").value == b"twelve", "the failed add must write nothing"
        assert kv.delete("n") and kv.add("n", 1) == 1


def test_null_revision_and_value_in_a_rebuilt_table(tmp_path: Path) -> None:
    """Someone rebuilt ``kv`` without its NOT NULL constraints and stored NULLs."""
    FileBackend(str(tmp_path)).close()
    with sqlite3.connect(tmp_path / DB_NAME) as raw:
        raw.executescript(
            """
            ALTER TABLE kv RENAME TO kv_old;
            CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB, revision INTEGER, expires REAL);
            INSERT INTO kv SELECT * FROM kv_old;
            DROP TABLE kv_old;
            INSERT INTO kv (key, value, revision) VALUES ('r/null-rev', x'00', NULL), ('r/null-value', NULL, 3);
            """
        )
    raw.close()
    with FileBackend(str(tmp_path)) as kv:
        assert_corrupt(lambda: kv.get("r/null-rev"), "r/null-rev")
        assert_corrupt(lambda: kv.get("r/null-value"), "r/null-value")
        assert_corrupt(lambda: kv.list("r/"), "r/null-rev")  # the first by key
        assert kv.delete("r/null-rev") and kv.delete("r/null-value")
        assert kv.list("r/")[0] == []


def test_text_expiry_does_not_break_expiry_of_other_keys(tmp_path: Path) -> None:
    with FileBackend(str(tmp_path)) as kv:
        kv.put("e/odd", b"v", ttl=60)
        plant(tmp_path, "UPDATE kv SET expires = 'soon' WHERE key = 'e/odd'")
        after = kv.put("e/short", b"v", ttl=0.2).revision
        seen = []
        deadline = time.monotonic() + PATIENCE
        while not seen and time.monotonic() < deadline:
            seen = kv.watch("e/", after, 1.0)
        assert [(e.type, e.key) for e in seen] == [(EventType.DELETE, "e/short")]
        assert_corrupt(lambda: kv.get("e/odd"), "e/odd")


def test_corrupt_bookkeeping_names_the_file(tmp_path: Path) -> None:
    with FileBackend(str(tmp_path)) as kv:
        kv.put("k", b"v")
        plant(tmp_path, "UPDATE meta SET value = 'seven' WHERE name = 'revision'")
        for call in (lambda: kv.get("k"), lambda: kv.put("k", b"w"), lambda: kv.watch("", 0, 0)):
            error = assert_corrupt(call, None)
            assert "meta.revision" in str(error) and str(tmp_path / DB_NAME) in str(error)
    with pytest.raises(CorruptEntryError, match="meta.revision"):
        FileBackend(str(tmp_path))


def test_foreign_event_row_fails_only_the_watches_it_concerns(tmp_path: Path) -> None:
    """A blocked watch on ``p/`` meets an event row another tool wrote; a watch on ``q/`` is unaffected."""
    with FileBackend(str(tmp_path)) as kv:
        start = kv.put("start", b"").revision
        results: dict[str, object] = {}

        def watch(prefix: str) -> None:
            try:
                results[prefix] = kv.watch(prefix, start, PATIENCE)
            except CorruptEntryError as exc:
                results[prefix] = exc

        threads = {p: threading.Thread(target=watch, args=(p,)) for p in ("p/", "q/")}
        for thread in threads.values():
            thread.start()
        wait_for_poller_watches(2)
        with sqlite3.connect(tmp_path / DB_NAME, timeout=PATIENCE, isolation_level=None) as raw:
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("INSERT INTO events VALUES (?, 'put', 'p/x', 'text')", (start + 1,))  # TEXT, not BLOB
            raw.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (start + 1,))
            raw.execute("COMMIT")
        raw.close()
        threads["p/"].join(PATIENCE)
        assert isinstance(results.get("p/"), CorruptEntryError), results
        assert results["p/"].key is None and "events.revision = " in str(results["p/"])
        assert threads["q/"].is_alive(), "the watch on q/ must not be woken by p/x"
        entry = kv.put("q/y", b"v")
        threads["q/"].join(PATIENCE)
        assert results["q/"] == [Event(EventType.PUT, "q/y", entry.revision, b"v")]


# -- the shared watch poller --------------------------------------------------------------------
def poller_threads(directory: Path) -> list[threading.Thread]:
    """The watch poller threads of this process for the store in ``directory``."""
    return [t for t in threading.enumerate() if t.name == f"rdzv-file-poller {directory / DB_NAME}"]


def wait_for_poller_watches(count: int) -> None:
    """Block until the process's pollers hold ``count`` blocked watches (or fail after PATIENCE)."""
    from rdzv_backends.file import _watch

    deadline = time.monotonic() + PATIENCE
    while sum(s.poller._count for s in _watch._FILES.get().by_path.values()) < count:
        assert time.monotonic() < deadline, f"fewer than {count} watches registered with the poller"
        time.sleep(0.005)


def test_one_poller_wakes_only_the_matching_watch(tmp_path: Path) -> None:
    """60 blocked watches over 3 backend objects share one poller thread; a write from another
    process wakes only the watch whose prefix selects the key."""
    backends = [FileBackend(str(tmp_path)) for _ in range(3)]
    start = backends[0].put("start", b"").revision
    results: dict[int, tuple[float, list[Event]]] = {}

    def watch(i: int) -> None:
        events = backends[i % 3].watch(f"w/{i}/", start, 2 * PATIENCE)
        results[i] = (time.monotonic(), events)

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(60)]
    for thread in threads:
        thread.start()
    try:
        wait_for_poller_watches(60)
        assert len(poller_threads(tmp_path)) == 1, "one poller per process and store file"
        script = """
            import sys
            from rdzv_core import open_backend
            with open_backend(sys.argv[1]) as kv:
                print(kv.put("w/7/k", b"from another process").revision, flush=True)
        """
        proc = spawn(script, url(tmp_path))
        revision = int(read_line(proc))
        proc.communicate(timeout=PATIENCE)
        threads[7].join(PATIENCE)
        assert results[7][1] == [Event(EventType.PUT, "w/7/k", revision, b"from another process")]
        assert all(thread.is_alive() for i, thread in enumerate(threads) if i != 7), "a non-matching watch woke"
    finally:
        closed_at = time.monotonic()
        for kv in backends:
            kv.close()
        for thread in threads:
            thread.join(PATIENCE)
    assert not any(thread.is_alive() for thread in threads), "close() must end blocked watches"
    for i, (returned, events) in results.items():
        if i != 7:
            assert events == [] and returned >= closed_at, f"watch {i} returned {events} before close"


def test_poller_thread_exits_after_the_last_watch(tmp_path: Path) -> None:
    with FileBackend(str(tmp_path)) as kv:
        assert kv.watch("x/", kv.list("")[1], 0.05) == []
        pollers = poller_threads(tmp_path)
        assert len(pollers) == 1
        pollers[0].join(POLLER_LINGER + PATIENCE)
        assert not pollers[0].is_alive(), "the poller must exit once no watch needs it"
        entry = kv.put("x/k", b"v")  # and a new one starts on demand
        assert kv.watch("x/", entry.revision - 1, 5.0) == [Event(EventType.PUT, "x/k", entry.revision, b"v")]


def test_close_ends_only_its_own_watches(tmp_path: Path) -> None:
    mine, other = FileBackend(str(tmp_path)), FileBackend(str(tmp_path))
    start = mine.put("start", b"").revision
    results: dict[str, object] = {}

    def watch(name: str, kv: FileBackend) -> None:
        try:
            results[name] = kv.watch("c/", start, PATIENCE)
        except BackendClosedError as exc:
            results[name] = exc

    threads = {n: threading.Thread(target=watch, args=(n, kv)) for n, kv in (("mine", mine), ("other", other))}
    for thread in threads.values():
        thread.start()
    wait_for_poller_watches(2)
    mine.close()
    threads["mine"].join(PATIENCE)
    assert results["mine"] == [] or isinstance(results["mine"], BackendClosedError)
    assert threads["other"].is_alive()
    entry = other.put("c/k", b"v")
    threads["other"].join(PATIENCE)
    assert results["other"] == [Event(EventType.PUT, "c/k", entry.revision, b"v")]
    other.close()


def _child_watch(kv: FileBackend, after: int, conn: object) -> None:
    kv.put("fork/ready", b"")
    events = kv.watch("fork/go/", after, PATIENCE)
    conn.send([(e.key, e.value) for e in events])  # type: ignore[attr-defined]
    kv.close()


@pytest.mark.skipif(sys.platform == "win32", reason="fork() is POSIX")
def test_watch_in_a_forked_child_while_the_parent_polls(tmp_path: Path) -> None:
    """The parent's poller thread does not survive fork(); the child's watch starts its own."""
    with FileBackend(str(tmp_path)) as kv:
        after = kv.put("fork/start", b"").revision
        parent_watch = threading.Thread(target=kv.watch, args=("fork/never/", after, 2 * PATIENCE), daemon=True)
        parent_watch.start()
        wait_for_poller_watches(1)
        ctx = multiprocessing.get_context("fork")
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_watch, args=(kv, after + 1, sender))
        proc.start()
        try:
            seen: list[Event] = []
            deadline = time.monotonic() + PATIENCE
            while not any(e.key == "fork/ready" for e in seen) and time.monotonic() < deadline:
                seen += kv.watch("fork/", after, 1.0)
            assert any(e.key == "fork/ready" for e in seen), "the child never started"
            kv.put("fork/go/x", b"go")
            assert receiver.poll(PATIENCE), "the child's watch did not wake"
            assert receiver.recv() == [("fork/go/x", b"go")]
        finally:
            proc.join(PATIENCE)
        assert proc.exitcode == 0
    assert integrity(tmp_path / DB_NAME) == "ok"


def test_one_write_reaches_every_watch_of_its_prefix(tmp_path: Path) -> None:
    """120 watches on one prefix over 3 backend objects: one poll wakes them all, each with the
    event, long before its own deadline."""
    backends = [FileBackend(str(tmp_path)) for _ in range(3)]
    start = backends[0].put("start", b"").revision
    results: dict[int, list[Event]] = {}

    def watch(i: int) -> None:
        results[i] = backends[i % 3].watch("same/", start, 10 * PATIENCE)

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(120)]
    for thread in threads:
        thread.start()
    try:
        wait_for_poller_watches(120)
        entry = backends[1].put("same/k", b"v")
        deadline = time.monotonic() + PATIENCE
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        assert len(results) == 120 and all(
            r == [Event(EventType.PUT, "same/k", entry.revision, b"v")] for r in results.values()
        ), "every watch of the prefix must get the write"
    finally:
        for kv in backends:
            kv.close()
        for thread in threads:
            thread.join(PATIENCE)
