"""URL parsing: one form for every backend, and every documented error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv_core import ConfigError, InvalidURLError, UnknownBackendError, create_handler, parse_url
from rdzv_core.url import RendezvousURL


def test_full_form() -> None:
    u = parse_url("etcd://alice:s3cret@h1:2379,[::1]:2380,h3/some/path/job-7?min_workers=2&max_nodes=4&timeout=60",
                  default_port=2379)
    assert u.scheme == "etcd"
    assert u.hosts == (("h1", 2379), ("::1", 2380), ("h3", 2379))
    assert u.path == "some/path"
    assert u.run_id == "job-7"
    assert u.params == {"min_nodes": 2, "max_nodes": 4, "timeout": 60.0}
    assert (u.username, u.password) == ("alice", "s3cret")


def test_seed_and_torch_query_names() -> None:
    u = parse_url("x://h/r?min_workers=1&max_workers=3&last_call_timeout=5&etcd_prefix=/custom/p&keep_alive_ttl=2.5")
    assert u.params == {"min_nodes": 1, "max_nodes": 3, "last_call_timeout": 5.0, "prefix": "custom/p",
                        "keep_alive_ttl": 2.5}


def test_password_never_shown() -> None:
    u = parse_url("redis://bob:hunter2@h:1/run")
    assert "hunter2" not in repr(u) and "hunter2" not in str(u)
    with pytest.raises(InvalidURLError) as info:
        parse_url("redis://bob:hunter2@h:1/run?bogus=1")
    assert "hunter2" not in str(info.value)
    with pytest.raises(InvalidURLError) as info:
        parse_url("redis://bob:hunter2@h:99999/run")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "url, field",
    [
        ("etcd://h/run?color=blue", "color"),
        ("etcd://h/run?min_nodes=two", "min_nodes"),
        ("etcd://h/run?min_nodes=0", "min_nodes"),
        ("etcd://h/run?max_workers=-1", "max_workers"),
        ("etcd://h/run?min_nodes=3&max_nodes=2", "min_nodes"),
        ("etcd://h/run?timeout=-5", "timeout"),
        ("etcd://h/run?timeout=inf", "timeout"),
        ("etcd://h/run?last_call_timeout=nan", "last_call_timeout"),
        ("etcd://h/run?min_nodes=1&min_workers=1", "min_workers"),
        ("etcd://h/", "run_id"),
        ("etcd://h", "run_id"),
        ("etcd://h/..", "run_id"),
        ("etcd://h/a%2Fb", "run_id"),
        ("etcd://h/a%00b", "run_id"),
        ("etcd://h/" + "r" * 129, "run_id"),
        ("etcd://h/r%0A", "run_id"),
        ("etcd://h/run#", "url"),
        ("etcd://h:0/run", "port"),
        ("etcd://h:http/run", "port"),
        ("etcd://[::1/run", "host"),
        ("etcd://h$x/run", "host"),
        ("etcd:/h/run", "url"),
        ("1tcd://h/run", "scheme"),
        ("etcd://h/run?etcd_prefix=/a/../b", "etcd_prefix"),
        ("etcd://h/run#frag", "url"),
    ],
)
def test_errors_name_the_field(url: str, field: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        parse_url(url)
    assert info.value.field == field
    assert field in str(info.value)


def test_unknown_key_lists_valid_ones() -> None:
    with pytest.raises(InvalidURLError) as info:
        parse_url("etcd://h/run?colour=1")
    for key in ("min_nodes", "max_nodes", "timeout", "last_call_timeout", "min_workers"):
        assert key in str(info.value)


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(UnknownBackendError) as info:
        create_handler("nosuch://h/run")
    assert "memory" in str(info.value) and "file" in str(info.value)
    assert info.value.field == "scheme"


def test_errors_are_value_errors() -> None:
    assert issubclass(InvalidURLError, ValueError) and issubclass(ConfigError, ValueError)


def test_redacted_round_trip() -> None:
    u = parse_url("file:///tmp/d/run1?min_nodes=2")
    assert u.path == "tmp/d" and u.run_id == "run1"
    assert parse_url(u.redacted()) == u


_ALLOWED = (InvalidURLError, UnknownBackendError)


@settings(max_examples=10_000, deadline=None)
@given(
    scheme=st.sampled_from(["memory", "file", "etcd", "redis", "x", "", "Memory", "1x"]),
    netloc=st.text(max_size=30),
    path=st.text(max_size=40),
    query=st.lists(st.tuples(st.sampled_from(["min_nodes", "max_nodes", "timeout", "last_call_timeout",
                                              "keep_alive_ttl", "prefix", "min_workers", "bogus"]),
                             st.text(max_size=12)), max_size=4),
)
def test_only_documented_errors_escape(scheme: str, netloc: str, path: str, query: list[tuple[str, str]]) -> None:
    """Generated URLs either parse or raise a documented ValueError subclass naming its field."""
    url = f"{scheme}://{netloc}/{path}?" + "&".join(f"{k}={v}" for k, v in query)
    try:
        parsed = parse_url(url)
    except _ALLOWED as exc:
        assert isinstance(exc, ValueError)
        assert exc.field and repr(exc.field) in str(exc)  # named (escaped, as repr shows it)
    else:
        assert isinstance(parsed, RendezvousURL) and parsed.run_id


@pytest.mark.parametrize("query, field", [("keep_alive_ttl=1e308", "keep_alive_ttl"),
                                          ("operation_timeout=1e308", "operation_timeout"),
                                          ("min_nodes=99999999999999999999", "min_nodes"),
                                          ("keep_alive_ttl=0.001", "keep_alive_ttl")])
def test_values_beyond_what_clients_can_represent_are_refused(query: str, field: str) -> None:
    """1e308 s overflowed Redis's milliseconds; a 1 ms TTL cannot be refreshed over a network."""
    from rdzv_core import ConfigError, create_handler

    with pytest.raises(ConfigError) as info:
        create_handler(f"memory://bounds/job?{query}")
    assert info.value.field == field


