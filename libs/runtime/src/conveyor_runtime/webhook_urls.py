"""Where webhook deliveries may go: the address policy both the api (at registration) and
the webhook service (at every connection) apply.

A webhook URL is chosen by whoever holds an admin token, and the server then connects to
it and reports what happened (``last_error``). Without a policy that makes the server a
port scanner and a proxy into its own network: ``http://127.0.0.1:5432/``, the cloud
metadata service at ``169.254.169.254``, private ranges. So a delivery may only connect to
a *public* address: never loopback, link-local (metadata services included), private
(RFC 1918, unique-local ``fc00::/7``), shared (``100.64.0.0/10``), unspecified,
multicast, reserved or otherwise non-global ranges, the IPv4 address inside an IPv6 form
(IPv4-mapped ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``, 6to4, Teredo) of any of those, nor
one of this machine's own addresses, unless an operator lists it in the allow-list
(``CONVEYOR_WEBHOOK_ALLOW_NETWORKS``).

The api refuses such a URL at registration (a literal address, or a name that resolves to
one), and the webhook service checks again at delivery, after resolution, on the address
it connects to (:mod:`conveyor_webhook.http`), so a name that resolves elsewhere later
(DNS rebinding) gains nothing.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

from conveyor_broker.errors import InvalidTask

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The ``last_error`` of a delivery the policy refused: the same text whatever the
#: address was and whatever listens there, so it tells nothing about the network.
FORBIDDEN_ADDRESS = "webhook URL resolves to a forbidden address"
#: The setting that allows more networks, as operators write it.
ALLOW_SETTING = "CONVEYOR_WEBHOOK_ALLOW_NETWORKS"
#: What ``conveyor dev`` allows by default: endpoints on the developer's own machine.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")
#: Seconds a registration waits for its URL's host to resolve.
RESOLVE_TIMEOUT = 5.0
#: NAT64's well-known prefix: the last 32 bits are an IPv4 address.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class ForbiddenAddress(OSError):
    """A connection to an address the policy refuses (an OSError, so that HTTP clients
    treat it as the connection failure it is)."""

    def __init__(self) -> None:
        super().__init__(errno.EACCES, FORBIDDEN_ADDRESS)


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """The networks ``values`` name (``10.1.0.0/16``, ``127.0.0.1``, ``fd00::/8``).
    Raises ValueError naming the first that is not a network (host bits set included:
    ``10.1.0.1/16`` is more likely a typo than a wish)."""
    networks: list[IPNetwork] = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=True))
        except ValueError as exc:
            raise ValueError(
                f"{value.strip()!r} is not a network (like 10.1.0.0/16): {exc}"
            ) from None
    return tuple(networks)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, NAT64, 6to4, Teredo), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


def non_public(address: IPAddress) -> str | None:
    """What kind of non-public address ``address`` is ("a loopback address", "a private
    address", ...), or None for a public one."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:
            kind = non_public(inner)
            if kind is not None:
                return f"{kind} in an IPv6 form"
            if address.ipv4_mapped is not None:
                return None  # ::ffff:a.b.c.d is a.b.c.d itself, which is public
        if address.is_site_local:
            return "a site-local address"
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("non-global", not address.is_global),
    )
    kind = next((kind for kind, hit in checks if hit), None)
    if kind is None:
        return None
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} address"


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """Which addresses webhook deliveries may connect to: public ones that are not this
    machine's (``own``), plus whatever ``allow`` lists."""

    allow: tuple[IPNetwork, ...] = ()
    own: frozenset[IPAddress] = frozenset()

    @classmethod
    def from_networks(
        cls, allow: Iterable[str], *, own: Iterable[IPAddress] | None = None
    ) -> AddressPolicy:
        """The policy allowing ``allow`` (network texts) beyond public addresses; ``own``
        defaults to this machine's addresses (:func:`local_addresses`)."""
        return cls(
            allow=parse_networks(allow),
            own=frozenset(local_addresses() if own is None else own),
        )

    def _allowed(self, address: IPAddress) -> bool:
        candidates: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            candidates.append(address.ipv4_mapped)
        return any(
            candidate.version == network.version and candidate in network
            for candidate in candidates
            for network in self.allow
        )

    def refusal(self, address: str | IPAddress) -> str | None:
        """Why a delivery may not connect to ``address`` ("a loopback address", ...), or
        None when it may. Text that is not an address is refused too."""
        try:
            ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        except ValueError:
            return "not an IP address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            ip = ipaddress.IPv6Address(str(ip).partition("%")[0])
        if self._allowed(ip):
            return None
        kind = non_public(ip)
        if kind is not None:
            return kind
        inner = _embedded_ipv4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
        if ip in self.own or (inner is not None and inner in self.own):
            return "an address of this server"
        return None

    def permits(self, address: str | IPAddress) -> bool:
        """True when a delivery may connect to ``address``."""
        return self.refusal(address) is None


