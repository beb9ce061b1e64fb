"""A member whose clock is 30 s ahead is not evicted: liveness is judged by the server's TTLs.

One agent runs in a subprocess under libfaketime (``LD_PRELOAD`` +
``FAKETIME="+30s"``: its wall clock -- ``time.time()``, and every C library's
``CLOCK_REALTIME`` -- runs 30 s ahead), the other in the test process on the
true clock; each has its own client of a real server (the session's
``rdzv_server_redis`` / ``rdzv_server_etcd``).
Both join one run (``min_nodes`` = ``max_nodes`` = 2, ``keep_alive_ttl`` =
:data:`TTL`), then keep their keep-alives.

Expected: they form a round of 2; the subprocess really runs 30 s ahead (its
``time.time()`` and its keep-alive record's ``since`` say so); and over
``3 * TTL + ttl_resolution`` a watch on the run's keys sees no ``DELETE`` and no
change to the round record -- neither member's key expires, the round stays
final, no keep-alive finds its key gone, ``num_nodes_waiting()`` stays 0. Nothing
the agents send depends on their wall clock: TTLs are relative and expiry is
decided by the server's clock.

libfaketime is the Debian package ``faketime`` (``apt-get install -y faketime``);
without it the tests are skipped, saying so. Two defects of libfaketime 0.9.10
shape the subprocess: with the monotonic clock faked too, ``threading.Event.wait(t)``
never returns (the keep-alive thread would stall and its key expire -- the tool's
fault, not the offset's), so ``FAKETIME_DONT_FAKE_MONOTONIC=1`` keeps the monotonic
clock true (as on a real host whose wall clock is wrong); and with that setting
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` -- what ``time.sleep`` calls --
fails with ``EINVAL``, so the agent script replaces ``time.sleep`` with an
equivalent ``Event.wait`` before it imports ``rdzv_core``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Iterator

import pytest

from conformance_tests.agents import Agent
from rdzv_core import EventType, RendezvousParams, list_backends, open_backend

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"  # Debian amd64 path
OFFSET = 30.0  #: seconds the subprocess's clock runs ahead
TTL = 3.0  #: keep_alive_ttl (seconds): a refresh every 1 s; a refresh thread starved for 3 s would be a real lapse
START = 60.0  #: seconds for the subprocess to start and the round to form (a loaded 2-core machine)

pytestmark = pytest.mark.skipif(not os.path.exists(LIBFAKETIME),
                                reason=f"libfaketime not installed ({LIBFAKETIME}): apt-get install -y faketime")

#: The offset agent: join the run, print the result and its clock, keep the keep-alive until stdin closes,
#: then print what its keep-alive saw and leave.
AGENT = r"""
import json, sys, threading, time

_pause = threading.Event()


def _sleep(seconds):  # libfaketime 0.9.10 makes time.sleep fail with EINVAL (see the module docstring)
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _pause.wait(seconds)


time.sleep = _sleep
from rdzv_core import Rendezvous, RendezvousParams, open_backend

url, run_id, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
kv = open_backend(url)
rdzv = Rendezvous(kv, run_id, RendezvousParams(min_nodes=2, max_nodes=2, keep_alive_ttl=ttl,
                                               last_call_timeout=0.5, timeout=60))
r = rdzv.next_round()
print(json.dumps({"rank": r.rank, "world_size": r.world_size, "version": r.version, "round_id": r.round_id,
                  "time": time.time()}), flush=True)
sys.stdin.read()
k = rdzv._keepalive
print(json.dumps({"alive": k.is_alive(), "lapsed": k.lapsed.is_set(), "recreated": k.recreated}),
      flush=True)
rdzv.leave()
kv.close()
"""


@pytest.fixture(params=["redis", "etcd-v3"])
def base_url(request: pytest.FixtureRequest) -> str:
    """``SCHEME://HOST:PORT/`` of the session's real server for the scheme."""
    scheme = str(request.param)
    server = request.getfixturevalue("rdzv_server_redis" if scheme == "redis" else "rdzv_server_etcd")
    return f"{scheme}://{server.address}/"


