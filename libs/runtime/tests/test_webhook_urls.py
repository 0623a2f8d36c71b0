"""The webhook address policy and the registration-time URL check (pure, with a fake
resolver: no DNS)."""

from __future__ import annotations

import ipaddress

import pytest
from conveyor_broker.errors import InvalidTask
from conveyor_runtime.webhook_urls import (
    AddressPolicy,
    UrlGuard,
    local_addresses,
    non_public,
    parse_networks,
)

PUBLIC = AddressPolicy.from_networks([], own=())

REFUSED = {
    "127.0.0.1": "a loopback address",
    "127.255.0.9": "a loopback address",
    "::1": "a loopback address",
    "10.0.0.1": "a private address",
    "172.16.5.4": "a private address",
    "192.168.1.1": "a private address",
    "fc00::1": "a private address",
    "fd12:3456::1": "a private address",
    "169.254.169.254": "a link-local address",
    "fe80::1": "a link-local address",
    "fe80::1%eth0": "a link-local address",
    "0.0.0.0": "an unspecified address",
    "::": "an unspecified address",
    "224.0.0.1": "a multicast address",
    "224.0.1.1": "a multicast address",
    "ff02::1": "a multicast address",
    "240.0.0.1": "a private address",  # reserved (Python counts it private)
    "100.64.0.1": "a non-global address",  # shared (carrier-grade NAT)
    "::ffff:127.0.0.1": "a loopback address in an IPv6 form",
    "::ffff:169.254.169.254": "a link-local address in an IPv6 form",
    "::ffff:10.0.0.1": "a private address in an IPv6 form",
    "64:ff9b::7f00:1": "a loopback address in an IPv6 form",
    "2002:7f00:1::": "a loopback address in an IPv6 form",
    "fec0::1": "a site-local address",
    "not an address": "not an IP address",
}


@pytest.mark.parametrize(("address", "reason"), sorted(REFUSED.items()))
def test_non_public_addresses_are_refused_with_their_kind(address: str, reason: str) -> None:
    assert PUBLIC.refusal(address) == reason
    assert not PUBLIC.permits(address)


@pytest.mark.parametrize(
    "address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_are_allowed(address: str) -> None:
    assert PUBLIC.refusal(address) is None
    assert non_public(ipaddress.ip_address(address)) is None


def test_the_allow_list_lets_its_networks_through_mapped_forms_included() -> None:
    policy = AddressPolicy.from_networks(["10.1.0.0/16", "127.0.0.1/32", "fd00::/8"], own=())
    for address in ("10.1.2.3", "127.0.0.1", "::ffff:127.0.0.1", "fd00::5"):
        assert policy.permits(address), address
    for address in ("10.2.0.1", "127.0.0.2", "::1", "169.254.169.254"):
        assert not policy.permits(address), address


def test_this_machines_own_addresses_are_refused_unless_allowed() -> None:
    own = ipaddress.ip_address("93.184.216.34")
    policy = AddressPolicy.from_networks([], own=[own])
    assert policy.refusal("93.184.216.34") == "an address of this server"
    assert policy.refusal("::ffff:93.184.216.34") == "an address of this server"
    assert AddressPolicy.from_networks(["93.184.216.34/32"], own=[own]).permits("93.184.216.34")
    # What the machine finds of its own includes loopback at least.
    assert ipaddress.ip_address("127.0.0.1") in local_addresses()


def test_networks_parse_strictly_with_a_clear_error() -> None:
    assert [str(n) for n in parse_networks([" 10.1.0.0/16", "127.0.0.1"])] == [
        "10.1.0.0/16",
        "127.0.0.1/32",
    ]
    with pytest.raises(ValueError, match=r"'10\.1\.0\.1/16' is not a network"):
        parse_networks(["10.1.0.1/16"])
    with pytest.raises(ValueError, match="'localhost' is not a network"):
        parse_networks(["localhost"])


class Dns:
    """Answers from a table; any other name fails like an unknown one."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if host not in self.table:
            raise OSError(f"{host} does not resolve")
        return self.table[host]


async def test_registration_refuses_literal_and_resolved_forbidden_addresses() -> None:
    dns = Dns({"rebind.test": ["127.0.0.1"], "mixed.test": ["8.8.8.8", "10.0.0.7"]})
    guard = UrlGuard(PUBLIC, dns)
    cases = {
        "http://127.0.0.1:5432/": "points at a loopback address",
        "http://[::1]/": "points at a loopback address",
        "http://[::ffff:127.0.0.1]/": "points at a loopback address in an IPv6 form",
        "https://169.254.169.254/latest": "points at a link-local address",
        "https://rebind.test/hook": "host 'rebind.test' resolves to a loopback address",
        "https://mixed.test:8443/hook": "host 'mixed.test' resolves to a private address",
    }
    for url, message in cases.items():
        with pytest.raises(InvalidTask, match=message) as info:
            await guard.check(url)
        assert "CONVEYOR_WEBHOOK_ALLOW_NETWORKS" in str(info.value)
    # The port a name is resolved for is the URL's, or the scheme's default.
    assert ("mixed.test", 8443) in dns.asked
    await guard.check("https://nowhere.test/")  # unresolvable now: checked at delivery
    assert ("nowhere.test", 443) in dns.asked
    await guard.check("http://8.8.8.8/hook")


async def test_a_slow_resolver_lets_the_url_through_to_the_delivery_check() -> None:
    import asyncio

    async def hangs(host: str, port: int) -> list[str]:
        await asyncio.Event().wait()
        return []

    await UrlGuard(PUBLIC, hangs, timeout=0.01).check("https://slow.test/")
