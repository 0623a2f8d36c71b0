"""Aggregation group configs and stats through the SDK's admin clients against a real
`conveyor dev` process: set, list, delete, stats, and clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from conveyor import (
    AdminClient,
    AsyncAdminClient,
    Client,
    GroupConfigNotFound,
    InvalidArgument,
)

from tests.e2e.harness import dev_server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with dev_server(tmp_path_factory.mktemp("dev-groups-sdk") / "dev.log") as address:
        yield address


def test_set_list_and_delete(target: str) -> None:
    with AdminClient(target) as admin:
        stored = admin.set_group_config(
            "sdk-digests", pattern="user:*", max_size=25, max_delay=60, grace_period=5
        )
        assert stored.queue == "sdk-digests"
        assert stored.pattern == "user:*"
        assert stored.max_size == 25
        assert stored.max_delay == timedelta(seconds=60)
        assert stored.grace_period == timedelta(seconds=5)
        default = admin.set_group_config("sdk-digests")
        assert default.pattern == "*"
        assert default.max_size > 0
        listed = admin.list_group_configs("sdk-digests")
        assert [c.pattern for c in listed] == ["*", "user:*"]
        assert stored in listed
        admin.delete_group_config("sdk-digests", "user:*")
        admin.delete_group_config("sdk-digests")
        assert admin.list_group_configs("sdk-digests") == []
        with pytest.raises(GroupConfigNotFound) as info:
            admin.delete_group_config("sdk-digests", "nope*")
        assert (info.value.queue, info.value.pattern) == ("sdk-digests", "nope*")


def test_bad_input(target: str) -> None:
    with AdminClient(target) as admin:
        with pytest.raises(InvalidArgument):
            admin.set_group_config("a b")
        with pytest.raises(InvalidArgument, match="max_size"):
            admin.set_group_config("sdk-digests", max_size=0)
        with pytest.raises(InvalidArgument):
            admin.set_group_config("sdk-digests", max_delay=-1)
        with pytest.raises(InvalidArgument, match="limit"):
            admin.group_stats(limit=0)


def test_a_grouped_task_waits_in_its_group(target: str) -> None:
    with Client(target) as client:
        first = client.enqueue("digest", {"n": 1}, queue="sdk-digests", group="user:1")
        client.enqueue("digest", {"n": 2}, queue="sdk-digests", group="user:1")
        assert client.get_task(first.id).state == "aggregating"
    with AdminClient(target) as admin:
        (stats,) = admin.group_stats("sdk-digests")
        assert (stats.group, stats.size) == ("user:1", 2)


async def test_the_async_client_sees_the_same(target: str) -> None:
    async with AsyncAdminClient(target) as admin:
        stored = await admin.set_group_config("sdk-async", max_size=3)
        assert await admin.list_group_configs("sdk-async") == [stored]
        assert await admin.group_stats("sdk-async") == []
        await admin.delete_group_config("sdk-async")
