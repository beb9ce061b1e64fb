"""Bad-input helpers shared by ``tests/backends/test_bad_input_etcd.py`` and ``test_bad_input_redis.py``: the
time to an error, and the TLS file cases both backends must name."""

from __future__ import annotations

import time
from typing import Any, Callable

from rdzv_core import InvalidURLError, open_backend


def timed_error(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``call``; return (the exception it raised or ``None``, seconds taken). Closes what it opened."""
    started = time.monotonic()
    try:
        result = call()
    except Exception as exc:  # judged by the caller
        return exc, time.monotonic() - started
    close = getattr(result, "close", None)
    if close is not None:
        close()
    return None, time.monotonic() - started


def open_bad(url: str, bad_input: str, record_property: Any, kind: type[Exception] = InvalidURLError) -> tuple[
        Any, float]:
    """``open_backend(url)``, which must raise ``kind``; records the time to the error."""
    error, elapsed = timed_error(lambda: open_backend(url))
    record_property("bad_input", bad_input)
    record_property("time_to_error_s", round(elapsed, 3))
    assert isinstance(error, kind), repr(error)
    return error, elapsed


#: (case, query files, field named, the file the error names (a name in ``tls``) or None).
FILE_CASES = [
    ("cacert not PEM", {"cacert": "not-pem.pem"}, "cacert", "not-pem.pem"),
    ("cert not PEM", {"cert": "not-pem.pem"}, "cert", "not-pem.pem"),
    ("cert without key", {"key": None}, "key", "client.pem"),
    ("key of another certificate", {"key": "foreign.key"}, "key", "foreign.key"),
    ("key not PEM", {"key": "not-pem.pem"}, "key", "not-pem.pem"),
    ("encrypted key", {"key": "encrypted.key"}, "key", "encrypted.key"),
]
