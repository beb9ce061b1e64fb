"""The servers one benchmark run shares: etcd (v2 API on), Redis, a TCPStore, a file-store directory.

Every target measures against the *same* servers: rdzv's ``etcd-v2``/``etcd-v3``
and PyTorch's ``etcd-v2``/``etcd`` handlers all talk to one etcd; the ``c10d``
baseline talks to one ``TCPStore`` hosted by the benchmark's parent process
(what ``torchrun``'s ``is_host`` agent does). The etcd and Redis controllers are
the test suite's (:mod:`conformance_tests.etcd_server`, :mod:`conformance_tests.redis_server`):
free loopback ports, private data directories, removed on :meth:`Servers.stop`.

Server-side request counters (:meth:`Servers.request_counts`) count what a
backend's single public call turns into on the wire:

* etcd v3: ``grpc_server_msg_received_total`` per gRPC method (``Range``, ``Txn``,
  ``Put``, ``LeaseGrant``, ``LeaseKeepAlive`` messages, ``Watch`` messages, ...);
* etcd v2: ``etcd_debugging_store_reads_total`` / ``..._writes_total`` per action
  plus ``etcd_debugging_store_watch_requests_total``;
* Redis: ``INFO commandstats`` calls per command.

The TCPStore has no such counter. :meth:`Servers.cpu_seconds` reads the etcd and
Redis processes' CPU time from ``/proc``, so a round's server CPU can be shown
next to its wall time.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import urllib.request
from typing import Any

__all__ = ["Servers", "NEEDS"]

#: Which server each target needs.
NEEDS = {
    "memory": None,
    "file": "file",
    "etcd-v2": "etcd",
    "etcd-v3": "etcd",
    "redis": "redis",
    "torch:c10d": "tcpstore",
    "torch:etcd-v2": "etcd",
    "torch:etcd": "etcd",
    "tcpstore": "tcpstore",
}

_METRIC = re.compile(r'^(\w+)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$')


class Servers:
    """Start the servers the given targets need; :meth:`stop` ends them.

    Args:
        targets: target names (keys of :data:`NEEDS`).

    Raises:
        RuntimeError, FileNotFoundError: a server did not start (from the controllers).
    """

    def __init__(self, targets: list[str]) -> None:
        kinds = {NEEDS[t] for t in targets} - {None}
        self.etcd: Any = None
        self.redis: Any = None
        self.tcpstore: Any = None
        self.file_dir: str | None = None
        try:
            if "etcd" in kinds:
                from conformance_tests.etcd_server import EtcdServer

                self.etcd = EtcdServer(enable_v2=True)
                self.etcd.start()
            if "redis" in kinds:
                from conformance_tests.redis_server import RedisServer

                self.redis = RedisServer()  # AOF on, fsync left to the OS: the documented setup
                self.redis.start()
            if "tcpstore" in kinds:
                import datetime

                import torch.distributed as dist

                self.tcpstore = dist.TCPStore(
                    "127.0.0.1", 0, is_master=True, multi_tenant=True,
                    timeout=datetime.timedelta(seconds=60), wait_for_workers=False,
                )
            if "file" in kinds:
                self.file_dir = tempfile.mkdtemp(prefix="rdzv-bench-file-")
        except BaseException:
            self.stop()
            raise

    def rdzv_url(self, target: str, tag: str) -> str:
        """The base URL (no run id) of rdzv backend ``target``; ``tag`` names a memory keyspace / file dir."""
        if target == "memory":
            return f"memory://{tag}/"
        if target == "file":
            return f"file://{self.file_dir}/{tag}/"
        if target in ("etcd-v2", "etcd-v3"):
            return f"{target}://{self.etcd.address}/"
        if target == "redis":
            return f"redis://{self.redis.address}/?namespace={tag}"
        raise ValueError(f"not an rdzv backend target: {target!r}")

    def endpoint(self, target: str) -> str:
        """``HOST:PORT`` of the server behind a PyTorch baseline or the TCPStore."""
        if NEEDS[target] == "etcd":
            return self.etcd.address
        return f"127.0.0.1:{self.tcpstore.port}"

    def request_counts(self, target: str) -> dict[str, float] | None:
        """The server-side request counters relevant to ``target`` right now, or ``None``."""
        if target in ("etcd-v3",):
            return self._etcd_metrics(v3=True)
        if target in ("etcd-v2", "torch:etcd-v2", "torch:etcd"):
            return self._etcd_metrics(v3=False)
        if target == "redis":
            import redis

            client = redis.Redis(host=self.redis.host, port=self.redis.port)
            try:
                stats = client.info("commandstats")
            finally:
                client.close()
            return {name.removeprefix("cmdstat_"): float(v["calls"]) for name, v in stats.items()}
        return None

    def _etcd_metrics(self, v3: bool) -> dict[str, float]:
        with urllib.request.urlopen(self.etcd.client_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode("utf-8")
        out: dict[str, float] = {}
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match is None:
                continue
            name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
            label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            service = label.get("grpc_service", "")
            if v3 and name == "grpc_server_msg_received_total" and service.startswith("etcdserverpb"):
                out[label["grpc_method"]] = out.get(label["grpc_method"], 0.0) + value
            elif not v3 and name in ("etcd_debugging_store_reads_total", "etcd_debugging_store_writes_total"):
                out[label["action"]] = out.get(label["action"], 0.0) + value
            elif not v3 and name == "etcd_debugging_store_watch_requests_total":
                out["watch"] = value
        return out

    def cpu_seconds(self, target: str) -> float | None:
        """CPU time (user + system, seconds) the server behind ``target`` has used so far, or ``None``."""
        server = {"etcd": self.etcd, "redis": self.redis}.get(NEEDS.get(target) or "")
        if server is None or server.proc is None:
            return None
        try:
            with open(f"/proc/{server.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        # utime and stime are fields 14 and 15 of stat(5); fields[0] here is field 3.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def diff(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
        """``after - before`` per counter (zero entries dropped), or ``None`` if either is missing."""
        if before is None or after is None:
            return None
        out = {k: after[k] - before.get(k, 0.0) for k in after}
        return {k: v for k, v in sorted(out.items()) if v}

    def versions(self) -> dict[str, str]:
        """Server versions, for the JSON record."""
        out: dict[str, str] = {}
        if self.etcd is not None:
            try:
                with urllib.request.urlopen(self.etcd.client_url + "/version", timeout=10) as resp:
                    out["etcd"] = resp.read().decode("utf-8")
            except OSError as exc:
                out["etcd"] = f"unknown ({exc})"
        if self.redis is not None:
            import redis

            client = redis.Redis(host=self.redis.host, port=self.redis.port)
            try:
                out["redis"] = str(client.info("server")["redis_version"])
            finally:
                client.close()
        return out

    def stop(self) -> None:
        """Stop every server this object started and remove their data."""
        for server in (self.etcd, self.redis):
            if server is not None:
                server.stop()
        self.etcd = self.redis = None
        self.tcpstore = None  # the TCPStore server thread ends with the object
        if self.file_dir is not None:
            shutil.rmtree(self.file_dir, ignore_errors=True)
            self.file_dir = None
