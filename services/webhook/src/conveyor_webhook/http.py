"""The webhook gateways' HTTP client (aiohttp): guarded, and signing each delivery at the
last moment.

:func:`open_session` makes a gateway's session: no connection limit (the gateway bounds
its requests by its concurrency already, so no pool can make one wait behind another
gateway's, or its own), no cookies (an endpoint's cookies must not ride along on later
deliveries), no aiohttp-level timeout (the registration's timeout applies per delivery),
no proxy from the environment.

**Where it may connect.** Every connection goes through the address policy
(:class:`~conveyor_runtime.webhook_urls.AddressPolicy`) twice: the resolver refuses a name
any of whose addresses is forbidden (:class:`GuardedResolver`), and the socket factory
refuses to open a socket to a forbidden address (a literal address in the URL skips the
resolver). aiohttp connects to exactly the addresses the resolver returned, so a name
that resolved to a public address at registration and resolves to ``127.0.0.1`` now
(DNS rebinding) is refused at connect time. A refusal is a
:class:`~conveyor_runtime.webhook_urls.ForbiddenAddress` inside aiohttp's connection
error (:func:`forbidden`); nothing is sent anywhere.

**Signatures.** The signature timestamp must be fresh when the request leaves: a request
sent inside :func:`signed_by` gets its signature headers from the given signer right
before its headers are written to the connection, after any wait for that connection.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

import aiohttp
from aiohappyeyeballs import AddrInfoType
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.connector import Connection
from conveyor_runtime.webhook_urls import AddressPolicy, ForbiddenAddress

#: Makes the signature headers of the request being sent.
Signer = Callable[[], Mapping[str, str]]
#: Makes the resolver a new session looks names up with (tests give their own).
ResolverFactory = Callable[[], AbstractResolver]

_SIGNER: ContextVar[Signer | None] = ContextVar("conveyor_webhook_signer", default=None)


class SigningRequest(aiohttp.ClientRequest):
    """A request whose signature headers are set just before it is sent on a connection,
    by the signer of the :func:`signed_by` block that sent it (none: left as given)."""

    async def send(self, conn: Connection) -> aiohttp.ClientResponse:
        """Sign, then send as usual."""
        signer = _SIGNER.get()
        if signer is not None:
            for name, value in signer().items():
                self.headers[name] = value
        return await super().send(conn)


@contextmanager
def signed_by(signer: Signer) -> Iterator[None]:
    """Requests sent (by this task) inside the block are signed by ``signer`` right
    before they go out."""
    token = _SIGNER.set(signer)
    try:
        yield
    finally:
        _SIGNER.reset(token)


class GuardedResolver(AbstractResolver):
    """Resolves with ``inner`` (default: aiohttp's), then refuses the whole answer when
    any address in it is one the policy forbids (ForbiddenAddress)."""

    def __init__(self, policy: AddressPolicy, inner: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._inner = inner if inner is not None else aiohttp.DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        """The addresses of ``host``, each one checked."""
        answer = await self._inner.resolve(host, port, family)
        if any(not self._policy.permits(entry["host"]) for entry in answer):
            raise ForbiddenAddress()
        return answer

    async def close(self) -> None:
        """Close the inner resolver."""
        await self._inner.close()


def guarded_socket_factory(policy: AddressPolicy) -> Callable[[AddrInfoType], socket.socket]:
    """A socket factory for aiohttp's connector that refuses forbidden addresses: the last
    check, on the very address the socket is about to connect to."""

    def make(addr_info: AddrInfoType) -> socket.socket:
        family, type_, proto, _, address = addr_info
        if not policy.permits(str(address[0])):
            raise ForbiddenAddress()
        return socket.socket(family=family, type=type_, proto=proto)

    return make


def forbidden(exc: BaseException) -> bool:
    """True when ``exc`` (an aiohttp error, say) comes from a refused address."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ForbiddenAddress):
            return True
        seen.add(id(current))
        inner = getattr(current, "os_error", None)
        if isinstance(inner, ForbiddenAddress):
            return True
        current = current.__cause__ or current.__context__
    return False


def open_session(
    policy: AddressPolicy,
    *,
    limit: int = 0,
    resolver: AbstractResolver | None = None,
) -> aiohttp.ClientSession:
    """A gateway's HTTP session, connecting only where ``policy`` allows (``limit``: most
    connections at once, 0 for no limit; ``resolver``: looks names up, default aiohttp's;
    both only tests set). The caller closes it."""
    connector = aiohttp.TCPConnector(
        limit=limit,
        limit_per_host=0,
        resolver=GuardedResolver(policy, resolver),
        socket_factory=guarded_socket_factory(policy),
    )
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
        request_class=SigningRequest,
        raise_for_status=False,
        trust_env=False,
    )
