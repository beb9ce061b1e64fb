"""The pluggy registry: built-ins through the entry point, conflicts, broken plugins."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from rdzv_core import BackendSpec, PluginError, UnknownBackendError, hookimpl, list_backends, open_backend
from rdzv_core.plugins import Registry
from rdzv_backends.memory import MemoryBackend


def test_builtins_register_through_the_entry_point() -> None:
    backends = list_backends()
    for scheme in ("memory", "file"):
        assert scheme in backends
        assert backends[scheme].distribution == "rdzv"
    assert backends["memory"].spec.capabilities.multi_host is False


def _plugin(*schemes: str):
    class Plugin:
        @staticmethod
        @hookimpl
        def rdzv_register_backends():
            return [BackendSpec(schemes=schemes, open=lambda url: MemoryBackend(),
                                capabilities=MemoryBackend.capabilities)]

    return Plugin


def test_scheme_claimed_twice_names_both_distributions() -> None:
    reg = Registry()
    reg._loaded = True  # only the plugins registered below
    reg.register(_plugin("dup"), "first-dist")
    with pytest.raises(PluginError) as info:
        reg.register(_plugin("dup"), "second-dist")
    assert "first-dist" in str(info.value) and "second-dist" in str(info.value)


def test_unknown_scheme_names_the_extra() -> None:
    reg = Registry()
    reg._loaded = True
    reg.register(_plugin("memory"), "rdzv")
    with pytest.raises(UnknownBackendError) as info:
        reg.lookup("redis")
    assert "rdzv[redis]" in str(info.value) and "memory" in str(info.value)


def test_broken_plugin_warns_and_others_work(tmp_path, caplog) -> None:
    """A distribution whose entry point fails to import: a warning, the rest still load."""
    dist = tmp_path / "broken_rdzv_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-rdzv-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rdzv]\nbroken = no_such_module_xyz:plugin\n")
    code = (
        "import logging, sys; sys.path.insert(0, sys.argv[1]);"
        "logging.basicConfig(level=logging.WARNING);"
        "import rdzv_core; b = rdzv_core.list_backends(); print(sorted(b));"
        "print(rdzv_core.open_backend('memory://x/'))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'file'" in out.stdout and "'memory'" in out.stdout
    assert "broken" in out.stderr and "no_such_module_xyz" in out.stderr


def test_open_backend_without_run_id() -> None:
    with open_backend("memory://plugins-test/") as kv:
        kv.put("a", b"1")
        assert kv.get("a").value == b"1"


def test_importing_core_does_not_import_torch() -> None:
    code = "import sys, rdzv_core; rdzv_core.open_backend('memory://x/'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_no_logging_handlers_installed() -> None:
    import rdzv_core.rendezvous  # noqa: F401

    for name in ("rdzv_core", "rdzv_core.rendezvous", "rdzv_core.plugins", "rdzv_backends"):
        assert logging.getLogger(name).handlers == []


@pytest.mark.parametrize("url", ["redis://127.0.0.1/team-a/job", "etcd-v3://127.0.0.1/a/b/job",
                                 "etcd://127.0.0.1/x/job", "memory://ks/team/job"])
def test_a_path_before_the_run_id_is_refused_unless_the_backend_uses_it(url: str) -> None:
    """``/team-a/job`` and ``/team-b/job`` must never silently name one run (only file:// reads the path)."""
    from rdzv_core import InvalidURLError, parse_backend_url

    with pytest.raises(InvalidURLError) as info:
        parse_backend_url(url)
    assert info.value.field == "path"
    info2, parsed = parse_backend_url("file:///tmp/team-a/job")
    assert (parsed.path, parsed.run_id) == ("tmp/team-a", "job")


def test_the_url_functions_live_with_the_registry_and_keep_their_old_paths() -> None:
    import rdzv_core
    import rdzv_core.torch_api.handler
    import rdzv_core.plugins

    for name in ("parse_backend_url", "open_backend", "list_backends"):
        assert getattr(rdzv_core, name) is getattr(rdzv_core.plugins, name)
    assert rdzv_core.torch_api.handler.parse_backend_url is rdzv_core.plugins.parse_backend_url
