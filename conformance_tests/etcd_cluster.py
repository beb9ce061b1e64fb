"""A real three-member ``etcd`` cluster on loopback, for leader-failure tests.

Each member is an :class:`EtcdMember` — the single-member controller
:class:`~conformance_tests.etcd_server.EtcdServer` (same flags: ``--enable-v2``,
``--unsafe-no-fsync``, 50 ms heartbeat, 500 ms election timeout; and ``--pre-vote``) with its own
name and the cluster's ``--initial-cluster`` — so kill -9, restart (same ports
and data directory: the member rejoins) and SIGSTOP come from
:class:`~conformance_tests.servers.ServerProcess`. :class:`EtcdCluster` starts
the members side by side (a member reports healthy only once a quorum has
formed), finds the leader through the v3 JSON gateway
(``POST /v3/maintenance/status``: the answering member's id and the leader's id,
as ``etcdctl endpoint status`` shows them), and builds multi-endpoint URLs.

Usage::

    with EtcdCluster() as cluster:
        leader = cluster.leader()
        url = cluster.url("etcd-v3", "run1", first=leader)   # etcd-v3://h:p1,h:p2,h:p3/run1
        leader.kill()
        cluster.leader(exclude=leader)                        # the new one (waits for the election)
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence

from .etcd_server import EtcdServer
from .servers import LOOPBACK, Placement, free_port

__all__ = ["EtcdMember", "EtcdCluster"]


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with the value after ``flag`` replaced by ``value`` (``flag`` must be present)."""
    index = argv.index(flag)
    return argv[: index + 1] + [value] + argv[index + 2 :]


