"""A third-party plugin gets every behaviour a built-in backend gets.

The PostgreSQL example (``examples/rdzv-postgres``, installed next to the project as a third party would):
``rdzv backends``, ``rdzv status``/``close``/``reset``, torchrun's flags-to-URL converter and run-id rule,
and a real ``rdzv-run`` job. The core knows no backend by name: each fact comes from the backend's
``BackendSpec`` and ``Capabilities``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

from rdzv_core import Rendezvous, RendezvousParams, open_backend
from rdzv_core.plugins import list_backends
from rdzv_core.torch_api.torchrun import endpoint_url, rendezvous_url

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

pytest.importorskip("rdzv_postgres")


def _rdzv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rdzv_admin", *args], capture_output=True, text=True,
                          timeout=60)


def test_rdzv_backends_shows_the_plugins_own_facts() -> None:
    rows = json.loads(_rdzv("backends", "--json").stdout)
    assert set(rows["postgresql"]) == set(rows["redis"]), "the same columns as a built-in"
    assert (rows["postgresql"]["distribution"], rows["postgresql"]["default_port"],
            rows["postgresql"]["server_endpoints"]) == ("rdzv-postgres", 5432, "one")
    spec = list_backends()["postgresql"].spec
    assert spec.server_endpoints == "one" and spec.capabilities.multi_process


def test_torchrun_flags_become_a_plugin_url_by_the_same_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The converter takes the plugin's scheme and its ``rdzv-`` handler name, with its default port; a missing
    ``--rdzv-id`` is derived from the environment as for any backend shared by processes."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    url = endpoint_url("rdzv-postgresql", "u:pw@db.example", "job")
    assert (url.scheme, url.hosts, url.username, url.run_id) == ("postgresql", (("db.example", 5432),), "u", "job")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "from-env")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    params = RendezvousParameters(backend="rdzv-postgresql", endpoint="db.example:5433", run_id="none",
                                  min_nodes=1, max_nodes=2, last_call_timeout="1")
    url = rendezvous_url("postgresql", params)
    assert (url.run_id, url.hosts, url.params["max_nodes"], url.params["last_call_timeout"]) == \
        ("from-env", (("db.example", 5433),), 2, 1.0)


def test_rdzv_run_status_close_and_reset_on_the_plugins_server(rdzv_server_postgres: Any, tmp_path: Any) -> None:
    run_id = "parity-" + uuid.uuid4().hex[:8]
    rdzv_run = os.path.join(os.path.dirname(sys.executable), "rdzv-run")
    proc = subprocess.run([rdzv_run, "--rdzv-backend", "postgresql", "--rdzv-endpoint", rdzv_server_postgres.address,
                           "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=0.5", "--no-python", "/bin/true"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    live = f"parity-live-{uuid.uuid4().hex[:8]}"
    url = f"postgresql://{rdzv_server_postgres.address}/{live}"
    kv = open_backend(f"postgresql://{rdzv_server_postgres.address}/")
    member = Rendezvous(kv, live, RendezvousParams(min_nodes=1, keep_alive_ttl=30))
    try:
        result = member.next_round()
        out = _rdzv("status", url, "--json")
        status = json.loads(out.stdout)
        assert out.returncode == 0 and status["verdict"] == "healthy", out.stdout + out.stderr
        assert (status["status"], status["version"], status["participants"]) == ("final", result.version, 1)
        assert _rdzv("close", url, "--yes").returncode == 0 and member.is_closed()
        assert _rdzv("reset", url, "--yes").returncode == 0
        assert json.loads(_rdzv("status", url, "--json").stdout)["verdict"] == "absent"
    finally:
        member.leave()
        kv.close()


def test_the_plugins_torchrun_handler_forms_a_round(rdzv_server_postgres: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's ``torchrun.handlers`` object is made by the same ``handler_creator`` as the built-ins'; the
    handler it creates is rdzv's, with the agent's protocol."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    import rdzv_postgres
    from rdzv_core.torch_api.handler import ElasticHandler

    run_id = "parity-torchrun-" + uuid.uuid4().hex[:8]
    params = RendezvousParameters(backend="rdzv-postgresql", endpoint=rdzv_server_postgres.address, run_id=run_id,
                                  min_nodes=1, max_nodes=1, last_call_timeout="0.5")
    handler = rdzv_postgres.torchrun_handler()(params)
    try:
        assert isinstance(handler, ElasticHandler)
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1) and handler.round_version() is not None
    finally:
        handler.shutdown()
