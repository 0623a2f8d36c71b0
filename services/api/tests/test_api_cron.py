"""AdminService cron RPCs over a real gRPC socket: upsert, get, list, pause and resume,
delete, trigger-now, and clear errors for bad entries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from conveyor_broker import FakeClock
from conveyor_broker.cron import CRON_HEADER, CRON_SLOT_HEADER
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import Recorder, refused
from google.protobuf.duration_pb2 import Duration

START = datetime(2030, 1, 1, tzinfo=UTC)


def entry(name: str = "nightly", spec: str = "0 3 * * *", **fields: Any) -> service_pb2.CronEntry:
    fields.setdefault("task", task_pb2.NewTask(queue="reports", type="report.build"))
    return service_pb2.CronEntry(name=name, spec=spec, **fields)


async def upsert(admin: Any, message: service_pb2.CronEntry) -> service_pb2.CronEntry:
    response = await admin.UpsertCronEntry(service_pb2.UpsertCronEntryRequest(entry=message))
    result: service_pb2.CronEntry = response.entry
    return result


async def test_upsert_get_list_and_delete(admin: Any, broker: CountingBroker) -> None:
    template = task_pb2.NewTask(
        queue="reports",
        type="report.build",
        payload=b"{}",
        headers={"tenant": "acme"},
        options=task_pb2.TaskOptions(max_retry=2, timeout=Duration(seconds=90)),
    )
    created = await upsert(
        admin,
        entry(
            timezone="Europe/Paris",
            task=template,
            misfire=service_pb2.CRON_MISFIRE_SKIP,
        ),
    )
    assert created.name == "nightly"
    assert created.spec == "0 3 * * *"
    assert created.timezone == "Europe/Paris"
    assert created.misfire == service_pb2.CRON_MISFIRE_SKIP
    assert wire.from_timestamp(created.next_run_at) == START.replace(hour=2)
    assert not created.HasField("last_run_at")
    assert created.task.payload == b"{}"
    assert dict(created.task.headers) == {"tenant": "acme"}
    assert created.task.options.max_retry == 2
    assert created.task.options.timeout.seconds == 90
    # Unset options stay unset: each slot's task takes the server's defaults.
    assert not created.task.options.HasField("retention")

    got = await admin.GetCronEntry(service_pb2.GetCronEntryRequest(name="nightly"))
    assert got.entry == created
    await upsert(admin, entry("hourly", "@hourly"))
    listed = await admin.ListCronEntries(service_pb2.ListCronEntriesRequest())
    assert [e.name for e in listed.entries] == ["hourly", "nightly"]
    stored = await broker.get_cron_entry("hourly")
    assert stored.task.max_retry is None
    assert stored.misfire.value == "run_once"

    await admin.DeleteCronEntry(service_pb2.DeleteCronEntryRequest(name="hourly"))
    listed = await admin.ListCronEntries(service_pb2.ListCronEntriesRequest())
    assert [e.name for e in listed.entries] == ["nightly"]
    code, details = await refused(
        admin.GetCronEntry, service_pb2.GetCronEntryRequest(name="hourly")
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert "hourly" in details


async def test_pause_and_resume(admin: Any, clock: FakeClock) -> None:
    await upsert(admin, entry(spec="*/10 * * * *"))
    clock.advance(timedelta(minutes=25))
    paused = await admin.SetCronPaused(
        service_pb2.SetCronPausedRequest(name="nightly", paused=True)
    )
    assert paused.entry.paused
    assert not paused.entry.HasField("next_run_at")
    resumed = await admin.SetCronPaused(
        service_pb2.SetCronPausedRequest(name="nightly", paused=False)
    )
    assert not resumed.entry.paused
    assert wire.from_timestamp(resumed.entry.next_run_at) == START + timedelta(minutes=30)
    code, _ = await refused(
        admin.SetCronPaused, service_pb2.SetCronPausedRequest(name="missing", paused=True)
    )
    assert code == grpc.StatusCode.NOT_FOUND


async def test_trigger_enqueues_now_and_wakes_the_queue(
    admin: Any, bus: Bus, broker: CountingBroker
) -> None:
    wakes = await Recorder(cluster_pb2.Wake).start(bus, queue="reports")
    await upsert(admin, entry(paused=True))
    response = await admin.TriggerCronEntry(service_pb2.TriggerCronEntryRequest(name="nightly"))
    task = response.task
    assert task.state == task_pb2.TASK_STATE_PENDING
    assert (task.queue, task.type) == ("reports", "report.build")
    assert dict(task.headers) == {CRON_HEADER: "nightly", CRON_SLOT_HEADER: "manual"}
    assert (await broker.get_task(task.id)).queue == "reports"
    await wakes.wait_for()
    assert (await broker.get_cron_entry("nightly")).paused
    code, _ = await refused(
        admin.TriggerCronEntry, service_pb2.TriggerCronEntryRequest(name="missing")
    )
    assert code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("message", "code", "words"),
    [
        (entry(spec="0 0 31 2 *"), grpc.StatusCode.INVALID_ARGUMENT, "never fires"),
        (entry(spec="0 3 * *"), grpc.StatusCode.INVALID_ARGUMENT, "4 fields"),
        (entry(spec="61 3 * * *"), grpc.StatusCode.INVALID_ARGUMENT, "invalid cron schedule"),
        (entry(spec=""), grpc.StatusCode.INVALID_ARGUMENT, "may not be empty"),
        (entry(timezone="Mars/Base"), grpc.StatusCode.INVALID_ARGUMENT, "unknown time zone"),
        (entry(name="no spaces"), grpc.StatusCode.INVALID_ARGUMENT, "invalid cron entry name"),
        (
            service_pb2.CronEntry(name="nightly", spec="@daily"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "needs a task",
        ),
        (entry(misfire=7), grpc.StatusCode.INVALID_ARGUMENT, "misfire"),
        (
            entry(task=task_pb2.NewTask(queue="a.b", type="t")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid queue name",
        ),
        (
            entry(
                task=task_pb2.NewTask(
                    queue="q", type="t", options=task_pb2.TaskOptions(unique_key="k")
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unique key",
        ),
        (
            entry(
                task=task_pb2.NewTask(
                    queue="q",
                    type="t",
                    options=task_pb2.TaskOptions(process_in=Duration(seconds=5)),
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "process_in",
        ),
        (
            entry(task=task_pb2.NewTask(queue="q", type="t", headers={CRON_HEADER: "x"})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "set by the server",
        ),
        # A task template is checked as any task is.
        (
            entry(
                task=task_pb2.NewTask(
                    queue="q",
                    type="t",
                    options=task_pb2.TaskOptions(group="g", concurrency_key="k"),
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "concurrency_key",
        ),
    ],
    ids=[
        "never-fires",
        "four-fields",
        "bad-minute",
        "empty-spec",
        "zone",
        "name",
        "no-task",
        "misfire",
        "queue",
        "unique-key",
        "process-in",
        "reserved-header",
        "group",
    ],
)
async def test_bad_entries_are_refused_clearly_and_nothing_is_stored(
    admin: Any,
    broker: CountingBroker,
    message: service_pb2.CronEntry,
    code: grpc.StatusCode,
    words: str,
) -> None:
    got, details = await refused(
        admin.UpsertCronEntry, service_pb2.UpsertCronEntryRequest(entry=message)
    )
    assert got == code, details
    assert words in details
    assert await broker.list_cron_entries() == []


async def test_no_entry_is_invalid_argument(admin: Any) -> None:
    code, details = await refused(admin.UpsertCronEntry, service_pb2.UpsertCronEntryRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "entry is required" in details
