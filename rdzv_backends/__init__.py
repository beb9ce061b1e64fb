"""Built-in backends of ``rdzv``; each registers through the ``rdzv`` entry-point group.

==================  =================================  ===========================================
scheme              package or module                  client (extra)
==================  =================================  ===========================================
memory              :mod:`rdzv_backends.memory`         none (in-process)
file                :mod:`rdzv_backends.file`           none (standard library ``sqlite3``)
etcd, etcd-v2       :mod:`rdzv_backends.etcd_v2`        python-etcd (``rdzv[etcd-v2]``)
etcd-v3, etcd3      :mod:`rdzv_backends.etcd_v3`        python3-etcd3 (``rdzv[etcd-v3]``)
redis, rediss       :mod:`rdzv_backends.redis`          redis-py (``rdzv[redis]``)
==================  =================================  ===========================================

Importing this package imports no backend; a backend package's ``__init__`` holds its
registration and imports its implementation (and client) when a URL is opened. How each works:
docs/backends/.
"""

__all__: list[str] = []
