"""Bad input a user meets without looking for it: how fast it is refused, and what the error names.

Numbers with surrounding whitespace, IPv6 zone ids written wrongly, bad ports,
unknown query keys (whose values are shown unless the key is a secret's),
torchrun without ``--rdzv-id`` (real torchrun launchers), and Redis credentials
that are missing or wrong (a real server with a password). Each
``test_bad_input_*`` records ``time_to_error_s`` and ``bad_input`` (rendered into
``docs/reliability.md``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any, Callable, Iterator

import pytest

from conformance_tests.redis_server import RedisServer
from rdzv_core import ConfigError, InvalidURLError, Rendezvous, RendezvousParams, create_handler, open_backend
from rdzv_core.url import parse_url

pytestmark = pytest.mark.launchers  # starts launchers or torch workers (tests/conftest.py)

#: Parse-time errors must come at once (seconds; a loaded 2-core host).
FAST = 1.0


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Load torch and the backend registry once, so that the times measure the error, not the first import."""
    import rdzv_core.torch_api.handler  # noqa: F401  (imports torch)
    from rdzv_core import list_backends

    list_backends()


def timed_error(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``call``; return (the exception it raised or ``None``, seconds taken)."""
    started = time.monotonic()
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001  (the test inspects it)
        return exc, time.monotonic() - started
    close = getattr(result, "close", None)
    if close is not None:
        close()
    return None, time.monotonic() - started


def record(record_property: Any, what: str, seconds: float) -> None:
    record_property("bad_input", what)
    record_property("time_to_error_s", round(seconds, 3))


# -- query values ------------------------------------------------------------------------------
@pytest.mark.parametrize("query, field", [
    ("min_nodes=%201", "min_nodes"),
    ("max_nodes=2%20", "max_nodes"),
    ("min_workers=%091", "min_workers"),
    ("timeout=%2060", "timeout"),
    ("last_call_timeout=5%0A", "last_call_timeout"),
    ("keep_alive_ttl=%205", "keep_alive_ttl"),
    ("operation_timeout=%C2%A03", "operation_timeout"),  # a no-break space
    ("min_nodes=1_0", "min_nodes"),
    ("min_nodes=%EF%BC%92", "min_nodes"),  # a full-width digit 2
    ("timeout=1_0", "timeout"),
])
def test_bad_input_numbers_with_whitespace_or_non_ascii_digits(query: str, field: str,
                                                               record_property: Any) -> None:
    """``min_nodes=%201`` was taken as 1 (``int`` strips whitespace, reads ``_`` and any Unicode digit)."""
    exc, seconds = timed_error(lambda: create_handler(f"memory://bad-{uuid.uuid4().hex[:6]}/job?{query}"))
    record(record_property, f"query value {query}", seconds)
    assert isinstance(exc, InvalidURLError), exc
    assert exc.field == field and seconds < FAST


@pytest.mark.parametrize("url, field", [("redis://h/job?db=%200", "db"),
                                        ("redis://h/job?max_connections=8%20", "max_connections")])
def test_bad_input_backend_numbers_with_whitespace(url: str, field: str, record_property: Any) -> None:
    """The backends' own numeric keys follow the same rule (parsed before anything connects)."""
    from rdzv_core import parse_backend_url

    exc, seconds = timed_error(lambda: parse_backend_url(url))
    record(record_property, f"query value {url.partition('?')[2]}", seconds)
    assert isinstance(exc, InvalidURLError) and exc.field == field and seconds < FAST


@pytest.mark.parametrize("url", ["redis://h:\u0663/job", "redis://h:\u00b2/job", "etcd-v3://h:2379,h2:\uff12\uff13\uff17\uff19/job"])
def test_bad_input_ports(url: str, record_property: Any) -> None:
    """Ports are ASCII digits: ``"٣".isdigit()`` made port 3 of an Arabic-Indic digit, and ``"²"`` (a digit to
    ``isdigit``, not to ``int``) escaped as a plain ``ValueError``. (0, 65536, ``x``, empty: refused before.)"""
    from rdzv_core import parse_backend_url

    exc, seconds = timed_error(lambda: parse_backend_url(url))
    record(record_property, f"port in {url}", seconds)
    assert isinstance(exc, InvalidURLError) and exc.field == "port" and seconds < FAST


# -- IPv6 zone ids ----------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["[fe80::1%eth0]", "[fe80::1%25]", "[fe80::1%25eth%200]", "[%25eth0]",
                                  "[fe80::1%2525%25x]"])
