"""Declared capabilities, checked (marker ``protocol``): a backend that claims one and lacks it fails.

Each :class:`~rdzv_core.kv.Capabilities` field and where the suite checks it:

=====================  ===========================================================================
``multi_process``      here: another process reads this one's write, and this one reads (and watches) its
``persistent``         here: a key written by a process that has exited is read by a later process
``max_value_bytes``    ``test_protocol.py``: ``test_value_too_large_writes_nothing``, ``test_one_mebibyte_value``
``ttl_resolution``     ``test_protocol_ttl_watch.py``: ``test_ttl_expiry_is_a_delete_event`` (expiry seen in time)
``multi_host``,        declared, not checked here: one machine cannot show them (a second host, a skewed
``server_side_ttl``,   client clock, a push-versus-poll watch, a TLS or password-protected server are the
``native_watch``,      backend's own tests' business)
``tls``, ``auth``
=====================  ===========================================================================

A capability declared ``False`` turns its test into a skip that says so.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from rdzv_core import Event, EventType, KVBackend

pytestmark = pytest.mark.protocol

#: Seconds a helper process may take (start-up, imports, one connection).
CHILD_TIMEOUT = 60.0

_WRITER = textwrap.dedent(
    """
    import sys
    from rdzv_core import open_backend
    url, base = sys.argv[1], sys.argv[2]
    with open_backend(url) as kv:
        seen = kv.get(base + "parent")
        print("SEEN", seen.value.decode() if seen is not None else "nothing", flush=True)
        kv.put(base + "child", b"from-child")
    """
)
_READER = textwrap.dedent(
    """
    import sys
    from rdzv_core import open_backend
    url, key = sys.argv[1], sys.argv[2]
    with open_backend(url) as kv:
        seen = kv.get(key)
        print("READ", seen.value.decode() if seen is not None else "nothing", flush=True)
    """
)


def run_child(script: str, *args: str) -> str:
    """Run ``script`` in a fresh Python process (this environment); return its stdout or fail with its stderr."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT)
    assert done.returncode == 0, f"helper process failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def test_multi_process_shares_one_keyspace(kv: KVBackend, key_prefix: str, rdzv_base_url: str,
                                           capabilities: Any) -> None:
    if not capabilities.multi_process:
        pytest.skip("backend declares multi_process=False (one keyspace per process)")
    base = key_prefix + "mp/"
    after = kv.put(base + "parent", b"from-parent").revision
    out = run_child(_WRITER, rdzv_base_url, base)
    assert "SEEN from-parent" in out, (
        f"backend declares multi_process=True, but another process did not see this process's write: {out!r}"
    )
    entry = kv.get(base + "child")
    assert entry is not None and entry.value == b"from-child", (
        "backend declares multi_process=True, but this process did not see another process's write"
    )
    events = kv.watch(base, after, 5.0)
    assert events == [Event(EventType.PUT, base + "child", entry.revision, b"from-child")], (
        f"backend declares multi_process=True, but watch did not return another process's write: {events}"
    )


def test_persistent_state_outlives_its_writer(key_prefix: str, rdzv_base_url: str, capabilities: Any) -> None:
    if not capabilities.persistent:
        pytest.skip("backend declares persistent=False (state ends with the process that wrote it)")
    if not capabilities.multi_process:
        pytest.skip("backend declares multi_process=False: no second process can look at the state")
    base = key_prefix + "persist/"
    run_child(_WRITER, rdzv_base_url, base)  # writes base + "child", then exits
    out = run_child(_READER, rdzv_base_url, base + "child")
    assert "READ from-child" in out, (
        f"backend declares persistent=True, but a key written by a process that has exited is gone: {out!r}"
    )