#: Resolves a host and port to the addresses a connection would try (as text).
Resolve = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses of ``host`` as the system resolver gives them (getaddrinfo)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [str(info[4][0]) for info in infos]


class UrlGuard:
    """The registration-time check of a webhook URL (the api's AdminService runs it on
    every upsert): a literal address the policy refuses, or a host name any of whose
    addresses it refuses, is INVALID_ARGUMENT (InvalidTask) with the reason.

    A name that does not resolve now (or not within :data:`RESOLVE_TIMEOUT`) is let
    through: DNS may not know it yet, and the webhook service checks the addresses it
    connects to at every delivery anyway.
    """

    def __init__(
        self,
        policy: AddressPolicy,
        resolve: Resolve = system_resolve,
        timeout: float = RESOLVE_TIMEOUT,
    ) -> None:
        self.policy = policy
        self._resolve = resolve
        self._timeout = timeout

    async def check(self, url: str) -> None:
        """Raise InvalidTask unless deliveries to ``url`` may connect where it points
        (as of now). ``url`` has passed the broker's syntax checks."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        hint = (
            "webhook endpoints must be on public addresses (an operator may allow a "
            f"network with {ALLOW_SETTING})"
        )
        try:
            literal: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            reason = self.policy.refusal(literal)
            if reason is not None:
                raise InvalidTask(f"webhook url {url!r} points at {reason}: {hint}")
            return
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            async with asyncio.timeout(self._timeout):
                addresses = await self._resolve(host, port)
        except (OSError, TimeoutError) as exc:
            logger.info("webhook.url_unresolved host=%s error=%r", host, exc)
            return
        for address in addresses:
            reason = self.policy.refusal(address)
            if reason is not None:
                raise InvalidTask(f"webhook url host {host!r} resolves to {reason}: {hint}")


# ------------------------------------------------------------ own addresses

#: ioctl that reads an interface's IPv4 address (Linux).
_SIOCGIFADDR = 0x8915


def _interface_ipv4() -> set[IPAddress]:
    found: set[IPAddress] = set()
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue  # no IPv4 address on it
            found.add(ipaddress.IPv4Address(packed[20:24]))
    return found


def _interface_ipv6() -> set[IPAddress]:
    found: set[IPAddress] = set()
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if fields and len(fields[0]) == 32:
            found.add(ipaddress.IPv6Address(int(fields[0], 16)))
    return found


@cache
def local_addresses() -> frozenset[IPAddress]:
    """This machine's own addresses, as far as it can tell (its interfaces' on Linux,
    and what its host name resolves to): a webhook URL that points back at the server
    reaches its internal ports."""
    found = _interface_ipv4() | _interface_ipv6()
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        try:
            found.add(ipaddress.ip_address(str(info[4][0]).partition("%")[0]))
        except ValueError:
            continue
    return frozenset(found)