@pytest.mark.parametrize("url", ["file://u:HuntER2x@/tmp/x/job", "memory://u:HuntER2x@space/job"])
def test_credentials_for_a_backend_without_auth_are_refused(url: str) -> None:
    """Credentials that would be silently ignored are an error naming the field, without the password."""
    from rdzv_core import parse_backend_url

    with pytest.raises(InvalidURLError) as info:
        parse_backend_url(url)
    assert info.value.field == "user" and "HuntER2x" not in str(info.value)


@pytest.mark.parametrize("url, field", [("redis://bob:hun%zzter2@h/run", "password"),
                                        ("redis://bob:hunter2%@h/run", "password"),
                                        ("redis://bob:hunter2%ff@h/run", "password"),
                                        ("redis://b%2@h/run", "username"),
                                        ("file:///tmp/a%zz/run", "path"),
                                        ("redis://h/run%g1", "run_id")])
def test_malformed_percent_escapes_are_refused_naming_the_part(url: str, field: str) -> None:
    """``urllib.parse.unquote`` keeps a bad ``%zz`` as text and replaces non-UTF-8 bytes: a password
    would differ from what the user meant, silently. Refused instead, the password not shown."""
    with pytest.raises(InvalidURLError) as info:
        parse_url(url)
    assert info.value.field == field
    assert "hunter2" not in str(info.value)
    assert parse_url("redis://bob:100%25%20sure@h/run").password == "100% sure"


def test_ipv6_zone_ids_are_parsed_as_rfc_6874_writes_them() -> None:
    """``[fe80::1%25eth0]``: the host is ``fe80::1%eth0`` (what the socket layer takes), written back as given."""
    u = parse_url("redis://[fe80::1%25eth0]:6380,[fe80::2%253]/run", default_port=6379)
    assert u.hosts == (("fe80::1%eth0", 6380), ("fe80::2%3", 6379))
    assert u.redacted() == "redis://[fe80::1%25eth0]:6380,[fe80::2%253]:6379/run"
    assert parse_url(u.redacted()) == u


def test_rdzv_endpoint_takes_an_ipv6_zone_id() -> None:
    from rdzv_agent.launch.config import backend_url

    url = backend_url("redis", "[fe80::1%25eth0]:6379", "job")
    assert parse_url(url).hosts == (("fe80::1%eth0", 6379),)


