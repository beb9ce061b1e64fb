"""Real ``redis-server`` controllers for tests: plain (:class:`RedisServer`) and TLS (:class:`RedisTLSServer`).

The server runs on ``127.0.0.1`` with its own data directory and an append-only
file (``--appendonly yes --appendfsync no``): Redis writes each command to the
file before it replies, and only the fsync is left to the OS, so a ``kill()``
(SIGKILL) followed by ``start()`` on the same port brings back every
acknowledged write and the revision counter — a restart looks like a server
that was briefly away, not one that lost its data (a power loss could lose the
last writes; tests do not pull the plug). ``appendfsync always`` would cost
about 4 ms per write here. Pass ``appendonly=False``
for a server that forgets everything on restart. ``--save ''`` turns RDB
snapshots off. No keyspace notifications: the Redis backend does not need them.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
from typing import Sequence

from .servers import LOOPBACK, Placement, ServerProcess, free_port

__all__ = ["RedisServer", "RedisTLSServer", "RedisCluster"]


class RedisServer(ServerProcess):
    """``redis-server`` on a free loopback port.

    Args:
        appendonly: keep data across kill/start through the AOF (default ``True``).
        extra_args: more ``redis-server`` arguments (e.g. ``("--maxmemory", "100mb")``).
        placement: where it runs and the address it binds (default: here, ``127.0.0.1``).

    Raises (from :meth:`start`):
        RuntimeError: the server did not answer ``PING`` within ``start_timeout`` seconds.
        FileNotFoundError: no ``redis-server`` on ``PATH``.
    """

    name = "redis"
    executable = "redis-server"

    def __init__(self, *, appendonly: bool = True, extra_args: Sequence[str] = (),
                 placement: Placement = LOOPBACK) -> None:
        super().__init__(placement)
        self.appendonly = appendonly
        self.extra_args = tuple(extra_args)

    def port_args(self) -> list[str]:
        """The arguments that open the listening port."""
        return ["--port", str(self.port)]

    def command(self) -> Sequence[str]:
        exe = shutil.which(self.executable) or self.executable
        aof = ["--appendonly", "yes", "--appendfsync", "no"] if self.appendonly else ["--appendonly", "no"]
        # Redis 7's protected mode refuses clients from other hosts of a server without a password
        protected = [] if self.host == "127.0.0.1" else ["--protected-mode", "no"]
        return [
            exe, *self.port_args(), "--bind", self.host, *protected, "--save", "", *aof, "--dir", self.data_dir,
            "--daemonize", "no", "--logfile", "", *self.extra_args,
        ]

    def connect(self, timeout: float = 0.5) -> socket.socket:
        """A raw socket to the server (TLS-wrapped in the TLS variant)."""
        return socket.create_connection((self.host, self.port), timeout=timeout)

    def ready(self) -> bool:
        """The server answers ``PING`` with ``+PONG`` (not ``-LOADING`` while it reads its AOF)."""
        try:
            with self.connect() as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return True
        except OSError:
            pass
        time.sleep(0.05)
        return False

    def url(self, run_id: str = "", **query: str) -> str:
        """A ``redis://`` URL for this server (``run_id`` and query keys optional)."""
        tail = "&".join(f"{k}={v}" for k, v in query.items())
        return f"redis://{self.address}/{run_id}" + (f"?{tail}" if tail else "")


