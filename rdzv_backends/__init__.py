"""Built-in backends of ``rdzv``; each registers through the ``rdzv`` entry-point group.

==================  =================================  ===========================================
scheme              module                             client (extra)
==================  =================================  ===========================================
memory              :mod:`rdzv_backends.memory`         none (in-process)
file                :mod:`rdzv_backends.file`           none (standard library ``sqlite3``)
etcd, etcd-v2       :mod:`rdzv_backends.etcd_v2`        python-etcd (``rdzv[etcd-v2]``)
etcd-v3, etcd3      :mod:`rdzv_backends.etcd_v3`        python3-etcd3 (``rdzv[etcd-v3]``)
redis, rediss       :mod:`rdzv_backends.redis_backend`  redis-py (``rdzv[redis]``)
==================  =================================  ===========================================

Importing this package imports no backend client library.
"""

__all__: list[str] = []
