"""Built-in backends of ``rdzv``, each registered through the ``rdzv`` entry-point group like a plugin:
``memory``, ``file`` (``sqlite3``), ``redis``/``rediss`` (redis-py, ``rdzv[redis]``) are packages whose
``__init__`` is the registration; ``etcd-v2`` and ``etcd-v3`` are :mod:`.etcd_v2` and :mod:`.etcd_v3`.
Importing this package imports no backend. How each works: docs/backends/.
"""

__all__: list[str] = []
