"""The torch RendezvousHandler API over rdzv (memory and file backends)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

torch_api = pytest.importorskip("torch.distributed.elastic.rendezvous")

from rdzv_core import ConfigError, create_handler  # noqa: E402
from rdzv_core.torch_api.handler import RdzvHandler  # noqa: E402


@pytest.fixture(params=["memory", "file"])
def base(request, tmp_path) -> str:
    return "memory://handler-tests/" if request.param == "memory" else f"file://{tmp_path}/"


def _url(base: str, **q: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"keep_alive_ttl": 1, "last_call_timeout": 0.3, "timeout": 20, **q}.items())
    return f"{base}job{uuid.uuid4().hex[:8]}?{query}"


def _in_threads(handlers: list[RdzvHandler]) -> list:
    out: list = [None] * len(handlers)

    def run(i: int) -> None:
        try:
            out[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # asserted by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_is_a_torch_handler_and_returns_rendezvous_info(base: str) -> None:
    url = _url(base, min_nodes=2, max_nodes=2)
    handlers = [create_handler(url, local_addr="127.0.0.1") for _ in range(2)]
    assert all(isinstance(h, torch_api.RendezvousHandler) for h in handlers)
    infos = _in_threads(handlers)
    assert all(isinstance(i, torch_api.RendezvousInfo) for i in infos), infos
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    boot = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(boot) == 1 and next(iter(boot))[0] == "127.0.0.1"
    infos[0].store.set("from0", b"hello")
    assert infos[1].store.get("from0") == b"hello"
    assert handlers[0].get_backend() == base.split("://")[0]
    assert handlers[0].get_run_id() == url.split("/")[-1].split("?")[0]
    for h in handlers:
        assert h.shutdown() is True


def test_release_leaves_without_closing(base: str) -> None:
    url = _url(base, min_nodes=1, max_nodes=2)
    a, b = create_handler(url), create_handler(url)
    first = _in_threads([a, b])
    assert sorted(i.rank for i in first) == [0, 1]
    a.release()
    a.release()  # idempotent
    assert not b.is_closed()
    again = b.next_rendezvous()  # re-forms without a
    assert (again.rank, again.world_size) == (0, 1)
    assert a.shutdown() is False  # released: the backend is gone, nothing is closed
    assert not b.is_closed()
    b.set_closed()
    assert b.is_closed()
    with pytest.raises(torch_api.RendezvousClosedError):
        create_handler(url).next_rendezvous()
    b.shutdown()


def test_shutdown_closes_the_run_like_torchs_handlers(base: str) -> None:
    """torch's launch_agent calls shutdown() at the end of a job; torch's handlers close the run there."""
    url = _url(base, min_nodes=1, max_nodes=2)
    a, b = create_handler(url), create_handler(url)
    assert sorted(i.rank for i in _in_threads([a, b])) == [0, 1]
    assert a.shutdown() is True
    assert a.shutdown() is True  # idempotent
    assert b.is_closed()
    with pytest.raises(torch_api.RendezvousClosedError):
        b.next_rendezvous()
    assert b.shutdown() is True
    a.release()  # a no-op after shutdown()
    observer = create_handler(url)
    assert observer.is_closed()
    observer.release()


def test_shutdown_returns_false_when_the_run_cannot_be_closed() -> None:
    """A server that died under the handler: shutdown() logs, releases and returns False (as torch's does)."""
    pytest.importorskip("redis")
    from conformance_tests.redis_server import RedisServer

    server = RedisServer(appendonly=False)
    server.start()
    try:
        h = create_handler(f"redis://{server.address}/job?timeout=2&operation_timeout=0.5")
        server.kill()
        t0 = time.monotonic()
        assert h.shutdown() is False  # nothing listens there any more: logged, not raised
        assert h.shutdown() is False
        assert time.monotonic() - t0 < 10
    finally:
        server.stop()


def test_a_backend_restart_at_the_end_of_the_job_neither_fails_the_check_nor_leaves_the_run_open() -> None:
    """torchrun's agent ends the job on any error of num_nodes_waiting(), and calls shutdown() once: a Redis
    restart then must cost neither the job (the check answers 0) nor the closing of the run (retried)."""
    pytest.importorskip("redis")
    from conformance_tests.redis_server import RedisServer

    server = RedisServer(appendonly=True)
    server.start()
    try:
        url = f"redis://{server.address}/job{uuid.uuid4().hex[:6]}?timeout=20&operation_timeout=0.5&keep_alive_ttl=5"
        h = create_handler(url)
        h.next_rendezvous()
        server.kill()
        assert h.num_nodes_waiting() == 0  # refused at once: the workers keep running
        outcome: list = []
        closing = threading.Thread(target=lambda: outcome.append(h.shutdown()))
        closing.start()
        time.sleep(1.0)  # the outage being survived: shutdown() retries meanwhile
        server.start()
        closing.join(30)
        assert outcome == [True]  # waited for the server to come back, then closed the run
        observer = create_handler(url)
        assert observer.is_closed()
        observer.release()
    finally:
        server.stop()


def test_num_nodes_waiting(base: str) -> None:
    url = _url(base, min_nodes=1, max_nodes=2)
    member = create_handler(url)
    member.next_rendezvous()
    assert member.num_nodes_waiting() == 0
    late = create_handler(url)
    t = threading.Thread(target=late.next_rendezvous, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while member.num_nodes_waiting() < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    info = member.next_rendezvous()  # admit it
    t.join(30)
    assert info.world_size == 2
    member.shutdown()
    late.shutdown()


def test_timeout_maps_to_torch_error(base: str) -> None:
    h = create_handler(_url(base, min_nodes=2, timeout=1))
    t0 = time.monotonic()
    with pytest.raises(torch_api.RendezvousTimeoutError):
        h.next_rendezvous()
    assert time.monotonic() - t0 < 3.0
    h.shutdown()


def test_corrupt_state_maps_to_torch_error(base: str) -> None:
    url = _url(base, min_nodes=1)
    h = create_handler(url)
    h.rendezvous.kv.put(h.rendezvous.keys.round_record, b"{not json")
    with pytest.raises(torch_api.RendezvousStateError):
        h.next_rendezvous()
    h.shutdown()


def test_unreachable_backend_maps_to_connection_error() -> None:
    from conformance_tests.servers import free_port

    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{free_port()}/job?timeout=2&operation_timeout=0.5"
    t0 = time.monotonic()
    with pytest.raises(torch_api.RendezvousConnectionError):
        create_handler(url).next_rendezvous()
    assert time.monotonic() - t0 < 10


def test_overrides_win_and_are_validated(base: str) -> None:
    h = create_handler(_url(base, min_nodes=1, max_nodes=1), max_nodes=3, min_nodes=2)
    assert (h.params.min_nodes, h.params.max_nodes) == (2, 3)
    with pytest.raises(ConfigError):
        create_handler(_url(base), bogus=1)
    with pytest.raises(ConfigError):
        create_handler(_url(base), min_nodes=5, max_nodes=2)
    h.shutdown()


def test_shutdown_leaves_the_run_open_when_the_others_re_formed_without_this_node(base: str) -> None:
    """torch's handlers close the run in ``shutdown()`` (torchrun's end of a job); when the others already
    re-formed without this node -- it waited at torch's exit barrier, or stalled -- that would stop them at
    their next re-formation. Here it leaves the run open; a member of the live round still closes it."""
    url = _url(base, min_nodes=2, max_nodes=3)
    handlers = [create_handler(url, local_addr="127.0.0.1") for _ in range(3)]
    first = _in_threads(handlers)
    assert sorted(i.rank for i in first) == [0, 1, 2], first
    behind, *others = handlers
    again = _in_threads(others)  # the two re-form (the first to leave deletes its key: the round is destroyed)
    assert sorted(i.rank for i in again) == [0, 1] and {i.world_size for i in again} == {2}, again
    assert behind.shutdown() is True
    assert not others[0].is_closed(), "a node left behind closed the run under the two that train on"
    assert others[0].shutdown() is True
    assert others[1].is_closed()
    others[1].shutdown()


def test_a_spare_under_a_closed_run_gets_torchs_graceful_exit(base: str) -> None:
    url = _url(base, min_nodes=2, max_nodes=2)
    members = [create_handler(url, local_addr="127.0.0.1") for _ in range(2)]
    _in_threads(members)
    spare = create_handler(url, local_addr="127.0.0.1")
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.extend(_in_threads([spare])))
    thread.start()
    deadline = time.monotonic() + 20
    while members[0].rendezvous.describe().get("waiting") != 1:
        assert time.monotonic() < deadline, "the spare was never counted as waiting"
        time.sleep(0.02)
    assert [m.num_nodes_waiting() for m in members] == [0, 0]  # a full round: no restart for a spare
    members[0].shutdown()
    thread.join(30)
    assert isinstance(outcome[0], torch_api.RendezvousGracefulExitError), outcome
    members[1].shutdown()
    spare.release()


def test_create_handler_takes_a_parsed_url(base: str) -> None:
    from rdzv_core import parse_backend_url

    _, parsed = parse_backend_url(_url(base, min_nodes=1, max_nodes=1))
    handler = create_handler(parsed, local_addr="127.0.0.1")
    assert handler.get_run_id() == parsed.run_id and handler.params.last_call_timeout == 0.3
    assert handler.next_rendezvous().world_size == 1
    assert handler.shutdown() is True


def test_a_node_refused_for_its_settings_does_not_close_the_run_at_shutdown(base: str) -> None:
    """torchrun calls ``shutdown()`` when its agent ends on the refusal: the run stays open for the others."""
    url = _url(base, min_nodes=1, max_nodes=2)
    member = create_handler(url, local_addr="127.0.0.1")
    info = member.next_rendezvous()
    version = member.rendezvous.current.version  # type: ignore[union-attr]
    refused = create_handler(url.replace("max_nodes=2", "max_nodes=1"), local_addr="127.0.0.1")
    with pytest.raises(ConfigError) as error:
        refused.next_rendezvous()
    assert (error.value.field, error.value.value, getattr(error.value, "run_value", None)) == ("max_nodes", 1, 2)
    assert refused.shutdown() is False
    assert not member.is_closed()
    assert member.num_nodes_waiting() == 0
    assert member.rendezvous.describe()["version"] == version
    info.store.set("still", b"here")  # the member's round and its store are as they were
    assert member.shutdown() is True  # the member, when its job ends, closes the run as always
