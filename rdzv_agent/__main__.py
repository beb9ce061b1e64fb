"""``python -m rdzv_agent ...``: the same as ``rdzv-run ...`` (see :mod:`rdzv_agent.launch.launcher`)."""

from __future__ import annotations

import sys

from .launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
