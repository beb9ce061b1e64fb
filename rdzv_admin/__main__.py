"""``python -m rdzv_admin ...``: the same as ``rdzv ...`` (see :mod:`rdzv_admin.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
