"""gRPC and ``python3-etcd3``'s generated stubs, imported once for the etcd-v3 backend.

Before ``import grpc``: gRPC's fork handlers are turned off unless the user set
``GRPC_ENABLE_FORK_SUPPORT`` (the agent forks its workers while a watch stream is open; the handlers then
ran in the child, which only execs, and aborted about 1 in 5 loaded worker starts with "epoll_wait error:
Bad file descriptor"), and gRPC's C-core log is silenced unless the user set ``GRPC_VERBOSITY`` or
``GRPC_TRACE`` (dozens of lines per failed TLS handshake; every failure it reports is in the backend's errors).
Only the stubs (``etcd3.etcdrpc``) and comparisons (``etcd3.transactions``) are used, not ``etcd3.Client``.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
if "GRPC_VERBOSITY" not in os.environ and "GRPC_TRACE" not in os.environ:
    os.environ["GRPC_VERBOSITY"] = "NONE"

import grpc  # noqa: E402  (after the environment above)
from etcd3 import etcdrpc, transactions  # noqa: E402

__all__ = ["grpc", "etcdrpc", "transactions"]
