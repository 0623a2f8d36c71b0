"""The gateways' HTTP session: signed at the last moment, no cookies, no pool limit."""

from __future__ import annotations

import asyncio

from aiohttp import web
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import Delivery, Endpoint, rpc
from conveyor_webhook.http import open_session, signed_by

CALL = b'{"jsonrpc": "2.0", "id": "x", "method": "conveyor.task", "params": {}}'


async def test_a_request_is_signed_once_it_has_a_connection() -> None:
    async with Endpoint() as endpoint, open_session(limit=1) as http:
        endpoint.hold(rpc("success"))

        async def post(signer_value: str, seen: list[bool]) -> None:
            def signer() -> str:
                # Signed only once the first request gave its connection back.
                seen.append(endpoint.release.is_set())
                return signer_value

            with signed_by(signer):
                async with http.post(endpoint.url, data=CALL) as response:
                    await response.read()

        first_seen: list[bool] = []
        first = asyncio.create_task(post("sig-1", first_seen))
        await wait_until(lambda: len(endpoint.deliveries) == 1)
        second_seen: list[bool] = []
        second = asyncio.create_task(post("sig-2", second_seen))
        # The second waits for the pool's only connection, unsigned so far.
        for _ in range(20):
            await asyncio.sleep(0)
        assert second_seen == []
        endpoint.release.set()
        await asyncio.gather(first, second)

    assert (first_seen, second_seen) == ([False], [True])
    assert [d.headers["Conveyor-Signature"] for d in endpoint.deliveries] == ["sig-1", "sig-2"]


async def test_requests_outside_signed_by_keep_their_headers() -> None:
    async with Endpoint() as endpoint, open_session() as http:
        headers = {"Conveyor-Signature": "as-given"}
        async with http.post(endpoint.url, data=CALL, headers=headers) as response:
            assert response.status == 200
    assert endpoint.deliveries[0].headers["Conveyor-Signature"] == "as-given"


async def test_an_endpoints_cookies_are_not_sent_back() -> None:
    async def with_cookie(delivery: Delivery) -> web.StreamResponse:
        response = await rpc("success")(delivery)
        response.set_cookie("session", "abc")
        return response

    async with Endpoint(answer=with_cookie) as endpoint, open_session() as http:
        url = endpoint.url.replace("127.0.0.1", "localhost")
        for _ in range(2):
            async with http.post(url, data=CALL) as response:
                assert response.cookies["session"].value == "abc"
    assert [d.headers.get("Cookie") for d in endpoint.deliveries] == [None, None]
