"""Helpers of the launcher-level tests (``tests/agent/``): the fast rendezvous settings of a test run, the
workers' JSON records, fresh run ids, whether a run is closed. The fixtures ``node_url`` and ``procs`` are in
``tests/agent/conftest.py``."""

from __future__ import annotations

import glob
import json
import os
import uuid

from rdzv_core import create_handler

FAST = {"last_call_timeout": "0.5", "keep_alive_ttl": "2", "timeout": "60"}


def records(out_dir):
    """The JSON records the workers wrote into ``out_dir``."""
    found = []
    for path in glob.glob(os.path.join(out_dir, "*.json")):
        with open(path) as f:
            found.append(json.load(f))
    return found


def new_run(procs):
    """A fresh run id, killed with ``procs`` at teardown."""
    run_id = f"agent{uuid.uuid4().hex[:10]}"
    procs.run_ids.append(run_id)
    return run_id


def run_is_closed(url):
    """Whether the run is closed, read through a handler that leaves it as it is (``release()``)."""
    handler = create_handler(url)
    try:
        return handler.is_closed()
    finally:
        handler.release()