class OffsetAgent:
    """The :data:`AGENT` script in a subprocess whose clock runs :data:`OFFSET` seconds ahead."""

    def __init__(self, url: str, run_id: str) -> None:
        env = dict(os.environ, LD_PRELOAD=LIBFAKETIME, FAKETIME=f"+{int(OFFSET)}s", FAKETIME_DONT_FAKE_MONOTONIC="1")
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would stall the agent
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AGENT, url, run_id, str(TTL)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # end of output: the process exited

    def message(self, timeout: float) -> dict[str, Any]:
        """The next JSON line the agent prints, within ``timeout`` seconds."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if not line:
            stderr = self.stderr()
            self.kill()
            what = "exited" if line == "" else f"said nothing in {timeout} s"
            raise AssertionError(f"the offset agent {what}; stderr:\n{stderr[-3000:]}")
        return dict(json.loads(line))

    def finish(self, timeout: float) -> dict[str, Any]:
        """Close its stdin (it reports its keep-alive and leaves); its report, once it exited with 0."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        report = self.message(timeout)
        assert self.proc.wait(timeout) == 0, self.stderr()
        return report

    def stderr(self) -> str:
        """What the agent wrote to stderr so far."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._stderr.close()


@pytest.fixture
def offset_agent() -> Iterator[Any]:
    started: list[OffsetAgent] = []

    def start(url: str, run_id: str) -> OffsetAgent:
        agent = OffsetAgent(url, run_id)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.kill()


def test_agent_with_clock_30s_ahead_is_not_evicted(base_url: str, offset_agent, record_property) -> None:
    """A round of 2 with one member 30 s ahead stays final for ``3 * TTL + ttl_resolution``; no key expires."""
    scheme = base_url.split("://", 1)[0]
    resolution = list_backends()[scheme].spec.capabilities.ttl_resolution
    run_id = f"clock{uuid.uuid4().hex[:10]}"
    kv, observer = open_backend(base_url), open_backend(base_url)
    params = RendezvousParams(min_nodes=2, max_nodes=2, keep_alive_ttl=TTL, last_call_timeout=0.5, timeout=START)
    local = Agent(kv, run_id, params)
    try:
        remote = offset_agent(base_url + run_id, run_id)
        local.start()
        theirs = remote.message(START)
        ours = local.wait(START)
        skew = theirs["time"] - time.time()
        keys = local.rdzv.keys
        state_key = keys.round_record
        record = observer.get(state_key)
        alive = observer.list(keys.alive_dir(ours.version, ours.round_id))[0]
        after = observer.list(keys.tree)[1]
        window = 3 * TTL + resolution
        changes = _changes_under(observer, keys.tree, after, until=time.monotonic() + window,
                                 watched={state_key})
        alive_after = observer.list(keys.alive_dir(ours.version, ours.round_id))[0]
        waiting = local.rdzv.num_nodes_waiting()
        ka = local.rdzv._keepalive
        ours_keepalive = {"alive": ka is not None and ka.is_alive(),
                          "lapsed": ka is not None and ka.lapsed.is_set(), "recreated": ka.recreated if ka else 0}
        report = remote.finish(30)
    finally:
        local.rdzv.leave()
        kv.close()
        observer.close()
    record_property("skew_s", round(skew, 2))

    assert sorted([ours.rank, theirs["rank"]]) == [0, 1]
    assert ours.world_size == theirs["world_size"] == 2 and ours.version == theirs["version"]
    assert skew > OFFSET - 5, f"the subprocess's clock is not ahead (skew {skew:.1f} s): libfaketime not in effect"
    since = {json.loads(e.value)["rank"]: json.loads(e.value)["since"] for e in alive}
    assert since[theirs["rank"]] - since[ours.rank] > OFFSET - 5, f"keep-alive records' 'since': {since}"
    assert not changes, (f"the round changed or a key expired within {window} s (the offset agent is "
                         f"rank {theirs['rank']}): {changes}")
    assert record is not None and json.loads(record.value)["status"] == "final"
    assert [e.key for e in alive_after] == [e.key for e in alive] and len(alive) == 2
    assert waiting == 0
    assert ours_keepalive == {"alive": True, "lapsed": False, "recreated": 0}, ours_keepalive
    assert report == {"alive": True, "lapsed": False, "recreated": 0}, report


def _changes_under(kv: Any, prefix: str, after: int, until: float, watched: set[str]) -> list[Any]:
    """Events under ``prefix`` after ``after`` until ``until`` (monotonic) that show trouble: any ``DELETE``
    (an expiry, a destroyed round) and any write to a key in ``watched``."""
    seen = []
    while (remaining := until - time.monotonic()) > 0:
        for event in kv.watch(prefix, after, remaining):
            after = max(after, event.revision)
            if event.type is EventType.DELETE or event.key in watched:
                seen.append(event)
    return seen
