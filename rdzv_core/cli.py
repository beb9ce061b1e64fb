"""The former name of :mod:`rdzv_core.admin_cli` (the ``rdzv`` operator command): the same module."""

import sys

from . import admin_cli

if __name__ == "__main__":  # python -m rdzv_core.cli
    sys.exit(admin_cli.main())
sys.modules[__name__] = admin_cli
