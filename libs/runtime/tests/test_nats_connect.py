"""The NATS connection survives a flush that is cancelled while it waits for its PONG."""

from __future__ import annotations

import asyncio

from conveyor_runtime.nats_connect import NatsClient, close_nats, connect_nats

ROUNDS = 30


async def cancel_a_waiting_flush(nc: NatsClient) -> bool:
    """Start a flush and cancel it once it waits for the PONG; True when it got that far."""
    flush = asyncio.create_task(nc.flush())
    for _ in range(100):
        await asyncio.sleep(0)  # let the flush queue its PING (no time passes here)
        if nc._pongs:
            break
    waiting = bool(nc._pongs)
    flush.cancel()
    await asyncio.gather(flush, return_exceptions=True)
    return waiting


async def test_a_cancelled_flush_does_not_stop_the_connection_reading(nats_url: str) -> None:
    nc = await connect_nats(nats_url, name="cancelled-flush")
    try:
        cancelled = [await cancel_a_waiting_flush(nc) for _ in range(ROUNDS)]
        assert any(cancelled), "no flush was ever caught waiting for its PONG"
        # Still reading: a PONG comes back, and so does a message.
        await nc.flush(timeout=5)
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_msg(msg: object) -> None:
            if not got.done():
                got.set_result(msg.data)  # type: ignore[attr-defined]

        await nc.subscribe("cancelled-flush.echo", cb=on_msg)
        await nc.publish("cancelled-flush.echo", b"still here")
        assert await asyncio.wait_for(got, timeout=5) == b"still here"
    finally:
        await close_nats(nc, drain=False)