def test_bad_input_ipv6_zone_ids(host: str, record_property: Any) -> None:
    """A zone id is ``%25`` then the zone (RFC 6874); anything else names the host, not credentials."""
    assert parse_url("redis://[fe80::1%25eth0]:6379/job").hosts == (("fe80::1%eth0", 6379),)  # the right form
    exc, seconds = timed_error(lambda: parse_url(f"redis://{host}:6379/job"))
    record(record_property, f"IPv6 zone: {host}", seconds)
    assert isinstance(exc, InvalidURLError) and exc.field == "host" and seconds < FAST
    assert "credential" not in str(exc)


@pytest.mark.parametrize("endpoint", ["[fe80::1%eth0]:6379", "[fe80::1%25]:6379"])
def test_bad_input_ipv6_zone_ids_in_rdzv_endpoint(endpoint: str, record_property: Any) -> None:
    """``rdzv-run --rdzv-endpoint``: the same rule; the error names the option."""
    from rdzv_agent.launch.config import backend_url

    exc, seconds = timed_error(lambda: backend_url("redis", endpoint, "job"))
    record(record_property, f"--rdzv-endpoint {endpoint}", seconds)
    assert isinstance(exc, ConfigError) and exc.field == "--rdzv-endpoint" and seconds < FAST
    assert "credential" not in str(exc)


def test_bad_input_an_empty_rdzv_id_is_named_empty(record_property: Any) -> None:
    """``--rdzv-id ""`` with the other two torchrun-style options: the error names the option and says it is
    empty (it said the three options go together, which they were; found by a new user)."""
    from rdzv_agent.launch import args as launch_args
    from rdzv_agent.launch import config as launch_config

    argv = ["--rdzv-backend", "redis", "--rdzv-endpoint", "127.0.0.1:6379", "--rdzv-id", "", "train.py"]
    exc, seconds = timed_error(lambda: launch_config.build_config(launch_args.parse_args(argv), {}))
    record(record_property, "--rdzv-id ''", seconds)
    assert isinstance(exc, ConfigError) and (exc.field, exc.value, exc.reason) == ("--rdzv-id", "", "empty")


# -- unknown keys and secrets -------------------------------------------------------------------
@pytest.mark.parametrize("call, field, shown", [
    (lambda: create_handler("memory://k/job?monkey=blue"), "monkey", "blue"),  # was '***' ("key$")
    (lambda: create_handler("memory://k/job", password="hunter2"), "password", "***"),  # was in clear
])
def test_bad_input_unknown_keys_show_their_value_unless_secret(call: Callable[[], object], field: str, shown: str,
                                                               record_property: Any) -> None:
    """One rule everywhere (query, keyword overrides): only a secret's value is redacted."""
    exc, seconds = timed_error(call)
    record(record_property, f"unknown key {field}", seconds)
    assert isinstance(exc, ConfigError) and exc.field == field and exc.value == shown and seconds < FAST
    assert "hunter2" not in str(exc)


