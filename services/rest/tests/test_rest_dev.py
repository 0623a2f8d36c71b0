"""``conveyor dev`` serves the REST admin API too and prints its URL."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from conveyor_cli.dev import DevOptions, run_dev


async def test_dev_prints_and_serves_rest(capsys: pytest.CaptureFixture[str]) -> None:
    stop = asyncio.Event()
    running = asyncio.create_task(run_dev(DevOptions(port=0, rest_port=0), stop))
    try:
        url = ""
        async with asyncio.timeout(30):
            while not url:
                found = re.search(r"REST admin API: (http://\S+)", capsys.readouterr().out)
                url = found.group(1) if found else ""
                await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            made = await client.post("/v1/tasks", json={"type": "t", "queue": "dev"})
            assert made.status_code == 200, made.text
            assert (await client.get("/v1/queues")).status_code == 200
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
