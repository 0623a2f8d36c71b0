"""The gateways' HTTP session: guarded by the address policy, signed at the last moment,
no cookies, no pool limit."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
import pytest
from aiohttp import web
from conveyor_runtime.webhook_urls import FORBIDDEN_ADDRESS, AddressPolicy
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import LOCAL_ENDPOINTS, Delivery, Endpoint, FakeDns, rpc
from conveyor_webhook.http import forbidden, open_session, signed_by

CALL = b'{"jsonrpc": "2.0", "id": "x", "method": "conveyor.task", "params": {}}'
LOCAL = AddressPolicy.from_networks([LOCAL_ENDPOINTS])
#: Public addresses only (nothing of this machine's counts as its own here).
STRICT = AddressPolicy.from_networks([], own=())


async def test_a_request_is_signed_once_it_has_a_connection() -> None:
    async with Endpoint() as endpoint, open_session(LOCAL, limit=1) as http:
        endpoint.hold(rpc("success"))

        async def post(signer_value: str, seen: list[bool]) -> None:
            def signer() -> Mapping[str, str]:
                # Signed only once the first request gave its connection back.
                seen.append(endpoint.release.is_set())
                return {"Conveyor-Signature": signer_value, "webhook-signature": signer_value}

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
    for name in ("Conveyor-Signature", "webhook-signature"):
        assert [d.headers[name] for d in endpoint.deliveries] == ["sig-1", "sig-2"]


async def test_requests_outside_signed_by_keep_their_headers() -> None:
    async with Endpoint() as endpoint, open_session(LOCAL) as http:
        headers = {"Conveyor-Signature": "as-given"}
        async with http.post(endpoint.url, data=CALL, headers=headers) as response:
            assert response.status == 200
    assert endpoint.deliveries[0].headers["Conveyor-Signature"] == "as-given"


async def test_an_endpoints_cookies_are_not_sent_back() -> None:
    async def with_cookie(delivery: Delivery) -> web.StreamResponse:
        response = await rpc("success")(delivery)
        response.set_cookie("session", "abc")
        return response

    dns = FakeDns({"endpoint.test": [["127.0.0.1"]]})
    async with (
        Endpoint(answer=with_cookie) as endpoint,
        open_session(LOCAL, resolver=dns) as http,
    ):
        url = endpoint.url.replace("127.0.0.1", "endpoint.test")
        for _ in range(2):
            async with http.post(url, data=CALL) as response:
                assert response.cookies["session"].value == "abc"
    assert [d.headers.get("Cookie") for d in endpoint.deliveries] == [None, None]


# ------------------------------------------------------------ address guard


async def refused(http: aiohttp.ClientSession, url: str) -> None:
    """POSTing to ``url`` fails before anything is sent, for a forbidden address."""
    with pytest.raises(aiohttp.ClientError) as info:
        async with http.post(url, data=CALL):
            pass
    assert forbidden(info.value), repr(info.value)
    assert FORBIDDEN_ADDRESS in str(info.value)


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "[::1]", "[::ffff:127.0.0.1]", "10.0.0.1", "169.254.169.254", "0.0.0.0"],
)
async def test_a_literal_forbidden_address_is_refused_at_connect_time(host: str) -> None:
    async with Endpoint() as endpoint, open_session(STRICT) as http:
        port = endpoint.url.split(":")[2].split("/")[0]
        await refused(http, f"http://{host}:{port}/hook")
    assert endpoint.deliveries == []


async def test_a_name_resolving_to_loopback_is_refused_the_endpoint_sees_nothing() -> None:
    # Any forbidden address in the answer refuses the whole name (a public one first
    # included), so the policy never depends on which address would be tried first.
    dns = FakeDns({"rebound.test": [["127.0.0.1"]], "mixed.test": [["93.184.216.34", "127.0.0.1"]]})
    async with Endpoint() as endpoint, open_session(STRICT, resolver=dns) as http:
        port = endpoint.url.split(":")[2].split("/")[0]
        await refused(http, f"http://rebound.test:{port}/hook")
        await refused(http, f"http://mixed.test:{port}/hook")
        # The system resolver's localhost too.
        strict_system = open_session(STRICT)
        async with strict_system:
            await refused(strict_system, f"http://localhost:{port}/hook")
    assert endpoint.deliveries == []


async def test_the_allow_list_lets_exactly_its_networks_through() -> None:
    dns = FakeDns({"endpoint.test": [["127.0.0.1"]]})
    async with Endpoint() as endpoint, open_session(LOCAL, resolver=dns) as http:
        port = endpoint.url.split(":")[2].split("/")[0]
        async with http.post(f"http://endpoint.test:{port}/hook", data=CALL) as response:
            assert response.status == 200
        # 127.0.0.1/32 is allowed; the rest of loopback is not.
        await refused(http, f"http://127.0.0.2:{port}/hook")
    assert len(endpoint.deliveries) == 1


def test_forbidden_is_false_for_other_errors() -> None:
    assert not forbidden(aiohttp.ClientError("boom"))
    assert not forbidden(OSError("connection refused"))
