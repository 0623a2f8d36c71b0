"""A gateway transport for tests: it keeps what it was given."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor_protos.v1 import service_pb2, task_pb2


@dataclass
class RecordingTransport:
    """A :class:`~conveyor_gateway.transport.Transport` that records each call: the ids of
    each dispatch, each batch, each cancel."""

    dispatched: list[list[str]] = field(default_factory=list)
    canceled: list[tuple[str, str, str]] = field(default_factory=list)
    batches: list[service_pb2.BatchDispatch] = field(default_factory=list)

    def dispatch(self, tasks: Sequence[task_pb2.TaskEnvelope]) -> None:
        self.dispatched.append([env.id for env in tasks])

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        self.batches.append(batch)

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        self.canceled.append((task_id, lease_id, reason))
