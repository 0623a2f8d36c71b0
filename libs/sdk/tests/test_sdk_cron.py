"""Cron entries through the SDK's admin clients against a real `conveyor dev` process
(whose scheduler fires them): declare and apply, read back, pause and resume, trigger,
delete, errors, and an entry that fires on its own."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from conveyor import (
    AdminClient,
    AsyncAdminClient,
    CronEntryNotFound,
    CronMisfire,
    InvalidArgument,
    TaskState,
    cron,
    spec,
)
from conveyor_testkit.polling import wait_until, wait_until_blocking

from tests.e2e.harness import dev_server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with dev_server(tmp_path_factory.mktemp("dev-cron-sdk") / "dev.log") as address:
        yield address


def test_declare_apply_read_back_and_apply_again(target: str) -> None:
    declared = [
        cron(
            "sdk-nightly",
            "30 2 * * *",
            "report.build",
            {"kind": "daily", "n": 1},
            queue="sdk-reports",
            timezone="America/New_York",
            misfire="skip",
            headers={"tenant": "acme"},
            max_retry=3,
            timeout=60,
        ),
        cron("sdk-hourly", "@hourly", "cleanup", queue="sdk-reports"),
    ]
    with AdminClient(target) as admin:
        first = admin.apply_cron_entries(declared)
        assert [e.name for e in first] == ["sdk-nightly", "sdk-hourly"]
        nightly = first[0]
        assert nightly.schedule == "30 2 * * *"
        assert nightly.timezone == "America/New_York"
        assert nightly.misfire is CronMisfire.SKIP
        assert nightly.task.payload == {"kind": "daily", "n": 1}
        assert nightly.task.queue == "sdk-reports"
        assert dict(nightly.task.headers) == {"tenant": "acme"}
        assert nightly.task.options.max_retry == 3
        assert nightly.task.options.timeout == timedelta(seconds=60)
        assert nightly.next_run_at is not None
        assert nightly.last_run_at is None
        # Applied again (an application's next start): the same next runs.
        again = admin.apply_cron_entries(declared)
        assert [e.next_run_at for e in again] == [e.next_run_at for e in first]
        assert admin.get_cron_entry("sdk-nightly") == again[0]
        assert nightly.spec() == declared[0]
        names = [e.name for e in admin.list_cron_entries()]
        assert {"sdk-hourly", "sdk-nightly"} <= set(names)
        assert names == sorted(names)


async def test_pause_resume_trigger_and_delete(target: str) -> None:
    async with AsyncAdminClient(target) as admin:
        await admin.upsert_cron_entry(
            "sdk-weekly", "0 9 * * MON", spec("digest", {"a": 1}, queue="sdk-none")
        )
        paused = await admin.pause_cron_entry("sdk-weekly")
        assert paused.paused
        assert paused.next_run_at is None
        task = await admin.trigger_cron_entry("sdk-weekly")
        assert task.type == "digest"
        assert task.payload == {"a": 1}
        assert task.headers["conveyor-cron"] == "sdk-weekly"
        assert task.headers["conveyor-cron-slot"] == "manual"
        resumed = await admin.resume_cron_entry("sdk-weekly")
        assert not resumed.paused
        assert resumed.next_run_at is not None
        await admin.delete_cron_entry("sdk-weekly")
        with pytest.raises(CronEntryNotFound) as info:
            await admin.get_cron_entry("sdk-weekly")
        assert info.value.name == "sdk-weekly"
        with pytest.raises(CronEntryNotFound):
            await admin.trigger_cron_entry("sdk-weekly")


def test_errors_are_clear(target: str) -> None:
    with AdminClient(target) as admin:
        with pytest.raises(InvalidArgument, match="never fires"):
            admin.upsert_cron_entry("sdk-never", "0 0 31 2 *", spec("t"))
        with pytest.raises(InvalidArgument, match="unknown time zone"):
            admin.upsert_cron_entry("sdk-zone", "@daily", spec("t"), timezone="Nowhere/City")
        with pytest.raises(InvalidArgument, match="unique key"):
            admin.upsert_cron_entry("sdk-key", "@daily", spec("t", unique_key="k"))
        with pytest.raises(InvalidArgument, match="concurrency_key"):
            admin.upsert_cron_entry(
                "sdk-group", "@daily", spec("t", group="g", concurrency_key="k")
            )
        with pytest.raises(InvalidArgument, match="unique"):
            admin.apply_cron_entries([cron("dup", "@daily", "t"), cron("dup", "@hourly", "t")])
    with pytest.raises(InvalidArgument, match="misfire"):
        cron("x", "@daily", "t", misfire="sometimes")
    with AdminClient(target) as admin, pytest.raises(InvalidArgument, match="misfire"):
        admin.upsert_cron_entry("x", "@daily", spec("t"), misfire="sometimes")


def test_an_entry_fires_on_its_own(target: str) -> None:
    with AdminClient(target) as admin:
        admin.upsert_cron_entry("sdk-every", "@every 1s", spec("tick", queue="sdk-ticks"))

        def fired() -> bool:
            page = admin.list_tasks(queue="sdk-ticks")
            return len(page.tasks) >= 2

        wait_until_blocking(fired, within=60, message="two slots fired")
        admin.pause_cron_entry("sdk-every")
        tasks = admin.list_tasks(queue="sdk-ticks").tasks
        slots = [t.headers["conveyor-cron-slot"] for t in tasks]
        assert len(slots) == len(set(slots))
        assert all(t.state is TaskState.PENDING for t in tasks)
        entry = admin.get_cron_entry("sdk-every")
        assert entry.last_run_at is not None


async def test_the_async_client_sees_the_same(target: str) -> None:
    async with AsyncAdminClient(target) as admin:
        await admin.apply_cron_entries([cron("sdk-async", "*/5 * * * *", "t")])

        async def listed() -> bool:
            return "sdk-async" in [e.name for e in await admin.list_cron_entries()]

        await wait_until(listed, within=30)