def _link_local_address() -> tuple[str, str] | None:
    """``(address, interface)`` of a link-local IPv6 address of this host, or ``None``."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    for hexaddr, _, _, scope, _, name in rows:
        if scope == "20" and name != "lo":  # 0x20: link scope
            import ipaddress

            return str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))), name
    return None


def test_ipv6_zone_ids_reach_real_servers() -> None:
    """Redis, etcd v2 and etcd v3 each reached at ``[LINK-LOCAL%25IFACE]`` (the zone passed to the client)."""
    import shutil

    from conformance_tests.etcd_server import EtcdServer
    from conformance_tests.redis_server import RedisServer
    from conformance_tests.servers import ServerProcess
    from rdzv_core import open_backend

    found = _link_local_address()
    if found is None:
        pytest.skip("this host has no link-local IPv6 address")
    address, iface = found
    host = f"[{address}%25{iface}]"
    redis_server = RedisServer(extra_args=("--bind", f"127.0.0.1 {address}%{iface}", "--protected-mode", "no"))
    servers: list[tuple[ServerProcess, list[str]]] = [(redis_server, ["redis"])]
    if shutil.which("etcd"):
        etcd = EtcdServer()
        # etcd cannot bind a zoned address: it listens on every address, the link-local one included
        etcd.extra_args = ("--listen-client-urls", f"http://[::]:{etcd.port}")
        servers.append((etcd, ["etcd", "etcd-v3"]))
    for server, schemes in servers:
        server.start()
        try:
            for scheme in schemes:
                with open_backend(f"{scheme}://{host}:{server.port}/?operation_timeout=5") as kv:
                    assert kv.put("zone/k", scheme.encode()).value == scheme.encode()
                    entry = kv.get("zone/k")
                    assert entry is not None and entry.value == scheme.encode()
        finally:
            server.stop()


def test_with_params_sets_keys_by_any_alias_with_the_urls_converters() -> None:
    from rdzv_core import parse_backend_url

    _, url = parse_backend_url("etcd-v3://h/job?min_workers=2&timeout=7")
    assert url.key_name("min_nodes") == "min_workers"
    out = url.with_params({"join_timeout": "9", "max_nodes": 3, "cacert": "/ca.pem"})  # etcd-v3's own key
    assert dict(out.params) == {"min_nodes": 2, "timeout": 9.0, "max_nodes": 3, "cacert": "/ca.pem"}
    assert out.key_name("timeout") == "join_timeout" and dict(url.params) == {"min_nodes": 2, "timeout": 7.0}
    assert dict(url.with_params({"min_nodes": "5", "max_nodes": "6"}, replace=False).params) == {
        "min_nodes": 2, "timeout": 7.0, "max_nodes": 6}
    for values, field in (({"min_nodes": "0"}, "min_nodes"), ({"nope": "1"}, "nope"),
                          ({"max_workers": "1"}, "min_workers"),
                          ({"timeout": "1", "join_timeout": "2"}, "join_timeout")):
        with pytest.raises(InvalidURLError) as info:
            url.with_params(values)
        assert info.value.field == field, values
    with pytest.raises(InvalidURLError):  # a key of another backend
        parse_url("file:///d/job").with_params({"cacert": "/ca.pem"})


def test_a_parsed_url_is_checked_against_its_backend_not_parsed_again() -> None:
    from rdzv_core import parse_backend_url

    _, url = parse_backend_url(RendezvousURL("redis", (("h", None),), "", "job", {"db": 3}))
    assert url.hosts == (("h", 6379),) and url.query_keys  # the default port; redis's keys for with_params
    for built, field in ((RendezvousURL("redis", (("h", 1),), "", "job", {"nope": "x"}), "nope"),
                         (RendezvousURL("redis", (("h", 1),), "team", "job"), "path"),
                         (RendezvousURL("etcd-v3", (), "", "job"), "host"),
                         (RendezvousURL("file", (), "d", ".."), "run_id"),
                         (RendezvousURL("file", (), "d", "job", {}, "u", "pw"), "user")):
        with pytest.raises(InvalidURLError) as info:
            parse_backend_url(built)
        assert info.value.field == field, built
