"""Built-in backends of ``rdzv``; each registers through the ``rdzv`` entry-point group.

============  ==========================  =========================================
scheme        module                      client
============  ==========================  =========================================
memory        :mod:`rdzv_backends.memory`  none (in-process)
file          :mod:`rdzv_backends.file`    none (standard library ``sqlite3``)
============  ==========================  =========================================

Importing this package imports no backend client library.
"""

__all__: list[str] = []
