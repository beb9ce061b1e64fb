"""The project's own tests (a package: test modules are imported as ``tests.<folder>.test_<name>``, so equal
basenames in two folders cannot clash). Shared helpers live in :mod:`tests.support`; no test module imports
another."""
