"""What a gateway is told: the worker it serves and the server's settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from conveyor_broker import Backoff
from conveyor_broker.clock import Clock, SystemClock


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker declared (in its Hello, or in its webhook registration)."""

    queues: Mapping[str, int]
    concurrency: int
    labels: Mapping[str, str] = field(default_factory=dict)
    worker_id: str = ""
    sdk_version: str = ""
    batch_types: tuple[str, ...] = ()
    #: Which SDK it is (Hello.sdk_name; "" for the Python SDK's older releases).
    sdk_name: str = ""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Server settings a gateway needs."""

    lease_ttl: timedelta
    register_tick: float
    max_result: int
    backoff: Backoff = field(default_factory=Backoff)
    #: How long past an attempt's timeout or deadline the worker may still report.
    timeout_grace: timedelta = timedelta(seconds=5)
    #: Wall time, for deadlines (the broker's clock in production).
    clock: Clock = field(default_factory=SystemClock)
    #: Outcomes whose commit failed and are being retried at which the gateway takes no
    #: new work, until half of them have committed (0: the worker's concurrency).
    outcome_backlog: int = 0
    #: Seconds before the first retry of an outcome whose commit failed; it doubles up to
    #: ``outcome_retry_max``.
    outcome_retry_first: float = 0.05
    outcome_retry_max: float = 1.0
    #: The holder of the gateway's leases, announced in its registrations (see
    #: :mod:`~conveyor_gateway.liveness`); "": none (its tasks come back at lease expiry
    #: if its process dies).
    holder: str = ""
