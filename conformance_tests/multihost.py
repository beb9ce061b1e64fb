"""Hosts on one machine: network namespaces on a private bridge, for multi-host tests with real partitions.

:class:`Cluster` makes H hosts. One *switch* namespace holds a Linux bridge connected to no outside
interface; each :class:`Host` is a network namespace with loopback up and one veth pair to the bridge,
its own IPv4 address on a private /24 (the addresses exist only inside these namespaces, so concurrent
clusters may use the same subnet), its own host name (a UTS namespace per command: ``unshare --uts``,
then the name written to ``/proc/sys/kernel/hostname``) and its own ``/etc/hosts`` (``ip netns exec``
bind-mounts ``/etc/netns/NS/hosts``), which lists only ``localhost`` unless a test asks for more
(``resolve="self"`` / ``"all"`` or :meth:`Host.set_hosts`). Name lookups go nowhere else: each host's
``resolv.conf`` names no server reachable from it.

:meth:`Cluster.cut` sets the host's port on the bridge down: a *silent* partition. Its packets and
the packets sent to it vanish (no RST, no ICMP; every host has permanent neighbour entries for the
others, so no ARP failure turns into "no route to host"); the host keeps its address and routes.
:meth:`Cluster.heal` sets the port up again.

Processes: :meth:`Host.popen` starts a command on a host (environment and cwd as given); the PID
is the command's own (``ip netns exec``, ``unshare`` and ``sh -c 'exec ...'`` each exec the next).
:meth:`Host.processes` lists every process in the host's network namespace (all of them started
from this harness), which :meth:`Host.signal`, :meth:`Host.stop` and :meth:`Host.kill` act on.
:meth:`Host.start_redis` / :meth:`Host.start_etcd` start the project's server controllers on the
host, listening on its address (:class:`~conformance_tests.servers.Placement`).

Cleanup: every namespace name starts with ``rdzvmh-PID-START-`` (the creating process's PID and
its start time in clock ticks). :meth:`Cluster.close` (also the context manager's exit, the pytest
fixtures' teardown and an ``atexit`` hook) kills every process on the hosts, deletes the
namespaces and their ``/etc/netns`` directories. A new cluster first removes *stale* namespaces:
those whose creating process is gone (never those of a live run).

Requires Linux, root, ``ip`` (iproute2) and ``unshare`` (util-linux); :func:`unavailable_reason`
says what is missing (the fixtures skip with it). Usage::

    with Cluster(["server", "node0", "node1"]) as hosts:
        redis = hosts["server"].start_redis()
        proc = hosts["node0"].popen(["rdzv-run", "--rdzv", redis.url("job"), ...])
        hosts.cut("node1"); ...; hosts.heal("node1")

More: docs/networking.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, TypeVar

import pytest

from .netns import (ETC_NETNS, NETNS_DIR, PREFIX, MultiHostError, cleanup_stale, in_netns, ip, kill_and_wait,
                    namespaces, pids_in, remove_namespace, start_ticks, unavailable_reason, wait_entered)
from .servers import Placement

if TYPE_CHECKING:
    from .etcd_server import EtcdServer
    from .redis_server import RedisServer
    from .servers import ServerProcess

__all__ = ["Cluster", "Host", "MultiHostError", "unavailable_reason", "require", "cleanup_stale", "namespaces",
           "PREFIX", "NETNS_DIR", "ETC_NETNS", "rdzv_hosts", "rdzv_hosts_module"]

T = TypeVar("T")

#: The hosts' subnet (a /24 inside the namespaces only): host ``i`` gets ``SUBNET.(i + 1)``.
SUBNET = "10.231.7"
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_HOSTS_BASE = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
#: No name server: lookups of unknown names fail at once (127.0.0.1:53 answers nothing on a host).
_RESOLV = "# rdzv multihost: no DNS on this host\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def require() -> None:
    """``pytest.skip`` with the reason when hosts cannot be made here."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


