"""One rendezvous agent process for the fault matrix (``tests/backends/test_fault_matrix.py``).

Usage::

    python agent.py URL [--block-at setup|join|last_call|confirm] [--release-on FILE]

``URL`` is a full rendezvous URL (run id and ``min_nodes``, ``max_nodes``,
``keep_alive_ttl``, ``last_call_timeout``, ``timeout`` in its query). The agent
opens the backend, then obeys commands read from stdin, one per line:

``round``   run ``Rendezvous.next_round()`` once (it leaves the previous round first);
``exit``    leave the round and exit 0 (end of input does the same).

It writes one JSON object per line on stdout:

``{"event": "ready", "node": ...}``                        backend open, waiting for commands
``{"event": "progress", "phase": ..., "version": V, "joined": N}``   (when it changes)
``{"event": "blocked", "phase": PHASE, "version": V}``      stopped at the ``--block-at`` point
``{"event": "released"}``                                   carried on from there (``--release-on``)
``{"event": "round", "version": V, "rank": R, "world_size": W}``
``{"event": "error", "type": NAME, "message": TEXT}``       ``next_round`` raised
``{"event": "left"}``                                      left the round (``exit``, end of input, SIGTERM)

``--block-at`` stops the agent, in its first round only, at an exact point of
the state machine and keeps it there (until it is killed):

``setup``      it created the setup record (TTL = ``keep_alive_ttl``) and has not made it joinable;
``join``       it took a join ticket below ``min_nodes`` in a joinable round;
``last_call``  it owns the last call: the record is marked (TTL) and not refreshed since;
``confirm``    the round is frozen with this agent in it; it has not confirmed (no keep-alive key).

With ``--release-on FILE`` the agent carries on from that point once ``FILE`` exists (it polls every
20 ms): a node held at an exact point while the test partitions its host, then let go into the partition.

To stop there, :class:`StoppingRendezvous` overrides the step methods
(``_setup``, ``_join``, ``_last_call``, ``_confirm``) and arms a trap on the
client for the one call that follows the point (e.g. the version counter's
``add`` in ``_setup``). The backend itself is the real one.

SIGTERM leaves cleanly, as an agent's launcher does (``RdzvHandler.release``:
``leave()``, then close the client; never ``set_closed``), prints ``left`` and
exits with 143. SIGKILL, of course, leaves nothing.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from typing import Any, Callable

from rdzv_core import Progress, Rendezvous, RendezvousParams, RdzvError, parse_backend_url

PHASES = ("setup", "join", "last_call", "confirm")
_PARAM_NAMES = ("min_nodes", "max_nodes", "timeout", "last_call_timeout", "keep_alive_ttl", "prefix")


def emit(event: str, **fields: Any) -> None:
    """Write one JSON line on stdout (flushed)."""
    print(json.dumps({"event": event, **fields}), flush=True)


class _TrappedKV:
    """The real backend client with at most one armed trap: ``trap(method, check)``.

    ``check(key, result)`` is called after ``method`` returns (``result``) or, with
    ``before=True``, before it runs (``result`` is ``None``); when it returns true the
    trap fires (once) and calls ``on_fire``.
    """

    def __init__(self, kv: Any, on_fire: Callable[[], None]) -> None:
        self._kv = kv
        self._on_fire = on_fire
        self._trap: tuple[str, Callable[[str, Any], bool], bool] | None = None

    def arm(self, method: str, check: Callable[[str, Any], bool], before: bool = False) -> None:
        self._trap = (method, check, before)

    def disarm(self) -> None:
        self._trap = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._kv, name)
        trap = self._trap
        if trap is None or trap[0] != name:
            return attr

        def call(key: str, *args: Any, **kwargs: Any) -> Any:
            _, check, before = trap
            if before and check(key, None):
                self._trap = None
                self._on_fire()
            result = attr(key, *args, **kwargs)
            if not before and check(key, result):
                self._trap = None
                self._on_fire()
            return result

        return call


class StoppingRendezvous(Rendezvous):
    """A :class:`Rendezvous` that stops for good at ``block_at`` (once), after printing ``blocked``."""

    def __init__(self, kv: Any, run_id: str, params: RendezvousParams, block_at: str | None,
                 release_on: str | None = None) -> None:
        self.trapped = _TrappedKV(kv, self._block)
        super().__init__(self.trapped, run_id, params, on_progress=self._report)  # type: ignore[arg-type]
        self.block_at = block_at
        self.release_on = release_on
        self._version = 0
        self._last_progress: tuple[str, int, int] | None = None

    def _armed(self, phase: str) -> bool:
        return self.block_at == phase

    def _block(self) -> None:
        emit("blocked", phase=self.block_at, version=self._version)
        self.block_at = None
        while self.release_on is None or not os.path.exists(self.release_on):
            time.sleep(3600 if self.release_on is None else 0.02)  # a SIGTERM raises SystemExit out of it
        emit("released")

    def _report(self, p: Progress) -> None:
        now = (p.phase, p.version, p.joined)
        if now != self._last_progress:
            self._last_progress = now
            emit("progress", phase=p.phase, version=p.version, joined=p.joined)

    # -- the stopping points ----------------------------------------------------
    def _setup(self, read_seconds: float, deadline: float) -> Any:
        if self._armed("setup"):  # the version counter is taken right after the setup record exists
            self.trapped.arm("add", lambda key, _: key == self.keys.version_counter, before=True)
        try:
            return super()._setup(read_seconds, deadline)
        finally:
            self.trapped.disarm()

    def _join(self, version: int, rid: str | None, deadline: float) -> Any:
        self._version = version
        if self._armed("join"):
            below_min = lambda key, ticket: key.endswith("/joined") and ticket < self.params.min_nodes  # noqa: E731
            self.trapped.arm("take_ticket", below_min)
        try:
            return super()._join(version, rid, deadline)
        finally:
            self.trapped.disarm()

    def _last_call(self, version: int, rid: str | None, deadline: float) -> None:
        self.trapped.disarm()
        if self._armed("last_call"):  # the first refresh follows the marking compare-and-swap
            self.trapped.arm("refresh", lambda key, _: key == self.keys.round_record, before=True)
        try:
            super()._last_call(version, rid, deadline)
        finally:
            self.trapped.disarm()

    def _confirm(self, version: int, rid: str | None, rank: int, world: int, deadline: float) -> Any:
        self.trapped.disarm()
        if self._armed("confirm"):
            self._block()
        return super()._confirm(version, rid, rank, world, deadline)


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the agent; returns the exit code (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("url")
    parser.add_argument("--block-at", choices=PHASES, default=None)
    parser.add_argument("--release-on", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waits in vain dumps the stacks

    info, parsed = parse_backend_url(args.url)
    params = RendezvousParams(**{k: parsed.params[k] for k in _PARAM_NAMES if k in parsed.params})
    kv = info.spec.open(parsed)
    rdzv = StoppingRendezvous(kv, parsed.run_id, params, args.block_at, args.release_on)
    try:
        emit("ready", node=rdzv.node_id)
        for line in sys.stdin:
            command = line.strip()
            if command == "exit":
                break
            if command != "round":
                emit("error", type="UsageError", message=f"unknown command {command!r}")
                continue
            try:
                result = rdzv.next_round()
            except RdzvError as exc:
                emit("error", type=type(exc).__name__, message=str(exc))
                continue
            emit("round", version=result.version, rank=result.rank, world_size=result.world_size)
            rdzv.block_at = None  # stopping points apply to the first round only
    finally:  # exit, end of input, SIGTERM: leave the round (the run stays open) and release the client
        try:
            rdzv.leave()
        finally:
            kv.close()
        emit("left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
