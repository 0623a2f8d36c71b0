"""How a gateway reaches its worker: a gRPC stream (the api's sessions) or HTTP (the
webhook service's deliveries).

A transport is called from synchronous code only, and must not block: it queues or starts
the work and returns. The worker's answers come back the other way, through the gateway's
``on_*`` methods (and :meth:`~conveyor_gateway.gateway.Gateway.resolve`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from conveyor_protos.v1 import service_pb2, task_pb2


class Transport(Protocol):
    """What a gateway sends its worker."""

    def dispatch(self, tasks: Sequence[task_pb2.TaskEnvelope]) -> None:
        """Deliver ``tasks``, the ones the gateway accepted from one dispatch offer, in
        order; the gateway holds each one already."""

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        """Deliver one aggregation group's batch (its queue, group, type and member
        envelopes, every one under the batch's one lease id); the gateway holds it already,
        as one delivery taking one slot. The answer comes back through
        :meth:`~conveyor_gateway.gateway.Gateway.on_batch_result`."""

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        """Tell the worker to stop working on ``task_id`` under ``lease_id`` (the gateway
        holds it no more: the lease was lost, the attempt overran its bound, the task was
        canceled or delivered again). For a batch, ``lease_id`` is the batch's and
        ``task_id`` one of its members: the whole batch stops."""
