"""``python -m rdzv_agent ...``: the same as ``rdzv-run ...`` (see :mod:`rdzv_agent.launcher`)."""

from __future__ import annotations

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