@pytest.mark.parametrize("conf, shown", [("monkey=blue", "'monkey': 'blue'")])
def test_bad_input_unknown_key_through_rdzv_run(conf: str, shown: str, record_property: Any) -> None:
    """``rdzv-run --rdzv-conf`` applies the same rule as ``create_handler``: exit 2, the value shown unless secret."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rdzv_agent", "--nproc-per-node", "1", "--rdzv", "memory://k/job",
                          "--rdzv-conf", conf, "/bin/true"], capture_output=True, text=True, timeout=60)
    record(record_property, f"rdzv-run --rdzv-conf {conf.split('=')[0]}=... (process start included)",
           time.monotonic() - started)
    assert out.returncode == 2, out.stderr
    assert shown in out.stderr and "hunter2" not in out.stderr


# -- Redis credentials ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[RedisServer]:
    import redis

    server = RedisServer()
    server.start()
    try:
        redis.Redis(host=server.host, port=server.port).config_set("requirepass", "right-pw")
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("auth, value, user", [("", None, "default"), ("bob@", None, "bob"),
                                               (":wrong-pw@", "***", "default")])
def test_bad_input_redis_credentials(redis_with_password: RedisServer, auth: str, value: str | None, user: str,
                                     record_property: Any) -> None:
    """No password given: the error says so (value ``None``, not ``'***'``) and names the user."""
    url = f"redis://{auth}{redis_with_password.address}/job"
    exc, seconds = timed_error(lambda: open_backend(url))
    record(record_property, "Redis: " + ("no password" if value is None else "wrong password")
           + (f", user {user}" if user != "default" else ""), seconds)
    assert isinstance(exc, InvalidURLError) and exc.field == "password" and exc.value == value, exc
    assert repr(user) in exc.reason and "wrong-pw" not in str(exc) and "right-pw" not in str(exc)
    assert seconds < FAST


# -- torchrun without --rdzv-id ---------------------------------------------------------------
WORKER = textwrap.dedent(
    """
    import os
    print("RUN_ID", os.environ["TORCHELASTIC_RUN_ID"], flush=True)
    """
)

#: Variables that would give a run id: cleared so that the test sees torch's default ``none``.
JOB_ID_VARIABLES = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID",
                    "PBS_JOBID", "LSB_JOBID", "LSB_JOBINDEX", "PET_RDZV_ID")


def _torchrun(backend: str, endpoint: str, script: str, cwd: str, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
           "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
           "--rdzv-conf", "last_call_timeout=0.5,keep_alive_ttl=2,join_timeout=60", "--monitor-interval", "0.5",
           script]
    base = {k: v for k, v in os.environ.items() if k not in JOB_ID_VARIABLES}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**base, "PYTHONUNBUFFERED": "1", **env})


@pytest.fixture(params=["rdzv-redis", "rdzv-etcd", "rdzv-etcd-v3", "rdzv-file"])
def torchrun_endpoint(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, str, str]:
    """``(--rdzv-backend, --rdzv-endpoint, base URL of the same keyspace)``."""
    name = request.param
    if name == "rdzv-file":
        return name, str(tmp_path / "store"), f"file://{tmp_path / 'store'}/"
    server = request.getfixturevalue("rdzv_server_redis" if name == "rdzv-redis" else "rdzv_server_etcd")
    scheme = {"rdzv-redis": "redis", "rdzv-etcd": "etcd", "rdzv-etcd-v3": "etcd-v3"}[name]
    return name, server.address, f"{scheme}://{server.address}/"


def _run_state(base_url: str, run_id: str) -> dict[str, Any]:
    with open_backend(base_url) as kv:
        return Rendezvous(kv, run_id, RendezvousParams(min_nodes=1)).describe()


@pytest.mark.slow
def test_bad_input_torchrun_without_rdzv_id(torchrun_endpoint: tuple[str, str, str], tmp_path: Any,
                                            record_property: Any) -> None:
    """torch's default run id ``none`` is refused (exit 1, the error on ``rdzv_id``), and nothing is written."""
    backend, endpoint, base_url = torchrun_endpoint
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started = time.monotonic()
    out = _torchrun(backend, endpoint, str(script), str(tmp_path))
    seconds = time.monotonic() - started
    record(record_property, f"torchrun {backend} without --rdzv-id (torchrun start included)", seconds)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "InvalidURLError" in out.stderr and "'rdzv_id'" in out.stderr, out.stderr[-3000:]
    assert "RUN_ID" not in out.stdout  # no worker ran
    assert _run_state(base_url, "none")["status"] == "absent"


