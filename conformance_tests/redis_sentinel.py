"""A real Redis Sentinel group for tests: a master, one replica and three ``redis-sentinel`` processes.

Every process listens on a free loopback port. The sentinels monitor the master under
:data:`MASTER_NAME` with a quorum of 2, ``down-after-milliseconds`` 1000 and a short failover
timeout, so killing the master gets the replica promoted within a few seconds. Roles move: after a
failover the old master, started again, is made a replica of the new one by the sentinels; the
controller always acts on the master the sentinels name (:meth:`SentinelGroup.master`).

:class:`SentinelGroup` has the controller interface of the ``faults`` group (``address``,
``kill()``, ``start()``, ``pause()``, ``resume()``): ``address`` lists the sentinels (the hosts of a
``redis+sentinel://`` URL); ``kill``/``pause`` act on the current master, ``start``/``resume`` on
every server and sentinel that is down or stopped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Sequence

from .redis_server import RedisServer
from .servers import ServerProcess, wait_for_port

__all__ = ["MASTER_NAME", "GroupServer", "SentinelGroup", "SentinelProcess"]

#: The name the sentinels monitor the master under (the URL's ``master_name``).
MASTER_NAME = "mymaster"
#: Milliseconds without an answer after which a sentinel deems the master down.
DOWN_AFTER_MS = 1000
#: Milliseconds a sentinel waits before it retries a failed failover (and before it corrects a
#: replica that follows another master than the one it knows).
FAILOVER_TIMEOUT_MS = 2000


class SentinelProcess(ServerProcess):
    """One ``redis-sentinel`` monitoring ``MASTER_NAME`` at ``master_port`` (quorum 2).

    The configuration file is written at the first :meth:`start`; the sentinel rewrites it as it
    learns the group (the other sentinels, the replicas, a new master), so a restart keeps that.
    """

    name = "redis-sentinel"
    executable = "redis-sentinel"

    def __init__(self, master_port: int) -> None:
        super().__init__()
        self.master_port = master_port
        self.config_path = os.path.join(self.data_dir, "sentinel.conf")

    def command(self) -> Sequence[str]:
        if not os.path.exists(self.config_path):
            with open(self.config_path, "w") as f:
                f.write("\n".join([
                    f"port {self.port}",
                    f"bind {self.host}",
                    "daemonize no",
                    f"dir {self.data_dir}",
                    f"sentinel monitor {MASTER_NAME} {self.host} {self.master_port} 2",
                    f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {MASTER_NAME} 1",
                    "",
                ]))
        return [shutil.which(self.executable) or self.executable, self.config_path]

    def ready(self) -> bool:
        return wait_for_port(self.host, self.port, time.monotonic() + 0.5)


class GroupServer(RedisServer):
    """A ``redis-server`` of the group, configured by a file only (no command-line options): the
    sentinels' ``CONFIG REWRITE`` records a role change there, so a restarted server comes back as
    what it was last made (a command-line ``--replicaof`` would override that)."""

    def __init__(self, replica_of: RedisServer | None = None) -> None:
        extra = ("--replicaof", replica_of.host, str(replica_of.port)) if replica_of is not None else ()
        super().__init__(extra_args=extra)
        self.config_path = os.path.join(self.data_dir, "redis.conf")

    def command(self) -> Sequence[str]:
        argv = list(super().command())
        if not os.path.exists(self.config_path):
            lines, i = [], 1
            while i < len(argv):
                name, values = argv[i][2:], []
                i += 1
                while i < len(argv) and not argv[i].startswith("--"):
                    values.append(argv[i] or '""')
                    i += 1
                lines.append(" ".join([name, *values]))
            with open(self.config_path, "w") as f:
                f.write("\n".join([*lines, ""]))
        return [argv[0], self.config_path]


class SentinelGroup:
    """A master, a replica and three sentinels on loopback (see the module doc).

    Attributes:
        servers: the two ``redis-server`` controllers (their roles change with failovers).
        sentinels: the three ``redis-sentinel`` controllers.

    Raises (from :meth:`start`):
        RuntimeError: a process did not come up, or the sentinels did not agree on the master and
            its replica within ``start_timeout`` seconds.
        FileNotFoundError: no ``redis-server`` or ``redis-sentinel`` on ``PATH``.
    """

    name = "redis-sentinel-group"
    start_timeout = 60.0

    def __init__(self) -> None:
        first = GroupServer()
        second = GroupServer(replica_of=first)
        self.servers = [first, second]
        self.sentinels = [SentinelProcess(first.port) for _ in range(3)]
        self.data_dir = tempfile.mkdtemp(prefix="rdzv-sentinel-group-")
        self._paused: list[ServerProcess] = []

    @property
    def address(self) -> str:
        """``"HOST:PORT,HOST:PORT,HOST:PORT"``: every sentinel (the hosts of a ``redis+sentinel://`` URL)."""
        return ",".join(s.address for s in self.sentinels)

    def url(self, run_id: str = "", **query: str) -> str:
        """A ``redis+sentinel://`` URL for this group (``master_name`` set; more ``query`` keys optional)."""
        tail = "&".join(f"{k}={v}" for k, v in {"master_name": MASTER_NAME, **query}.items())
        return f"redis+sentinel://{self.address}/{run_id}?{tail}"

    # -- the controller interface --------------------------------------------------------------
    def start(self) -> None:
        """Start every server and sentinel that is not running (a killed master comes back and is
        made a replica of the new one); wait until the sentinels name a master that answers."""
        import redis

        self.resume()
        down = [s for s in self.servers if s.proc is None or s.proc.poll() is not None]
        named = self._named_masters() if len(down) < len(self.servers) and self.sentinels[0].proc else []
        for process in [*self.servers, *self.sentinels]:
            process.start()
        for server in down:
            if named and server.address not in named:  # a replica now: say so at once, as the sentinels would
                host, port = named[0].rsplit(":", 1)
                with redis.Redis(server.host, server.port, socket_timeout=5) as client:
                    client.execute_command("REPLICAOF", host, port)
                    client.execute_command("CONFIG", "REWRITE")
        self.wait_for_master(deadline=time.monotonic() + self.start_timeout)

    def kill(self) -> None:
        """SIGKILL the current master (as the sentinels name it) and wait for it to be gone; first wait until a
        failover can follow (every sentinel knows the replica and the other sentinels)."""
        self._failover_ready(time.monotonic() + self.start_timeout).kill()

    def pause(self) -> None:
        """SIGSTOP the current master (the sentinels fail over after ``DOWN_AFTER_MS`` of silence); first wait
        until a failover can follow, as :meth:`kill` does."""
        server = self._failover_ready(time.monotonic() + self.start_timeout)
        server.pause()
        self._paused.append(server)

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped."""
        while self._paused:
            self._paused.pop().resume()

    def stop(self) -> None:
        """Stop every process for good and remove their data directories."""
        for process in [*self.sentinels, *self.servers]:
            process.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- the group -------------------------------------------------------------------------------
    def master(self) -> GroupServer:
        """The server the sentinels name as master (the first sentinel that answers decides).

        Raises:
            RuntimeError: no sentinel answered, or it names no server of this group.
        """
        address = self._named_masters()
        for server in self.servers:
            if server.address in address:
                return server
        raise RuntimeError(f"the sentinels name no server of this group as master: {address}")

    def replica(self) -> GroupServer:
        """The server that is not :meth:`master`."""
        master = self.master()
        return next(s for s in self.servers if s is not master)

    def wait_for_master(self, *, other_than: str | None = None, deadline: float) -> GroupServer:
        """Wait until every sentinel names the same master (not ``other_than``, a ``"HOST:PORT"``),
        that server answers ``ROLE`` as master, and it has a connected replica if both servers run --
        and, for a failover to follow a kill, every running sentinel knows that replica as a healthy one
        and the other running sentinels (a restarted sentinel learns both only from the master's ``INFO``
        and hello messages, seconds later: a master killed before could be failed over by nobody).

        Args:
            other_than: the old master's address, after a failover is due.
            deadline: ``time.monotonic()`` value.

        Returns:
            The master's controller.

        Raises:
            RuntimeError: not so by ``deadline`` (with what the sentinels said).
        """
        import redis

        seen: Any = None
        while time.monotonic() < deadline:
            try:
                named = self._named_masters(every=True)
                seen = named
                if len(set(named)) == 1 and named[0] != other_than:
                    server = next((s for s in self.servers if s.address == named[0]), None)
                    if server is not None and self._serves_as_master(server) and self._sentinels_ready(server):
                        return server
            except (redis.RedisError, OSError) as exc:
                seen = exc
            time.sleep(0.1)
        raise RuntimeError(f"the sentinels did not agree on a new master in time (last seen: {seen!r})")

    def _serves_as_master(self, server: GroupServer) -> bool:
        import redis

        with redis.Redis(server.host, server.port, socket_timeout=1) as client:
            role = client.execute_command("ROLE")
            if role[0] not in (b"master", "master"):
                return False
            running = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
            if len(running) < 2:
                return True
            replicas = role[2]
            return bool(replicas) and all(s.address in {f"{r[0]}:{r[1]}" for r in _decoded(replicas)}
                                          for s in running if s is not server)

    def _failover_ready(self, deadline: float) -> GroupServer:
        """The master, once every running sentinel knows its replica and the other sentinels (a master killed
        before that could be failed over by nobody); its replication link may be down (a test cut it).

        Raises:
            RuntimeError: not so by ``deadline`` (a ``time.monotonic()`` value).
        """
        import redis

        while True:
            try:
                master = self.master()
                if self._sentinels_ready(master):
                    return master
            except (redis.RedisError, OSError, RuntimeError):
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError("the sentinels do not all know the replica and each other: no failover would "
                                   "follow a kill of the master")
            time.sleep(0.1)

    def _sentinels_ready(self, master: GroupServer) -> bool:
        """Whether every running sentinel lists each running server but ``master`` as a replica with no
        ``s_down``/``disconnected`` flag (its link to the master may be down: a test may have cut it), and
        every other running sentinel as healthy."""
        import redis

        running = [s for s in self.sentinels if s.proc is not None and s.proc.poll() is None]
        replicas = {s.address for s in self.servers if s is not master and s.proc is not None and s.proc.poll() is None}
        for sentinel in running:
            with redis.Redis(sentinel.host, sentinel.port, socket_timeout=1) as client:
                known = [_fields(r) for r in client.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)]
                peers = [_fields(r) for r in client.execute_command("SENTINEL", "SENTINELS", MASTER_NAME)]
            healthy = {f"{r.get('ip')}:{r.get('port')}" for r in known if r.get("flags") == "slave"}
            if not replicas <= healthy:
                return False
            if sum(1 for p in peers if "down" not in p.get("flags", "") and "disconnected" not in p.get("flags", "")
                   ) < len(running) - 1:
                return False
        return True

    def _named_masters(self, every: bool = False) -> list[str]:
        """The master address each answering sentinel names (``every``: all must answer)."""
        import redis

        named = []
        for sentinel in self.sentinels:
            try:
                with redis.Redis(sentinel.host, sentinel.port, socket_timeout=1) as client:
                    host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
            except (redis.RedisError, OSError, TypeError):
                if every:
                    raise
                continue
            named.append(f"{_text(host)}:{_text(port)}")
            if not every:
                break
        if not named:
            raise RuntimeError("no sentinel answered")
        return named


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(flat: Any) -> dict[str, str]:
    """A ``SENTINEL REPLICAS``/``SENTINELS`` entry (``[key, value, key, value, ...]``, or a dict when the client
    parsed it) as a dict of text."""
    if isinstance(flat, dict):
        return {_text(k): _text(v) for k, v in flat.items()}
    items = [_text(part) for part in flat]
    return dict(zip(items[0::2], items[1::2], strict=True))


def _decoded(replicas: Any) -> list[list[str]]:
    return [[_text(part) for part in replica] for replica in replicas]
