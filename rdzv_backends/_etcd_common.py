"""Former home of the etcd backends' shared code; its names now live in :mod:`rdzv_backends._etcd` and
:mod:`rdzv_backends._concurrency` and are re-exported here for old imports (none needs a client library)."""

from rdzv_backends._concurrency import AddCombiner, RaceRetry, ReadCoalescer
from rdzv_backends._etcd.budget import MIN_ATTEMPT, FailureBudget, Tries
from rdzv_backends._etcd.budget import AttemptDeadline as Deadline
from rdzv_backends._etcd.endpoints import Endpoints
from rdzv_backends._etcd.errors import may_have_applied, unreachable
from rdzv_backends._etcd.settings import (
    DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_PORT,
    MAX_VALUE_BYTES,
    QUERY_KEYS,
    EtcdSettings,
    ttl_seconds,
)
from rdzv_backends._etcd.tls import check_tls, tls_context

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_OPERATION_TIMEOUT",
    "MAX_VALUE_BYTES",
    "QUERY_KEYS",
    "EtcdSettings",
    "Endpoints",
    "Deadline",
    "FailureBudget",
    "MIN_ATTEMPT",
    "RaceRetry",
    "Tries",
    "AddCombiner",
    "ReadCoalescer",
    "may_have_applied",
    "check_tls",
    "tls_context",
    "ttl_seconds",
    "unreachable",
]