class Host:
    """One host of a :class:`Cluster`: a network namespace with an address, a host name and an ``/etc/hosts``.

    Attributes:
        name: the host's name in the cluster (unique; its namespace is named after it).
        hostname: what ``hostname`` and ``socket.getfqdn()`` answer on the host (default: ``name``; e.g. a
            Kubernetes pod's host name, which a rescheduled pod of an Indexed Job keeps under a new pod name).
        address: its IPv4 address (str), reachable from the other hosts of the cluster only.
        netns: the network namespace's name.
        index: its position in the cluster (0-based).
        interface: the name of its network interface (``"eth0"``; e.g. for ``GLOO_SOCKET_IFNAME``).
    """

    interface = "eth0"

    def __init__(self, cluster: "Cluster", index: int, name: str, hostname: str | None = None) -> None:
        self.cluster = cluster
        self.index = index
        self.name = name
        self.hostname = name if hostname is None else hostname
        self.address = f"{SUBNET}.{index + 1}"
        self.mac = f"02:72:64:7a:{index // 256:02x}:{index % 256:02x}"
        self.netns = f"{cluster.prefix}-{name}"
        self.port = f"p{index}"  # its veth end in the switch namespace
        self._started: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns={self.netns!r})"

    # -- commands ------------------------------------------------------------------------------

    @property
    def command_prefix(self) -> tuple[str, ...]:
        """The argv put before a command to run it on this host (network, mount and UTS namespace).

        The shell sets the host name with its ``echo`` builtin (no child process) and execs the command.
        """
        return ("ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c",
                'echo "$0" > /proc/sys/kernel/hostname && exec "$@"', self.hostname)

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
              stdin: Any = subprocess.DEVNULL, stdout: Any = None, stderr: Any = None,
              start_new_session: bool = True, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (``env``: the whole environment, default this process's).

        Returns once the process is on the host (in its network namespace), or has ended. The
        returned ``Popen``'s pid is the command's own. Other keyword arguments go to ``Popen``.
        """
        proc = subprocess.Popen([*self.command_prefix, *argv], env=env, cwd=cwd, stdin=stdin, stdout=stdout,
                                stderr=stderr, start_new_session=start_new_session, **kwargs)
        self._started.append(proc)
        wait_entered(proc.pid, self.netns)  # so that processes(), kill(pid), ... see it at once
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to its end; stdout and stderr captured as text.

        Raises:
            subprocess.TimeoutExpired: not done in ``timeout`` seconds (the process is killed).
        """
        proc = self.popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill([proc.pid])
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in a thread inside this host's network namespace (sockets it opens stay there)."""
        return in_netns(self.netns, fn)

    def connect(self, address: str, port: int, timeout: float = 1.0) -> socket.socket:
        """A TCP connection from this host to ``address:port`` (``OSError``/``TimeoutError`` as usual)."""
        return self.call(lambda: socket.create_connection((address, port), timeout=timeout))

    # -- processes -----------------------------------------------------------------------------

    def processes(self) -> list[int]:
        """PIDs of every live process on this host (its network namespace)."""
        return pids_in(self.netns)

    def _checked(self, pids: Iterable[int] | None) -> list[int]:
        live = self.processes()
        if pids is None:
            return live
        chosen = list(pids)
        foreign = [pid for pid in chosen if pid not in live and start_ticks(pid) is not None]
        if foreign:
            raise ValueError(f"pids {foreign} are not processes on host {self.name}")
        return chosen

    def _reap(self) -> None:
        for proc in self._started:
            proc.poll()

    def signal(self, sig: int, pids: Iterable[int] | None = None) -> list[int]:
        """Send ``sig`` to ``pids`` (default: every process on this host); the pids signalled.

        Raises:
            ValueError: a pid that lives but not on this host.
        """
        sent = []
        for pid in self._checked(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                sent.append(pid)
        return sent

    def kill(self, pids: Iterable[int] | None = None, timeout: float = 10.0) -> None:
        """SIGKILL ``pids`` (default: every process on this host) and wait (at most ``timeout`` s) until gone."""
        chosen = None if pids is None else self._checked(pids)  # None: rescan (a launcher may start more)
        kill_and_wait(self.netns, chosen, timeout, self._reap)

    def stop(self, pids: Iterable[int] | None = None, timeout: float = 5.0) -> None:
        """SIGTERM ``pids`` (default: every process on this host), SIGKILL what is left after ``timeout`` s."""
        chosen = self.signal(signal.SIGTERM, pids)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap()
            if not set(chosen) & set(self.processes()):
                return
            time.sleep(0.02)
        self.kill([pid for pid in chosen if pid in self.processes()])

    # -- network -------------------------------------------------------------------------------

    def set_hosts(self, known: Iterable["Host"] = (), extra: Iterable[tuple[str, str]] = ()) -> None:
        """Write this host's ``/etc/hosts``: ``localhost``, ``ADDRESS NAME`` of each host in ``known``, then
        each ``(address, names)`` of ``extra`` (names: one or more, separated by spaces; e.g. a service's name).

        Commands started afterwards see it (a running process re-reads it on its next lookup).
        """
        lines = _HOSTS_BASE + "".join(f"{h.address}\t{h.name}\n" for h in known) + \
            "".join(f"{address}\t{names}\n" for address, names in extra)
        etc = os.path.join(ETC_NETNS, self.netns)
        os.makedirs(etc, exist_ok=True)
        with open(os.path.join(etc, "hosts"), "w") as f:  # in place: a bind mount keeps the inode
            f.write(lines)

    def cut(self) -> None:
        """Partition this host silently (its bridge port down): no packet in or out, no RST, no ICMP."""
        ip("-n", self.cluster.switch, "link", "set", self.port, "down")

    def heal(self, timeout: float = 5.0) -> None:
        """End :meth:`cut`: the bridge port up; returns once the host's link has carrier again.

        Raises:
            MultiHostError: no carrier after ``timeout`` seconds.
        """
        ip("-n", self.cluster.switch, "link", "set", self.port, "up")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = json.loads(ip("-n", self.netns, "-j", "link", "show", self.interface).stdout)
            if shown and shown[0].get("operstate") == "UP":
                return
            time.sleep(0.01)
        raise MultiHostError(f"host {self.name}: link still down {timeout} s after heal")

    # -- servers -------------------------------------------------------------------------------

    @property
    def placement(self) -> Placement:
        """A server controller's placement on this host (binds :attr:`address`)."""
        return Placement(bind_host=self.address, command_prefix=self.command_prefix, call=self.call)

    def start_server(self, server: "ServerProcess") -> "ServerProcess":
        """Start ``server`` (built with :attr:`placement`); it is stopped when the cluster closes."""
        self.cluster._servers.append(server)
        server.start()
        return server

    def start_redis(self, **kwargs: Any) -> "RedisServer":
        """A started :class:`~conformance_tests.redis_server.RedisServer` on this host (``kwargs`` to it)."""
        from .redis_server import RedisServer

        server = RedisServer(placement=self.placement, **kwargs)
        self.start_server(server)
        return server

    def start_etcd(self, **kwargs: Any) -> "EtcdServer":
        """A started single-member :class:`~conformance_tests.etcd_server.EtcdServer` on this host."""
        from .etcd_server import EtcdServer

        server = EtcdServer(placement=self.placement, **kwargs)
        self.start_server(server)
        return server


_live: "set[Cluster]" = set()
_counter = 0
_counter_lock = threading.Lock()


class Cluster:
    """H hosts on one private bridge (see the module docstring). Closed by :meth:`close` or ``with``.

    Args:
        names: the hosts' names (lower-case letters, digits and ``-``), or a count (``host0``, ...); none:
            the hosts come later, from :meth:`add_host`.
        resolve: what each ``/etc/hosts`` lists besides ``localhost``: ``"none"`` (default: no host
            can resolve a host name), ``"self"`` (its own name) or ``"all"`` (every host).

    Raises:
        pytest's skip exception: :func:`unavailable_reason` says hosts cannot be made here.
        ValueError: a bad or repeated name, or a bad ``resolve``.
        MultiHostError: a namespace, link or address could not be set up (everything made is removed).
    """

    def __init__(self, names: Sequence[str] | int, *, resolve: str = "none") -> None:
        global _counter
        require()
        names = [f"host{i}" for i in range(names)] if isinstance(names, int) else list(names)
        bad = [n for n in names if not isinstance(n, str) or not _NAME.match(n)]
        if bad or len(set(names)) != len(names) or len(names) > 250:
            raise ValueError(f"host names must be at most 250 distinct names of a-z, 0-9 and '-': {names!r}")
        if resolve not in ("none", "self", "all"):
            raise ValueError(f"resolve must be 'none', 'self' or 'all', not {resolve!r}")
        with _counter_lock:
            _counter += 1
            seq = _counter
        self.prefix = f"{PREFIX}-{os.getpid()}-{start_ticks(os.getpid())}-{seq}"
        self.switch = f"{self.prefix}-switch"
        self.bridge = f"br{os.getpid()}"
        self.hosts: list[Host] = []
        self._servers: list[ServerProcess] = []
        self._closed = False
        cleanup_stale()
        _live.add(self)
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
            ip("-n", self.switch, "link", "set", self.bridge, "up")
            for name in names:
                self.add_host(name)
            for host in self.hosts:
                host.set_hosts({"none": [], "self": [host], "all": self.hosts}[resolve])
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, key: int | str) -> Host:
        if isinstance(key, int):
            return self.hosts[key]
        for host in self.hosts:
            if host.name == key:
                return host
        raise KeyError(f"no host {key!r} (hosts: {[h.name for h in self.hosts]})")

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def _host(self, host: Host | str) -> Host:
        return host if isinstance(host, Host) else self[host]

    def add_host(self, name: str, hostname: str | None = None) -> Host:
        """A new host on the bridge (its ``/etc/hosts`` lists only ``localhost``) with the next address.

        ``hostname``: what ``hostname`` answers there (default ``name``; names of a-z, 0-9, ``-`` and ``.``,
        at most 63 characters), e.g. a rescheduled pod's host name, the same as an earlier host's.

        Raises:
            ValueError: a bad or repeated ``name``, or a bad ``hostname``.
        """
        if not _NAME.match(name) or any(h.name == name for h in self.hosts):
            raise ValueError(f"bad or repeated host name {name!r}")
        if hostname is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?", hostname):
            raise ValueError(f"bad hostname {hostname!r}")
        host = Host(self, len(self.hosts), name, hostname)
        self.hosts.append(host)
        os.makedirs(os.path.join(ETC_NETNS, host.netns), exist_ok=True)
        with open(os.path.join(ETC_NETNS, host.netns, "resolv.conf"), "w") as f:
            f.write(_RESOLV)
        host.set_hosts()
        ip("netns", "add", host.netns)
        ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", host.interface,
            "netns", host.netns, "address", host.mac)
        ip("-n", self.switch, "link", "set", host.port, "master", self.bridge, "up")
        ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
        ip("-n", host.netns, "link", "set", host.interface, "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        for other in self.hosts[:-1]:  # permanent neighbours: a cut host's packets vanish, never "no route"
            ip("-n", host.netns, "neigh", "replace", other.address, "lladdr", other.mac, "dev", host.interface,
                "nud", "permanent")
            ip("-n", other.netns, "neigh", "replace", host.address, "lladdr", host.mac, "dev", other.interface,
                "nud", "permanent")
        return host

    def cut(self, host: Host | str) -> None:
        """:meth:`Host.cut` of ``host`` (a :class:`Host` or its name)."""
        self._host(host).cut()

    def heal(self, host: Host | str) -> None:
        """:meth:`Host.heal` of ``host`` (a :class:`Host` or its name)."""
        self._host(host).heal()

    def namespaces(self) -> list[str]:
        """The names of every namespace this cluster made (hosts and switch)."""
        return [self.switch, *(h.netns for h in self.hosts)]

    def close(self) -> None:
        """Stop the servers, kill every process on the hosts, delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for server in self._servers:
            with contextlib.suppress(OSError, RuntimeError):
                server.stop()
        for host in self.hosts:
            host.kill()
        for netns in reversed(self.namespaces()):
            remove_namespace(netns)
        _live.discard(self)


@atexit.register
def _close_all() -> None:
    for cluster in list(_live):
        with contextlib.suppress(Exception):
            cluster.close()


def _factory() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(names: Sequence[str] | int, *, resolve: str = "none") -> Cluster:
        cluster = Cluster(names, resolve=resolve)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


@pytest.fixture
def rdzv_hosts() -> Iterator[Callable[..., Cluster]]:
    """``make(names, resolve="none") -> Cluster``; every cluster made is closed after the test (or a skip
    with the reason where hosts cannot be made)."""
    require()
    yield from _factory()


@pytest.fixture(scope="module")
def rdzv_hosts_module() -> Iterator[Callable[..., Cluster]]:
    """As ``rdzv_hosts``, closed after the module: share one set of hosts among a module's tests."""
    require()
    yield from _factory()
