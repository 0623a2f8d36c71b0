"""wait_until: sync and async conditions, and a timeout that names what was awaited."""

from __future__ import annotations

import asyncio

import pytest
from conveyor_testkit.polling import wait_until


async def test_returns_once_a_sync_condition_holds() -> None:
    calls = 0

    def third_time() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    await wait_until(third_time, interval=0)
    assert calls == 3


async def test_awaits_an_async_condition() -> None:
    flag = asyncio.Event()

    async def is_set() -> bool:
        return flag.is_set()

    asyncio.get_running_loop().call_soon(flag.set)
    await wait_until(is_set)
    assert flag.is_set()


async def test_times_out_naming_the_condition() -> None:
    with pytest.raises(TimeoutError, match=r"^the moon not met within 0.05s$"):
        await wait_until(lambda: False, within=0.05, message="the moon")


async def test_an_async_condition_that_hangs_times_out_too() -> None:
    async def never() -> bool:
        await asyncio.Event().wait()
        return True

    with pytest.raises(TimeoutError, match="condition not met"):
        await wait_until(never, within=0.05)


async def test_a_timeout_error_of_the_condition_itself_is_not_relabelled() -> None:
    def broken() -> bool:
        raise TimeoutError("the condition's own")

    with pytest.raises(TimeoutError, match="the condition's own"):
        await wait_until(broken, within=5)
