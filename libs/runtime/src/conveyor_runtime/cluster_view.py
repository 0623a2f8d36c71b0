"""How a service process describes itself for the cluster view (``GetClusterInfo``).

Every service component (the api server, a dispatcher, maintenance, the webhook manager)
answers the ``<prefix>.cluster.nodes`` request (see :meth:`conveyor_runtime.bus.Bus.gather_nodes`)
with a ``ClusterNode``: :class:`NodeCard` fills the fields every process has (instance,
kind, version, host, pid, start time) and the component adds what only it knows (its
worker sessions, owned queues, leader roles or webhook gateways). The view is what each
process says about itself, asked over NATS at the moment of the call: a process that is
dead or cut off is absent rather than shown stale.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata

from conveyor_protos.v1 import service_pb2
from nats.aio.subscription import Subscription

from conveyor_runtime import wire
from conveyor_runtime.bus import Bus

logger = logging.getLogger(__name__)


def _version(kind: str) -> str:
    try:
        return metadata.version(f"conveyor-{kind}")
    except metadata.PackageNotFoundError:
        return ""


class NodeCard:
    """Answers the cluster view's requests for one component of this process.

    ``fill`` adds the component's own fields to the node it is given (it runs inline on
    the NATS callback: keep it to reading in-memory state).
    """

    __slots__ = ("_base", "_bus", "_fill", "_sub")

    def __init__(
        self,
        bus: Bus,
        *,
        kind: str,
        instance: str,
        fill: Callable[[service_pb2.ClusterNode], None],
    ) -> None:
        self._bus = bus
        self._fill = fill
        self._sub: Subscription | None = None
        self._base = service_pb2.ClusterNode(
            instance=instance,
            kind=kind,
            version=_version(kind),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=wire.timestamp(datetime.now(UTC)),
        )

    def describe(self) -> service_pb2.ClusterNode:
        """The node as it is now."""
        node = service_pb2.ClusterNode()
        node.CopyFrom(self._base)
        self._fill(node)
        return node

    async def start(self) -> None:
        """Answer the cluster view's requests from now on."""
        if self._sub is None:
            self._sub = await self._bus.serve_nodes(self.describe)

    async def stop(self) -> None:
        """Stop answering (a stopped component leaves the view)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may be gone already
                logger.debug("cluster_view.unsubscribe_failed error=%r", exc)


def merge_nodes(
    nodes: list[service_pb2.ClusterNode], response: service_pb2.GetClusterInfoResponse
) -> None:
    """Fill ``response``'s cluster-wide fields from the nodes that answered: every node
    (sorted by kind, then instance), their sessions, queue owners, leaders and webhook
    gateways."""
    for node in sorted(nodes, key=lambda n: (n.kind, n.instance, n.pid)):
        response.nodes.append(node)
        response.sessions.extend(node.sessions)
        for queue in node.owned_queues:
            response.queue_owners[queue] = node.instance
        for role in node.leader_roles:
            response.leaders[role] = node.instance
        response.webhook_gateways.extend(node.webhook_gateways)
