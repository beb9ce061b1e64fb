"""On ``PYTHONPATH`` with ``RDZV_TEST_PARSE_LOG`` set: append one line per URL parse to that file.

Each line is ``IMAGE NAME``: ``IMAGE`` is ``reexec`` once ``RDZV_URL`` is set (the launcher
re-executed itself to hide a password), else ``first``; ``NAME`` the function called.
"""

import os
import sys

if os.environ.get("RDZV_TEST_PARSE_LOG"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from agent_workers.parse_counter import install

    def _record(name: str) -> None:
        image = "reexec" if os.environ.get("RDZV_URL") else "first"
        with open(os.environ["RDZV_TEST_PARSE_LOG"], "a") as log:
            log.write(f"{image} {name}\n")

    install(_record)
