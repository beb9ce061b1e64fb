"""gRPC and ``python3-etcd3``'s stubs, imported once, after turning gRPC's fork handlers and C-core log off
unless the user set them (why: ``docs/backends/etcd-v3.md``, "gRPC in forking processes")."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
if "GRPC_VERBOSITY" not in os.environ and "GRPC_TRACE" not in os.environ:
    os.environ["GRPC_VERBOSITY"] = "NONE"

import grpc  # noqa: E402  (after the environment above)
from etcd3 import etcdrpc, transactions  # noqa: E402

__all__ = ["grpc", "etcdrpc", "transactions"]