@pytest.mark.slow
def test_torchrun_without_rdzv_id_takes_the_schedulers_job_id(rdzv_server_redis: Any, tmp_path: Any) -> None:
    """Under SLURM the run id is ``slurm-JOB.STEP`` (the same on every node of the step): the job runs, and its run
    is closed under that id, not ``none``."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    job = str(uuid.uuid4().int % 10**9)
    out = _torchrun("rdzv-redis", rdzv_server_redis.address, str(script), str(tmp_path),
                    SLURM_JOB_ID=job, SLURM_STEP_ID="0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"RUN_ID slurm-{job}.0" in out.stdout
    base_url = f"redis://{rdzv_server_redis.address}/"
    assert _run_state(base_url, f"slurm-{job}.0")["status"] == "closed"
    assert _run_state(base_url, "none")["status"] == "absent"


def test_bad_input_torchrun_worker_environment_gives_no_run_id(record_property: Any) -> None:
    """A torchrun started by a torchelastic worker inherits its parent's job ids: refused, not merged into the
    parent's run."""
    from rdzv_core.torch_api.torchrun import derived_run_id

    env = {"TORCHELASTIC_RUN_ID": "parent-job", "TORCHELASTIC_RESTART_COUNT": "0", "SLURM_JOB_ID": "42"}
    exc, seconds = timed_error(lambda: derived_run_id("redis", env))
    record(record_property, "torchrun without --rdzv-id inside a torchelastic worker", seconds)
    assert isinstance(exc, InvalidURLError) and exc.field == "rdzv_id" and exc.value == "none"


@pytest.mark.parametrize("env, run_id", [
    ({"TORCHELASTIC_RUN_ID": "my-job"}, "my-job"),
    ({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4"}, "slurm-123.4"),
    ({"SLURM_JOB_ID": "123"}, "slurm-123"),
    ({"PBS_JOBID": "77[3].pbs01"}, "pbs-77_3_.pbs01"),
    ({"LSB_JOBID": "9", "LSB_JOBINDEX": "0"}, "lsf-9"),
    ({"LSB_JOBID": "9", "LSB_JOBINDEX": "2"}, "lsf-9.2"),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "5"}, "slurm-5"),
])
def test_derived_run_ids(env: dict[str, str], run_id: str) -> None:
    from rdzv_core.torch_api.torchrun import derived_run_id

    assert derived_run_id("redis", env)[0] == run_id


def test_memory_keeps_torchs_default_run_id_and_file_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rdzv-memory`` is one process's keyspace: ``none`` cannot meet another job there. ``rdzv-file``'s
    directory can be shared by two jobs on one host: ``none`` is refused there too."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_core.torch_api.torchrun import handler_url

    for name in JOB_ID_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    params = RendezvousParameters(backend="rdzv-memory", endpoint="", run_id="none", min_nodes=1, max_nodes=1)
    assert parse_url(handler_url("memory", params)).run_id == "none"
    params = RendezvousParameters(backend="rdzv-file", endpoint="/tmp/rdzv-none", run_id="none", min_nodes=1,
                                  max_nodes=1)
    with pytest.raises(InvalidURLError) as info:
        handler_url("file", params)
    assert info.value.field == "rdzv_id"


@pytest.mark.parametrize("name, secret", [("password", True), ("--redis-password", True), ("api_key", True),
                                          ("auth_token", True), ("passwd", True), ("key", False), ("monkey", False),
                                          ("cacert", False), ("username", False), ("keep_alive_ttl", False)])
def test_only_secret_fields_are_redacted(name: str, secret: bool) -> None:
    """The one rule behind every ``ConfigError``: a TLS ``key`` (a path) and ``monkey`` are not secrets."""
    from rdzv_core.errors import is_secret_field

    assert is_secret_field(name) is secret
    assert (ConfigError(name, "v", "r").value == "***") is secret
