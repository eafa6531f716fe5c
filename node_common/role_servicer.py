"""`RoleServicer`: what the prefill and decode servicers both hold, and their counters.

RoleServicer(node, counters)   the node's AsyncEngine, KVTransferManager and transfer
                               timeout; `counters` feed the node's load report (NodeStats)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node_common.role_server import RoleServer


@dataclass
class NodeCounters:
    """Since the node started."""

    num_finished_requests: int = 0  # requests whose output (first token, or stream) went out
    num_queued_prefill_tokens: int = 0  # prompt tokens of prefills with no first token yet


class RoleServicer:
    """Base of a role's gRPC servicer; built by `RoleServer.make_servicer`."""

    def __init__(self, node: RoleServer, counters: NodeCounters) -> None:
        self.counters = counters
        self._engine = node.engine
        self._manager = node.manager
        # A hand-off starts with its prefill (within this) and ends within this of its start.
        self._transfer_timeout_s = node.config.transfer_timeout_s
        self._metrics = node.metrics
