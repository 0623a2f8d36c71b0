"""Cron entries on the wire: an operator's entry as the broker's spec, a stored entry as
the wire message."""

from __future__ import annotations

from dataclasses import replace

from conveyor_broker.clock import Clock
from conveyor_broker.errors import InvalidTask
from conveyor_broker.types import CronEntry, CronEntrySpec, CronMisfire
from conveyor_broker.validation import check_cron_entry, check_cron_name
from conveyor_protos.v1 import service_pb2

from conveyor_runtime.wire.requests import TaskDefaults, new_task_from_request
from conveyor_runtime.wire.tasks import new_task_to_proto
from conveyor_runtime.wire.time import set_timestamp

_MISFIRE_FROM_PROTO = {
    service_pb2.CRON_MISFIRE_UNSPECIFIED: CronMisfire.RUN_ONCE,
    service_pb2.CRON_MISFIRE_RUN_ONCE: CronMisfire.RUN_ONCE,
    service_pb2.CRON_MISFIRE_SKIP: CronMisfire.SKIP,
}
_MISFIRE_TO_PROTO = {
    CronMisfire.RUN_ONCE: service_pb2.CRON_MISFIRE_RUN_ONCE,
    CronMisfire.SKIP: service_pb2.CRON_MISFIRE_SKIP,
}


def cron_spec_from_proto(
    message: service_pb2.CronEntry, clock: Clock, defaults: TaskDefaults
) -> CronEntrySpec:
    """An operator's entry as the broker's spec, checked.

    The task template goes through the producer's checks (size limits, options this
    server does not provide yet are NotSupported), but keeps ``max_retry`` and
    ``retention`` unset when the operator left them so, so that each slot's task takes the
    server's defaults of its day. Raises InvalidTask describing the first problem.
    """
    check_cron_name(message.name)
    if message.misfire not in _MISFIRE_FROM_PROTO:
        raise InvalidTask(f"unknown misfire policy {message.misfire}")
    if not message.HasField("task"):
        raise InvalidTask("a cron entry needs a task (its queue and type at least)")
    options = message.task.options
    if options.HasField("process_in"):
        raise InvalidTask(
            "a cron entry's task may not set process_in: each slot's task is due at its slot"
        )
    template = new_task_from_request(message.task, clock, defaults)
    template = replace(
        template,
        max_retry=template.max_retry if options.HasField("max_retry") else None,
        retention=template.retention if options.HasField("retention") else None,
    )
    spec = CronEntrySpec(
        name=message.name,
        schedule=message.spec,
        task=template,
        timezone=message.timezone or "UTC",
        paused=message.paused,
        misfire=_MISFIRE_FROM_PROTO[message.misfire],
    )
    check_cron_entry(spec, max_payload=defaults.max_payload)
    return spec


def cron_entry_to_proto(entry: CronEntry) -> service_pb2.CronEntry:
    """A stored entry as the wire message."""
    message = service_pb2.CronEntry(
        name=entry.name,
        spec=entry.schedule,
        timezone=entry.timezone,
        task=new_task_to_proto(entry.task),
        paused=entry.paused,
        misfire=_MISFIRE_TO_PROTO[entry.misfire],
    )
    if entry.next_run_at is not None:
        set_timestamp(message.next_run_at, entry.next_run_at)
    if entry.last_run_at is not None:
        set_timestamp(message.last_run_at, entry.last_run_at)
    set_timestamp(message.created_at, entry.created_at)
    set_timestamp(message.updated_at, entry.updated_at)
    return message