class EtcdMember(EtcdServer):
    """One member of an :class:`EtcdCluster`.

    Args:
        member_name: the member's ``--name`` (str).
        enable_v2: serve the v2 API as well (default ``True``).
        placement: where it runs and the address it binds (default: here, ``127.0.0.1``).

    Attributes:
        member_name: as given.
        initial_cluster: ``NAME=PEER_URL,...`` of every member, set by the cluster before the first start.
        cluster_token: ``--initial-cluster-token``, set by the cluster.
    """

    name = "etcd-member"

    def __init__(self, member_name: str, enable_v2: bool = True, placement: Placement = LOOPBACK) -> None:
        super().__init__(enable_v2=enable_v2, placement=placement)
        self.member_name = member_name
        self.initial_cluster = ""
        self.cluster_token = ""

    @property
    def peer_url(self) -> str:
        """``http://127.0.0.1:PEER_PORT``."""
        return f"http://{self.host}:{self.peer_port}"

    def command(self) -> Sequence[str]:
        argv = [*super().command(), "--pre-vote"]  # etcd 3.6 default: a rejoining member forces no election
        argv = _replace_flag(argv, "--name", self.member_name)
        argv = _replace_flag(argv, "--initial-cluster", self.initial_cluster)
        return _replace_flag(argv, "--initial-cluster-token", self.cluster_token)

    def running(self) -> bool:
        """Whether the process is alive (it may be paused)."""
        return self.proc is not None and self.proc.poll() is None

    def status(self, timeout: float = 1.0) -> dict[str, object] | None:
        """The member's ``maintenance/status`` answer (``header.member_id``, ``leader``, ...), or
        ``None`` if it does not answer within ``timeout`` seconds (asked from where its placement reaches it)."""
        answer: dict[str, object] | None = self.placement.call(lambda: self._status(timeout))
        return answer

    def _status(self, timeout: float) -> dict[str, object] | None:
        request = urllib.request.Request(
            f"{self.client_url}/v3/maintenance/status", data=b"{}", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                body = json.loads(resp.read().decode("utf-8"))
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return body if isinstance(body, dict) else None

    def __repr__(self) -> str:
        return f"EtcdMember({self.member_name!r}, client={self.address}, peer={self.peer_port})"


def _distinct_ports(members: list[EtcdMember]) -> None:
    """Give every member client and peer ports no other member has.

    :func:`~conformance_tests.servers.free_port` returns a port that is free *now*; two calls
    may return the same one (seen: two members with one peer port, and etcd refusing an
    ``--initial-cluster`` with a duplicate URL).
    """
    used: set[int] = set()
    for m in members:
        for attr in ("port", "peer_port"):
            while getattr(m, attr) in used:
                setattr(m, attr, free_port())  # free here is free in a fresh namespace too
            used.add(getattr(m, attr))


class EtcdCluster:
    """Three (or ``size``) etcd members on free loopback ports, each with a temporary data directory.

    Args:
        size: number of members (int >= 1; 3 by default: a quorum survives one loss).
        enable_v2: serve the v2 API too, so ``etcd-v2://`` URLs work (default ``True``).
        placements: where each member runs (one per member, e.g. ``Host.placement`` of
            :mod:`~conformance_tests.multihost` hosts: one member per host); default: all here, on loopback.

    Raises:
        RuntimeError: from :meth:`start` when the members do not form a healthy cluster
            within ``EtcdMember.start_timeout`` seconds (the logs' tails are in the message).
        FileNotFoundError: from :meth:`start` when there is no ``etcd`` binary.
        TimeoutError: from :meth:`leader` when no leader is agreed on before the deadline.
    """

    def __init__(self, size: int = 3, enable_v2: bool = True, placements: Sequence[Placement] | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"invalid value for 'size': {size!r}: must be an int >= 1")
        if placements is not None and len(placements) != size:
            raise ValueError(f"invalid value for 'placements': {len(placements)} placements for {size} members")
        where = list(placements) if placements is not None else [LOOPBACK] * size
        self.members = [EtcdMember(f"m{i}", enable_v2=enable_v2, placement=where[i]) for i in range(size)]
        _distinct_ports(self.members)
        initial = ",".join(f"{m.member_name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
            m.cluster_token = f"rdzv-cluster-{self.members[0].port}"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "EtcdCluster":
        """Start every member that is not running (side by side) and wait until each is healthy."""
        errors: list[BaseException] = []

        def start(member: EtcdMember) -> None:
            try:
                member.start()
            except BaseException as exc:  # collected and raised below
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(m,), daemon=True) for m in self.members if not m.running()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"etcd cluster did not start: {errors[0]}") from errors[0]
        return self

    def stop(self) -> None:
        """Kill every member and remove the data directories."""
        for m in self.members:
            m.stop()

    def __enter__(self) -> "EtcdCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- queries -----------------------------------------------------------------------------
    def endpoints(self, first: EtcdMember | None = None) -> str:
        """``"127.0.0.1:P1,127.0.0.1:P2,..."``: the client addresses, ``first`` (if given) first."""
        order = sorted(self.members, key=lambda m: m is not first)
        return ",".join(m.address for m in order)

    def url(self, scheme: str, run_id: str = "", first: EtcdMember | None = None, **query: object) -> str:
        """``SCHEME://ENDPOINTS/RUN_ID?QUERY`` over every member (``first`` first, see :meth:`endpoints`)."""
        tail = "&".join(f"{k}={v}" for k, v in query.items())
        return f"{scheme}://{self.endpoints(first)}/{run_id}" + (f"?{tail}" if tail else "")

    def leader(self, exclude: EtcdMember | None = None, timeout: float = 15.0) -> EtcdMember:
        """The member that every running member (but ``exclude``) names as leader.

        Polls ``maintenance/status`` on the running members until they all answer and agree,
        and the leader is one of them (after a kill, the dead leader is still named until an
        election ends).

        Args:
            exclude: a member to leave out (e.g. the one just killed).
            timeout: seconds to wait at most.

        Raises:
            TimeoutError: no agreed, running leader within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            agreed, answers = self._look(exclude, deadline)
            if agreed is not None:
                return agreed[0]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no agreed etcd leader within {timeout} s; (member, leader, term): {answers}")
            time.sleep(0.05)

    def settled(self, quiet: float = 2.0, timeout: float = 30.0) -> EtcdMember:
        """The leader, once every member has named it in one raft term for ``quiet`` seconds.

        A member healed or restarted a moment ago may still disturb the cluster (etcd 3.5 without
        pre-vote: its higher term forces an election); a test that cuts the leader waits for this first.

        Raises:
            TimeoutError: not settled within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        seen, since = None, time.monotonic()
        while True:
            agreed, answers = self._look(None, deadline)
            now = time.monotonic()
            if agreed is None or agreed != seen:
                seen, since = agreed, now
            elif now - since >= quiet:
                return agreed[0]
            if now >= deadline:
                raise TimeoutError(f"etcd cluster not settled for {quiet} s within {timeout} s; "
                                   f"(member, leader, term): {answers}")
            time.sleep(0.1)

    def _look(self, exclude: EtcdMember | None, deadline: float) -> tuple[tuple[EtcdMember, str] | None, list]:
        """One poll: ``((leader, term), answers)`` if every running member (but ``exclude``) answered naming
        one running leader in one term, else ``(None, answers)``; answers: ``(member, leader id, term)``."""
        live = [m for m in self.members if m is not exclude and m.running()]
        ids: dict[str, EtcdMember] = {}
        answers: list[tuple[str, str, str]] = []
        for m in live:
            status = m.status(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            header = status.get("header") if status else None
            if not isinstance(header, dict) or not status:
                answers.append((m.member_name, "", ""))  # no answer: not settled
                continue
            ids[str(header.get("member_id"))] = m
            answers.append((m.member_name, str(status.get("leader", "")), str(status.get("raftTerm", ""))))
        named = {(leader, term) for _, leader, term in answers}
        if len(named) == 1:
            ((leader_id, term),) = named
            if leader_id in ids:
                return (ids[leader_id], term), answers
        return None, answers
