"""torchrun's static rendezvous for ``rdzv-run --rdzv-backend static`` (``--node-rank``, ``--master-*``).

No backend and no rounds: every node is told its rank (``--node-rank``) and the
number of nodes (``--nnodes``). Node rank 0's agent serves a c10d ``TCPStore``
at ``--master-addr:--master-port``; the others connect to it. The constructor
of the store is the barrier: node rank 0 waits until every node's agent has
connected, at most ``timeout`` seconds. The workers get that store's address as
``MASTER_ADDR``/``MASTER_PORT`` and reuse it (``use_agent_store``).

This is torch's own :class:`StaticTCPRendezvous`; the subclass only turns the
store's errors into torch's rendezvous errors, so the launcher reports them
(exit status 1) instead of crashing: a store that cannot listen (port taken)
or connect -> ``RendezvousConnectionError``; nodes missing at the deadline ->
``RendezvousTimeoutError``.

As in torchrun, nodes cannot join or leave; a restart (``--max-restarts``)
restarts this node's workers only, so it helps only if every node restarts.
"""

from __future__ import annotations

from torch.distributed import DistError, DistStoreError
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from .config import StaticRendezvous

__all__ = ["StaticHandler", "create_static_handler"]


class StaticHandler(StaticTCPRendezvous):
    """torch's :class:`StaticTCPRendezvous` with its store errors mapped to rendezvous errors."""

    def next_rendezvous(self) -> RendezvousInfo:
        """Create (node rank 0) or connect to the TCP store; return ranks and the store.

        Raises:
            RendezvousTimeoutError: not every node connected within the timeout.
            RendezvousConnectionError: the store could not listen or connect.
        """
        endpoint = f"{self.master_addr}:{self.master_port}"
        try:
            return super().next_rendezvous()
        except DistStoreError as exc:
            raise RendezvousTimeoutError(
                f"static rendezvous at {endpoint}: not every one of {self.world_size} nodes connected "
                f"within {self.timeout.total_seconds():g} s: {exc}"
            ) from exc
        except (DistError, RuntimeError, OSError) as exc:
            role = "listen" if self.rank == 0 else "connect"
            raise RendezvousConnectionError(f"static rendezvous: cannot {role} at {endpoint}: {exc}") from exc


def create_static_handler(config: StaticRendezvous) -> StaticHandler:
    """The handler for ``config`` (no network activity until ``next_rendezvous``)."""
    return StaticHandler(config.master_addr, config.master_port, config.node_rank, config.nnodes,
                         config.run_id, config.timeout)
