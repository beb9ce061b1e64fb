"""The conformance suite every ``rdzv`` backend must pass (a pytest plugin; see :mod:`conformance_tests.plugin`).

Run it against any installed backend::

    pytest --pyargs conformance_tests --rdzv-url "SCHEME://HOST:PORT/"
"""