class RedisTLSServer(RedisServer):
    """``redis-server`` that speaks only TLS, with certificates from a fresh ``trustme`` CA.

    Args:
        auth_clients: ``"no"``, ``"optional"`` or ``"yes"`` — whether clients must
            present a certificate signed by the CA (``--tls-auth-clients``).
        server_names: the names (and IP addresses) the server's certificate is issued for.
        appendonly, extra_args: as :class:`RedisServer`.

    Attributes:
        ca_path: the CA certificate (PEM) that signed the server's and the client's certificates.
        client_cert_path, client_key_path: a client certificate and its key (PEM).
    """

    name = "redis-tls"

    def __init__(self, *, auth_clients: str = "optional", server_names: Sequence[str] = ("127.0.0.1", "localhost"),
                 appendonly: bool = True, extra_args: Sequence[str] = ()) -> None:
        import trustme

        super().__init__(appendonly=appendonly, extra_args=extra_args)
        self.auth_clients = auth_clients
        ca = trustme.CA()
        server = ca.issue_cert(*server_names)
        client = ca.issue_cert("rdzv-client@example.org")
        self.ca_path = self._path("ca.pem")
        self.server_cert_path = self._path("server.pem")
        self.server_key_path = self._path("server.key")
        self.client_cert_path = self._path("client.pem")
        self.client_key_path = self._path("client.key")
        ca.cert_pem.write_to_path(self.ca_path)
        server.cert_chain_pems[0].write_to_path(self.server_cert_path)
        server.private_key_pem.write_to_path(self.server_key_path)
        client.cert_chain_pems[0].write_to_path(self.client_cert_path)
        client.private_key_pem.write_to_path(self.client_key_path)
        self._client_context = ssl.create_default_context(cafile=self.ca_path)
        self._client_context.check_hostname = False  # ready() checks liveness, whatever the names
        client.configure_cert(self._client_context)

    def _path(self, name: str) -> str:
        return os.path.join(self.data_dir, name)

    def port_args(self) -> list[str]:
        return [
            "--port", "0", "--tls-port", str(self.port),
            "--tls-cert-file", self.server_cert_path, "--tls-key-file", self.server_key_path,
            "--tls-ca-cert-file", self.ca_path, "--tls-auth-clients", self.auth_clients,
        ]

    def connect(self, timeout: float = 0.5) -> socket.socket:
        sock = super().connect(timeout)
        try:
            return self._client_context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise

    def url(self, run_id: str = "", **query: str) -> str:
        """A ``rediss://`` URL with ``cacert`` set to this server's CA (plus ``query``)."""
        tail = "&".join(f"{k}={v}" for k, v in {"cacert": self.ca_path, **query}.items())
        return f"rediss://{self.address}/{run_id}?{tail}"


class RedisCluster:
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback: one :class:`RedisServer` each with
    ``--cluster-enabled yes``, joined by ``redis-cli --cluster create``.

    Args:
        masters: how many masters (>= 3, what ``redis-cli --cluster create`` accepts).

    Attributes:
        nodes: the servers (:class:`RedisServer`), each with its own port and data directory.

    Raises (from :meth:`start`):
        RuntimeError: a server did not start, ``redis-cli --cluster create`` failed, or the cluster
            did not report ``cluster_state:ok`` within ``start_timeout`` seconds.
        FileNotFoundError: no ``redis-server`` or ``redis-cli`` on ``PATH``.
    """

    start_timeout = 30.0

    #: A cluster node's bus listens on its port + this: the port must be at most 65535 - BUS_OFFSET.
    BUS_OFFSET = 10000

    def __init__(self, masters: int = 3) -> None:
        self.nodes = [RedisServer(appendonly=False, extra_args=("--cluster-enabled", "yes", "--cluster-config-file",
                                                                "nodes.conf", "--cluster-node-timeout", "5000"))
                      for _ in range(masters)]
        for node in self.nodes:
            node.port = self._port_with_a_bus(node.host)

    @classmethod
    def _port_with_a_bus(cls, host: str) -> int:
        """A free port whose bus port (+ :attr:`BUS_OFFSET`) exists and is free too.

        Raises:
            OSError: none found in 200 tries.
        """
        for _ in range(200):
            port = free_port(host)
            if port + cls.BUS_OFFSET > 65535:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((host, port + cls.BUS_OFFSET))
                except OSError:
                    continue
            return port
        raise OSError(f"no free port on {host} with a free cluster bus port after 200 tries")

    def start(self) -> None:
        """Start every node, create the cluster, and wait until every node says ``cluster_state:ok``."""
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli")
        created = subprocess.run([cli, "--cluster", "create", *(n.address for n in self.nodes),
                                  "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, timeout=self.start_timeout, stdin=subprocess.DEVNULL)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({created.returncode}): "
                               f"{created.stdout.decode(errors='replace')[-2000:]}"
                               f"{created.stderr.decode(errors='replace')[-2000:]}")
        deadline = time.monotonic() + self.start_timeout
        while not all(self._state_ok(n) for n in self.nodes):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the cluster of {[n.address for n in self.nodes]} did not reach cluster_state:ok")
            time.sleep(0.05)

    @staticmethod
    def _state_ok(node: RedisServer) -> bool:
        try:
            with node.connect() as sock:
                sock.sendall(b"CLUSTER INFO\r\n")
                reply = b""
                while b"cluster_state:" not in reply or not reply.endswith(b"\r\n"):
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
                return b"cluster_state:ok" in reply
        except OSError:
            return False

    def stop(self) -> None:
        """Stop every node and remove its data directory."""
        for node in self.nodes:
            node.stop()

    def url(self, run_id: str = "", **query: str) -> str:
        """A ``redis://`` URL for the first node."""
        return self.nodes[0].url(run_id, **query)
