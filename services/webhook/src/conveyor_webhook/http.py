"""The webhook gateways' HTTP client (aiohttp), signing each delivery at the last moment.

:func:`open_session` makes a gateway's session: no connection limit (the gateway bounds
its requests by its concurrency already, so no pool can make one wait behind another
gateway's, or its own), no cookies (an endpoint's cookies must not ride along on later
deliveries), no aiohttp-level timeout (the registration's timeout applies per delivery).

The ``Conveyor-Signature`` timestamp must be fresh when the request leaves: a request
sent inside :func:`signed_by` gets its signature header from the given signer right
before its headers are written to the connection, after any wait for that connection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import aiohttp
from aiohttp.connector import Connection
from conveyor_runtime.webhook_auth import SIGNATURE_HEADER

#: Makes the Conveyor-Signature header value of the request being sent.
Signer = Callable[[], str]

_SIGNER: ContextVar[Signer | None] = ContextVar("conveyor_webhook_signer", default=None)


class SigningRequest(aiohttp.ClientRequest):
    """A request whose signature header is set just before it is sent on a connection,
    by the signer of the :func:`signed_by` block that sent it (none: left as given)."""

    async def send(self, conn: Connection) -> aiohttp.ClientResponse:
        """Sign, then send as usual."""
        signer = _SIGNER.get()
        if signer is not None:
            self.headers[SIGNATURE_HEADER] = signer()
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


def open_session(*, limit: int = 0) -> aiohttp.ClientSession:
    """A gateway's HTTP session (``limit``: most connections at once, 0 for no limit;
    only tests set one). The caller closes it."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
        request_class=SigningRequest,
        raise_for_status=False,
    )
