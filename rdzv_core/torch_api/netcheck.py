"""The network check of a formed round (``docs/node-health.md``, "Network check of a round"): plain TCP.

Once a round is final, every member listens on the address it would publish as ``MASTER_ADDR`` (port 0) and
publishes it in the round's extra data; then two ring passes (shift 1 and 2): in each, rank ``r`` sends
``mib`` MiB to ``(r + s) % n`` while it receives from ``(r - s) % n``. The receiver measures the link: RTT
(a ping-pong before the bulk transfer, the smallest of :data:`PINGS`) and throughput (bytes after the first
chunk / seconds from the first to the last byte), and publishes its links. Every member reads every result;
one that does not come within ``timeout`` is a failed link (rate 0). :func:`outliers` is the verdict.
:func:`checked_round` is ``next_round`` with the check and the exclusion of outliers around it.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import statistics
import struct
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ..errors import BackendClosedError, BackendUnavailableError, ConfigError, RendezvousStateError
from ..kv import wait_for_change
from ..rendezvous import Rendezvous, RoundResult

__all__ = ["NetcheckSettings", "Link", "Verdict", "outliers", "node_rates", "check_round", "checked_round",
           "QUERY_KEYS", "PINGS", "SLACK"]

log = logging.getLogger(__name__)

#: URL query key -> :class:`NetcheckSettings` field.
QUERY_KEYS = {"network_check": "enabled", "network_check_mib": "mib", "network_check_factor": "factor",
              "network_check_timeout": "timeout"}
PINGS = 3  #: ping-pongs before each bulk transfer (the RTT is the smallest)
_HEADER = struct.Struct("!4sBIQ")  # magic, shift, sender rank, bytes
_MAGIC = b"RNC1"
_CHUNK = 256 * 1024  # bytes per send and receive call (16 KiB when the test seam paces them)
_TRANSFER_SHARE = 0.7  # of the timeout: the transfers end by then; the rest is for reading the results
_ADDRESS_SHARE, _ADDRESS_WAIT = 0.25, 5.0  # the members' addresses are awaited this share of the timeout, at most s
#: Seconds a slow link must take beyond the median link's time (:func:`outliers`' ``slack``).
SLACK = 0.1
#: Test seam: ``(role, node name) -> bytes/s`` ("send" or "recv"; ``None``: unpaced). Unit tests only.
_throttle: Callable[[str, str], float | None] | None = None


@dataclass(frozen=True)
class NetcheckSettings:
    """The check's settings (query keys in :data:`QUERY_KEYS`): ``enabled`` (run it at every round), ``mib``
    (MiB sent per link, > 0), ``factor`` (> 1: see :func:`outliers`), ``timeout`` (seconds, > 0).

    Raises:
        ConfigError: a value of the wrong type or out of range (names the field and value).
    """

    enabled: bool = False
    mib: float = 4.0
    factor: float = 4.0
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("enabled", self.enabled, "must be True or False")
        for name, low, high in (("mib", 0.0, 1e6), ("factor", 1.0, 1e9), ("timeout", 0.0, 1e7)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
                raise ConfigError(name, value, f"must be a number > {low:g} and <= {high:g}")

    @classmethod
    def from_query(cls, query: Mapping[str, Any]) -> "NetcheckSettings":
        """The settings of a parsed URL query (``RendezvousURL.params``; other keys ignored).

        Raises:
            ConfigError: a bad value, naming its query key.
        """
        try:
            return cls(**{f: query[k] for k, f in QUERY_KEYS.items() if k in query})
        except ConfigError as exc:
            key = next((k for k, f in QUERY_KEYS.items() if f == exc.field), exc.field)
            raise ConfigError(key, exc.value, exc.reason) from None


@dataclass(frozen=True)
class Link:
    """One measured link: ``sender`` -> ``receiver`` (ranks) in the pass of ``shift``; ``rate`` in bytes/s (0: it
    failed), ``rtt`` in seconds (``None``: not measured), ``error``: why it failed or was cut short."""

    sender: int
    receiver: int
    shift: int
    rate: float
    rtt: float | None = None
    error: str = ""


def node_rates(links: Sequence[Link]) -> dict[int, float]:
    """Each node's rate: the lower median of the rates of its links, as sender and as receiver (bytes/s).
    With two passes a node has four links: two slow ones (its sends, or its receives) make it slow, one (a
    slow neighbour's) does not; egress and ingress shaping are told apart from the neighbours' this way."""
    rates: dict[int, list[float]] = {}
    for link in links:
        rates.setdefault(link.sender, []).append(link.rate)
        rates.setdefault(link.receiver, []).append(link.rate)
    return {node: statistics.median_low(values) for node, values in rates.items()}


def outliers(links: Sequence[Link], factor: float, nbytes: int = 0, slack: float = 0.0) -> list[int]:
    """The ranks whose links' lower median rate is below the median rate of all links / ``factor``: at least
    half of their links are *slow*. Sorted. With ``nbytes`` (bytes per link) and ``slack`` (seconds), a link is
    slow only if it also took ``slack`` seconds longer than ``nbytes`` take at the median rate: a stall of a few
    milliseconds (a busy process) makes a fast link look many times slower.

    Found one at a time, the worst first (the most slow links, then the lowest mean rate); a slow link of a
    node found is explained by it and no longer counts against the other end: with n = 3 or 4 a dead node's
    partner in both directions has two slow links of four too. Nobody with fewer than 3 nodes (a link's two
    ends cannot be told apart), nor when the median is 0.
    """
    ends = {link.sender for link in links} | {link.receiver for link in links}
    if len(ends) < 3:
        return []
    median = statistics.median(link.rate for link in links)
    if median <= 0:
        return []
    threshold = min(median / factor, nbytes / (slack + nbytes / median)) if nbytes and slack else median / factor
    found: list[int] = []
    while True:
        candidates = []
        for node in ends - set(found):
            mine = [link for link in links if node in (link.sender, link.receiver)]
            slow = [link for link in mine if link.rate < threshold and not {link.sender, link.receiver} & set(found)]
            if 2 * len(slow) >= len(mine) and slow:
                candidates.append((-len(slow), statistics.fmean(link.rate for link in mine), node))
        if not candidates:
            return sorted(found)
        found.append(min(candidates)[2])


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`check_round`: ``n`` members, their ``names`` (rank -> node name), every ``link``,
    the ``median`` link rate (bytes/s), the ``outliers`` (ranks), ``seconds`` the check took, ``rates`` (rank ->
    :func:`node_rates`), ``attempts`` (2: measured again to confirm outliers), ``complete``: whether every member
    took part (published its address)."""

    n: int
    names: dict[int, str]
    links: tuple[Link, ...]
    median: float
    outliers: tuple[int, ...]
    seconds: float
    rates: dict[int, float] = field(default_factory=dict)
    attempts: int = 1
    complete: bool = True

    def name(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")


def _rate_text(rate: float) -> str:
    return f"{rate / 2**30:.2f} GiB/s" if rate >= 2**30 else f"{rate / 2**20:.3g} MiB/s"


def _pace(role: str, node: str, done: int, began: float) -> None:
    rate = _throttle(role, node) if _throttle is not None else None
    if rate:
        time.sleep(max(0.0, began + done / rate - time.monotonic()))


def _timeout(deadline: float) -> float:
    if deadline <= time.monotonic():
        raise TimeoutError("the check's deadline passed")
    return deadline - time.monotonic()


def _recv_exact(conn: socket.socket, size: int, deadline: float) -> bytes:
    data = b""
    while len(data) < size:
        conn.settimeout(_timeout(deadline))
        part = conn.recv(size - len(data))
        if not part:
            raise ConnectionError("closed by the peer")
        data += part
    return data


class _Check:
    """One member's part in the check of one round (see the module)."""

    def __init__(self, rdzv: Rendezvous, result: RoundResult, settings: NetcheckSettings, host: str,
                 attempt: int) -> None:
        self.rdzv, self.result, self.settings, self.host, self.attempt = rdzv, result, settings, host, attempt
        self.n, self.rank, self.node = result.world_size, result.rank, rdzv.node_name
        self.shifts = [s for s in (1, 2) if s % self.n]
        self.nbytes = max(1, int(settings.mib * 2**20))
        self.began = time.monotonic()
        self.transfer_end = self.began + settings.timeout * _TRANSFER_SHARE  # the rest: reading the results
        self.received: dict[int, Link] = {}
        self.got = {s: threading.Event() for s in self.shifts}  # this node's receive of pass s is over
        self.passed = {s: threading.Event() for s in self.shifts}  # this node's pass s is over

    def _store(self, what: str, value: dict[str, Any]) -> None:
        key = f"netcheck/{self.attempt}/{what}/{self.rank}"
        self.rdzv.store_extra_data(self.result.version, key, json.dumps(value).encode(), self.result.round_id)

    def _gather(self, what: str, ranks: set[int], deadline: float) -> dict[int, dict[str, Any]]:
        """The members' published ``what`` (rank -> value) of ``ranks``, waiting until all came or ``deadline``
        (monotonic): the round's extra data read with one listing per change."""
        rid = self.result.round_id or None
        wanted = {self.rdzv.keys.extra(self.result.version, rid, f"netcheck/{self.attempt}/{what}/{r}"): r
                  for r in ranks}
        directory, found = self.rdzv.keys.extra_dir(self.result.version, rid), {}
        while True:
            entries, revision = self.rdzv.kv.list(directory)
            for entry in entries:
                try:
                    value = json.loads(entry.value) if entry.key in wanted else None
                except ValueError:
                    continue
                if isinstance(value, dict):
                    found[wanted[entry.key]] = value
            if len(found) == len(wanted) or not wait_for_change(self.rdzv.kv, directory, revision, deadline,
                                                                read_revision=revision):
                return found

    def run(self) -> Verdict:
        with socket.create_server((self.host, 0), family=_family(self.host), backlog=8) as listener:
            threading.Thread(target=self._accept, args=(listener,), name="rdzv-netcheck", daemon=True).start()
            bound = listener.getsockname()  # numeric, so that every peer connects to the address bound
            host = f"{bound[0]}%{bound[3]}" if len(bound) > 3 and bound[3] else bound[0]
            self._store("addr", {"host": host, "port": bound[1], "node": self.node})
            # a member that publishes no address takes no part (its network_check is off): it is not judged
            found = self.began + min(self.settings.timeout * _ADDRESS_SHARE, _ADDRESS_WAIT)
            addresses = self._gather("addr", set(range(self.n)) - {self.rank}, found)
            present = {self.rank} | set(addresses)
            start = time.monotonic()
            for i, shift in enumerate(self.shifts):  # each pass its share of the time: a stuck one starves no other
                end = start + (self.transfer_end - start) * (i + 1) / len(self.shifts)
                if (self.rank - shift) % self.n not in present:
                    self.got[shift].set()  # nobody sends to this node in this pass
                target = addresses.get((self.rank + shift) % self.n)
                sender = threading.Thread(target=self._send, args=(shift, target), name="rdzv-netcheck", daemon=True)
                sender.start()
                sender.join(max(end - time.monotonic(), 0.0))
                self.got[shift].wait(max(end - time.monotonic(), 0.0))
                self.passed[shift].set()
            mine = [self.received.get(s) or Link((self.rank - s) % self.n, self.rank, s, 0.0, None, "nothing came")
                    for s in self.shifts]
            self._store("result", {"node": self.node, "links": [asdict(link) for link in mine]})
            names, links = {self.rank: self.node}, list(mine)
            results = self._gather("result", present - {self.rank}, self.began + self.settings.timeout)
            for receiver in sorted(present - {self.rank}):
                value = results.get(receiver, {})
                try:
                    links += [Link(int(d["sender"]), receiver, int(d["shift"]), float(d["rate"]),
                                   None if d.get("rtt") is None else float(d["rtt"]), str(d.get("error", "")))
                              for d in value["links"]]
                    names[receiver] = str(value.get("node", f"rank {receiver}"))
                except (KeyError, TypeError, ValueError):  # none came: a failed link
                    links += [Link((receiver - s) % self.n, receiver, s, 0.0, None, "no result") for s in self.shifts]
        links = [link for link in links if link.sender in present]
        if present != set(range(self.n)):
            log.warning("network check of round %d: rank(s) %s published no address and are not judged (is "
                        "network_check set on every node?)", self.result.version, sorted(set(range(self.n)) - present))
        median = statistics.median(link.rate for link in links) if links else 0.0
        slow = outliers(links, self.settings.factor, self.nbytes, SLACK)
        return Verdict(self.n, names, tuple(links), median, tuple(slow), time.monotonic() - self.began,
                       node_rates(links), complete=present == set(range(self.n)))

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the check is over
            threading.Thread(target=self._receive, args=(conn,), name="rdzv-netcheck", daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        """One pass's transfer to this node: header, pings (RTT), the bulk (throughput), an acknowledgement."""
        received, first_len, first, last, rtt, began = 0, 0, 0.0, 0.0, math.inf, 0.0
        magic, shift, sender, nbytes = b"", 0, 0, 0
        with conn:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                magic, shift, sender, nbytes = _HEADER.unpack(_recv_exact(conn, _HEADER.size, self.transfer_end))
                if magic != _MAGIC or shift not in self.got or sender != (self.rank - shift) % self.n:
                    return
                if shift != self.shifts[0]:  # one transfer at a time per node: wait for the pass before
                    self.passed[self.shifts[0]].wait(max(self.transfer_end - time.monotonic(), 0.0))
                for _ in range(PINGS):
                    sent = time.monotonic()
                    conn.sendall(b"p")
                    _recv_exact(conn, 1, self.transfer_end)
                    rtt = min(rtt, time.monotonic() - sent)
                buffer, began = bytearray(_chunk()), time.monotonic()
                while received < nbytes:
                    conn.settimeout(_timeout(self.transfer_end))
                    size = conn.recv_into(buffer, min(len(buffer), nbytes - received))
                    if not size:
                        raise ConnectionError("closed by the sender")
                    last = time.monotonic()
                    first, first_len = (last, size) if not received else (first, first_len)
                    received += size
                    _pace("recv", self.node, received, began)
                conn.sendall(b"k")
                error = ""
            except (OSError, struct.error) as exc:
                if magic != _MAGIC:
                    return
                error = f"{type(exc).__name__} after {received} of {nbytes} bytes: {exc}"
            rate = _rate(received - first_len, last - first) if received > first_len else _rate(received, last - began)
            self.received[shift] = Link(sender, self.rank, shift, rate, None if rtt == math.inf else rtt, error)
            self.got[shift].set()

    def _send(self, shift: int, target: dict[str, Any] | None) -> None:
        """This pass's transfer to ``target`` (its published address); a failure is the receiver's to report."""
        try:
            if target is None:
                return
            with socket.create_connection((str(target["host"]), int(target["port"])),
                                          timeout=_timeout(self.transfer_end)) as conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the pings go at once
                conn.sendall(_HEADER.pack(_MAGIC, shift, self.rank, self.nbytes))
                for _ in range(PINGS):
                    conn.sendall(_recv_exact(conn, 1, self.transfer_end))
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)  # the bulk in full segments
                chunk, sent, began = memoryview(bytes(_chunk())), 0, time.monotonic()
                while sent < self.nbytes:
                    conn.settimeout(_timeout(self.transfer_end))
                    conn.sendall(chunk[:min(len(chunk), self.nbytes - sent)])
                    sent += min(len(chunk), self.nbytes - sent)
                    _pace("send", self.node, sent, began)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # flushes the last partial segment
                _recv_exact(conn, 1, self.transfer_end)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            log.debug("network check: sending to %s failed: %s", target, exc)


def _chunk() -> int:
    return _CHUNK if _throttle is None else 16 * 1024


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-6) if nbytes > 0 else 0.0


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    except (OSError, UnicodeError, IndexError):
        return socket.AF_INET


def check_round(rdzv: Rendezvous, result: RoundResult, settings: NetcheckSettings, host: str) -> Verdict:
    """Run this member's part of the check of ``result``'s round, listening on ``host``; every member computes
    its verdict from the same published results. When it finds outliers it measures once more, and an outlier is
    a node found both times (a stall of a busy process seldom hits one node twice; a slow link always does).
    Logs each measurement (INFO) and each outlier (WARNING).

    Raises:
        OSError: this node cannot listen on ``host``.
        BackendUnavailableError, BackendClosedError: from the backend (publishing).
    """
    began, first = time.monotonic(), None
    for attempt in (1, 2):
        verdict = _Check(rdzv, result, settings, host, attempt).run()
        slowest = min(verdict.rates.items(), key=lambda item: (item[1], item[0])) if verdict.rates else (-1, 0.0)
        rtts = [link.rtt for link in verdict.links if link.rtt is not None]
        log.info("network check of round %d: n=%d, median %s (RTT %.2g ms), slowest %s at %s, %.2f s%s",
                 result.version, verdict.n, _rate_text(verdict.median),
                 1e3 * statistics.median(rtts) if rtts else math.nan, verdict.name(slowest[0]),
                 _rate_text(slowest[1]), verdict.seconds, "; measuring again" if verdict.outliers and not first else "")
        if first is not None or not verdict.outliers or not verdict.complete:
            break
        first = verdict
    slow = tuple(rank for rank in verdict.outliers if first is None or rank in first.outliers)
    verdict = replace(verdict, outliers=slow, seconds=time.monotonic() - began, attempts=1 if first is None else 2)
    for rank in verdict.outliers:
        links = ", ".join(f"{k.sender}->{k.receiver} {_rate_text(k.rate)}{' (' + k.error + ')' if k.error else ''}"
                          for k in verdict.links if rank in (k.sender, k.receiver)
                          and k.rate < verdict.median / settings.factor)
        log.warning("network check of round %d: node %s (rank %d) is slow, twice: its links' median rate %s, below "
                    "the median %s / %g; slow links: %s", result.version, verdict.name(rank), rank,
                    _rate_text(verdict.rates[rank]), _rate_text(verdict.median), settings.factor, links)
    return verdict


def checked_round(rdzv: Rendezvous, settings: NetcheckSettings, host: Callable[[], str]) -> RoundResult:
    """``rdzv.next_round()``, then, when ``settings.enabled``, the check of the round (:func:`check_round` on
    ``host()``): when it finds outliers and the round without them still has ``min_nodes`` members, each outlier
    records a ``network`` offence that quarantines it at once, and every member calls ``next_round`` again
    (the gate keeps the outliers out); the new round is checked again. At most ``max_nodes`` times per call.

    Raises:
        whatever ``next_round`` raises.
    """
    result = rdzv.next_round()
    for _ in range(rdzv.params.limit if settings.enabled else 0):
        if result.world_size < 2:
            return result
        try:
            verdict = check_round(rdzv, result, settings, host())
        except (OSError, BackendUnavailableError, BackendClosedError, RendezvousStateError) as exc:
            log.warning("network check of round %d could not run (%s): going on without it", result.version, exc)
            return result
        if not verdict.outliers:
            return result
        names = ", ".join(verdict.name(r) for r in verdict.outliers)
        if not verdict.complete:  # a member without the check: its links were not all measured, nobody is judged
            log.warning("network check of round %d: slow node(s) %s kept in: not every member takes part in the "
                        "check (set network_check alike on every node)", result.version, names)
            return result
        left = verdict.n - len(verdict.outliers)
        if left < rdzv.params.min_nodes or not rdzv.ledger.policy.enabled:
            why = f"min_nodes={rdzv.params.min_nodes}" if left < rdzv.params.min_nodes else "quarantine_after=0"
            log.warning("network check of round %d: slow node %s kept in (%s): the round goes on at its pace",
                        result.version, names, why)
            return result
        if result.rank in verdict.outliers:
            detail = (f"round {result.version}: its links' median rate {_rate_text(verdict.rates[result.rank])}, "
                      f"below the round's median {_rate_text(verdict.median)} / {settings.factor:g}")
            try:
                rdzv.ledger.offend(rdzv.node_name, "network", detail, quarantine_now=True)
            except (BackendUnavailableError, BackendClosedError, RendezvousStateError) as exc:
                log.warning("network check: could not record this node's offence: %s", exc)
            log.warning("network check of round %d: this node (%s) is slow and leaves the round", result.version,
                        rdzv.node_name)
        else:
            log.info("network check of round %d: re-forming without %s (%d nodes left)", result.version, names, left)
        result = rdzv.next_round()
    return result
