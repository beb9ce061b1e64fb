"""``rdzv check URL``: open a backend, run a short protocol self-test, report latency (``--json``: as data)."""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from rdzv_core.errors import UnsuitableServerError
from rdzv_core.kv import KVBackend, join_key
from rdzv_core.plugins import parse_backend_url

__all__ = ["cmd_check"]


def cmd_check(args: argparse.Namespace) -> int:
    """Open the backend, run a short protocol self-test, report latency. A server the backend refuses
    (:class:`UnsuitableServerError`) is a failed check ``server`` with the backend's message; what the
    backend accepted with a warning (``KVBackend.server_warnings``) is shown as a warning."""
    info, parsed = parse_backend_url(args.url, require_run_id=False)
    report: dict[str, Any] = {"scheme": parsed.scheme, "capabilities": info.spec.capabilities.as_dict(),
                              "problems": [], "warnings": []}
    t0 = time.monotonic()
    try:
        kv = info.spec.open(parsed)
    except UnsuitableServerError as exc:
        report.update(checks={"server": False}, problems=[str(exc)])
        return _print_check(args, report)
    report["connect_ms"] = round((time.monotonic() - t0) * 1000, 2)
    report["warnings"] = list(kv.server_warnings)
    prefix = join_key("rdzv-check", uuid.uuid4().hex) + "/"
    checks: dict[str, bool] = {}
    lat: list[float] = []
    with kv:
        try:
            for i in range(5):
                s = time.monotonic()
                e = kv.put(prefix + "k", str(i).encode())
                lat.append(time.monotonic() - s)
            got = kv.get(prefix + "k")
            checks["put/get"] = got is not None and got.value == b"4"
            cas = kv.compare_and_swap(prefix + "k", b"x", e.revision)
            checks["compare_and_swap"] = cas.revision > e.revision
            checks["add"] = kv.add(prefix + "n", 2) == 2 and kv.add(prefix + "n", 3) == 5
            checks["watch"] = bool(kv.watch(prefix, e.revision, 2.0))
            kv.put(prefix + "t", b"", ttl=0.5)
            checks["ttl"] = bool(_wait_gone(kv, prefix + "t", 0.5 + 2 * info.spec.capabilities.ttl_resolution + 2))
        finally:
            for entry in kv.list(prefix)[0]:
                kv.delete(entry.key)
    report["checks"] = {"server": True, **checks}
    report["put_latency_ms_median"] = round(sorted(lat)[len(lat) // 2] * 1000, 2)
    return _print_check(args, report)


def _print_check(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """Print ``rdzv check``'s report (``--json``: as data); 0 if every check passed, else 1."""
    checks: dict[str, bool] = report["checks"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if "connect_ms" in report:
            print(f"{report['scheme']}: connected in {report['connect_ms']} ms; "
                  f"put median {report['put_latency_ms_median']} ms")
        else:
            print(f"{report['scheme']}: the backend refused the server")
        for name, ok in checks.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
        for problem in report["problems"]:
            print(f"  FAIL {problem}")
        for warning in report["warnings"]:
            print(f"  WARN {warning}")
    return 0 if all(checks.values()) else 1


def _wait_gone(kv: KVBackend, key: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if kv.get(key) is None:
            return True
        time.sleep(0.05)
    return False
