"""wait_until and its blocking twin: sync and async conditions, and a timeout that names
what was awaited."""

from __future__ import annotations

import asyncio
import time

import pytest
from conveyor_testkit.polling import wait_until, wait_until_blocking


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


def test_blocking_returns_once_the_condition_holds() -> None:
    calls = 0

    def third_time() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    wait_until_blocking(third_time, interval=0)
    assert calls == 3


def test_blocking_looks_once_before_any_timeout() -> None:
    calls = 0

    def holds() -> bool:
        nonlocal calls
        calls += 1
        return True

    wait_until_blocking(holds, within=0)
    assert calls == 1


def test_blocking_times_out_naming_the_condition_not_before_its_time() -> None:
    calls = 0

    def never() -> bool:
        nonlocal calls
        calls += 1
        return False

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^the moon not met within 0.05s$"):
        wait_until_blocking(never, within=0.05, message="the moon")
    assert time.monotonic() - started >= 0.05
    assert calls >= 2  # checked again after sleeping, not given up after the first look


def test_blocking_lets_a_timeout_error_of_the_condition_itself_through() -> None:
    def broken() -> bool:
        raise TimeoutError("the condition's own")

    with pytest.raises(TimeoutError, match="the condition's own"):
        wait_until_blocking(broken, within=5)
