"""rdzv_core.forksafe.PerProcess: made once per process, forgotten (and handed to ``forget``) in a forked child."""

from __future__ import annotations

import os
import threading

import pytest

from rdzv_core.forksafe import PerProcess


def test_made_once_on_first_get() -> None:
    made: list[object] = []

    def make() -> object:
        made.append(object())
        return made[-1]

    state: PerProcess[object] = PerProcess(make)
    assert state.current() is None and made == [], "nothing is made before the first get()"
    first = state.get()
    assert state.get() is first and state.current() is first and made == [first]


def test_concurrent_first_gets_make_one() -> None:
    made: list[int] = []
    gate = threading.Barrier(8)

    def make() -> int:
        made.append(1)
        return len(made)

    state: PerProcess[int] = PerProcess(make)

    def first_get() -> None:
        gate.wait()
        state.get()

    threads = [threading.Thread(target=first_get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_forgets_the_parents_state_and_makes_its_own() -> None:
    forgotten: list[list[str]] = []
    state: PerProcess[list[str]] = PerProcess(lambda: ["made in", str(os.getpid())], forget=forgotten.append)
    unused: PerProcess[list[str]] = PerProcess(lambda: ["never made"], forget=forgotten.append)
    parents = state.get()
    held = threading.Lock()
    state._lock = held  # a lock another thread held at fork() must not block the child
    held.acquire()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only
        ok = (state.current() is None and forgotten == [parents] and unused.current() is None
              and state.get() is not parents and state.get()[1] == str(os.getpid()))
        os._exit(0 if ok else 1)
    os.close(read)
    os.close(write)
    held.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert state.get() is parents and forgotten == [], "the parent keeps its state; forget runs in the child only"


def test_a_failing_forget_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def forget(_: object) -> None:
        raise RuntimeError("planted")

    state: PerProcess[object] = PerProcess(object, forget=forget)
    state.get()
    state._drop_in_child()  # what the fork hook does in the child
    assert state.current() is None and "forgetting a parent's per-process state" in caplog.text
