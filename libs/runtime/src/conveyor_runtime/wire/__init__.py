"""Conversions between the protobuf messages and the broker's data model, on the server
side: one home for every proto <-> domain conversion the services make.

Call sites read ``wire.task_to_envelope(task)``, ``wire.timestamp(at)``; the modules
group them by subject:

- :mod:`~conveyor_runtime.wire.time`: Timestamp and Duration;
- :mod:`~conveyor_runtime.wire.tasks`: states, envelopes, stored and new tasks;
- :mod:`~conveyor_runtime.wire.requests`: a producer's task with the server's defaults
  and checks;
- :mod:`~conveyor_runtime.wire.events`: lifecycle events and their NATS batches;
- :mod:`~conveyor_runtime.wire.admin`: queue stats and webhook worker registrations;
- :mod:`~conveyor_runtime.wire.cron`: cron entries;
- :mod:`~conveyor_runtime.wire.limits`: rate and concurrency limits;
- :mod:`~conveyor_runtime.wire.breakers`: circuit breaker configs and open breakers;
- :mod:`~conveyor_runtime.wire.webhooks`: webhook endpoints' callbacks.

The NATS side (which message goes on which subject) is :mod:`conveyor_runtime.bus`.
"""

from __future__ import annotations

from conveyor_runtime.wire.admin import (
    DEFAULT_WEBHOOK_SPEC,
    dependency_to_proto,
    stats_to_proto,
    webhook_spec_from_proto,
    webhook_worker_to_proto,
)
from conveyor_runtime.wire.breakers import (
    breaker_config_from_proto,
    breaker_config_to_proto,
    breaker_scope_from_proto,
    breaker_scope_to_proto,
    breaker_to_proto,
)
from conveyor_runtime.wire.cron import cron_entry_to_proto, cron_spec_from_proto
from conveyor_runtime.wire.events import (
    decode_events,
    encode_events,
    event_from_proto,
    event_state_token,
    event_to_proto,
)
from conveyor_runtime.wire.groups import (
    group_config_from_proto,
    group_config_to_proto,
    group_stats_to_proto,
)
from conveyor_runtime.wire.limits import (
    concurrency_limit_from_proto,
    concurrency_limit_to_proto,
    rate_limit_from_proto,
    rate_limit_to_proto,
)
from conveyor_runtime.wire.requests import (
    DISPATCH_OVERHEAD,
    TaskDefaults,
    check_time_bounds,
    dispatch_size,
    new_task_from_request,
    state_filter,
)
from conveyor_runtime.wire.tasks import (
    TaskProtos,
    new_task_from_proto,
    new_task_to_proto,
    on_failure_from_proto,
    on_failure_to_proto,
    state_from_proto,
    state_to_proto,
    task_to_envelope,
    task_to_proto,
)
from conveyor_runtime.wire.time import (
    duration,
    from_duration,
    from_timestamp,
    set_timestamp,
    timestamp,
)
from conveyor_runtime.wire.webhooks import heartbeat_response, webhook_heartbeat, webhook_result

__all__ = [
    "DEFAULT_WEBHOOK_SPEC",
    "DISPATCH_OVERHEAD",
    "TaskDefaults",
    "TaskProtos",
    "breaker_config_from_proto",
    "breaker_config_to_proto",
    "breaker_scope_from_proto",
    "breaker_scope_to_proto",
    "breaker_to_proto",
    "check_time_bounds",
    "concurrency_limit_from_proto",
    "concurrency_limit_to_proto",
    "cron_entry_to_proto",
    "cron_spec_from_proto",
    "decode_events",
    "dependency_to_proto",
    "dispatch_size",
    "duration",
    "encode_events",
    "event_from_proto",
    "event_state_token",
    "event_to_proto",
    "from_duration",
    "from_timestamp",
    "group_config_from_proto",
    "group_config_to_proto",
    "group_stats_to_proto",
    "heartbeat_response",
    "new_task_from_proto",
    "new_task_from_request",
    "new_task_to_proto",
    "on_failure_from_proto",
    "on_failure_to_proto",
    "rate_limit_from_proto",
    "rate_limit_to_proto",
    "set_timestamp",
    "state_filter",
    "state_from_proto",
    "state_to_proto",
    "stats_to_proto",
    "task_to_envelope",
    "task_to_proto",
    "timestamp",
    "webhook_heartbeat",
    "webhook_result",
    "webhook_spec_from_proto",
    "webhook_worker_to_proto",
]
