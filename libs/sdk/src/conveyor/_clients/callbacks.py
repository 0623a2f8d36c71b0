"""The asyncio webhook callbacks, :class:`AsyncCallbacks`, over the server's
WebhookService; scripts/gen_sync_clients.py turns it into the blocking
:class:`Callbacks` (``callbacks_sync.py``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc

from conveyor._channel import TlsFile
from conveyor._clients.callbacks_wire import (
    WEBHOOK_SERVICE,
    Outcome,
    heartbeat_request,
    report_request,
)
from conveyor._clients.transport import AsyncRpcClient
from conveyor._payload import Codec, JsonCodec
from conveyor._types import DurationLike
from conveyor._wire_time import timestamp_from_wire


class AsyncCallbacks(AsyncRpcClient):
    """The server's WebhookService, from asyncio code: callbacks for deliveries a webhook
    endpoint answered ``accepted``.

    ``address`` is the delivery's ``params.callback`` (the api's gRPC address;
    ``https://host:port`` when the api speaks TLS). ``tls``, ``tls_ca``, ``tls_cert``
    and ``tls_key`` are those of :class:`~conveyor.AsyncClient`: the CA bundle that
    verifies the api and, for an api with mutual TLS, the endpoint's client certificate.
    No bearer token: each call is authenticated by the delivery's ``lease_token``. ``codec`` encodes
    progress and results (JSON by default, like the rest of the SDK). Errors are the SDK's
    exceptions: :class:`~conveyor.Unauthenticated` for a bad token,
    :class:`~conveyor.FailedPrecondition` when the lease is lost (the task was reaped,
    canceled or delivered again: stop working on it), :class:`~conveyor.Unavailable` when
    the webhook worker is not running right now (retry), :class:`~conveyor.InvalidArgument`
    for a bad request.
    """

    _service = WEBHOOK_SERVICE

    def __init__(
        self,
        address: str,
        *,
        codec: Codec | None = None,
        timeout: DurationLike | None = 30.0,
        tls: bool | None = None,
        tls_ca: TlsFile | None = None,
        tls_cert: TlsFile | None = None,
        tls_key: TlsFile | None = None,
    ) -> None:
        super().__init__(
            address,
            token=None,
            codec=codec or JsonCodec(),
            timeout=timeout,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )

    async def heartbeat(self, lease_token: str, progress: Any = None) -> datetime | None:
        """Extend the delivery's lease (by the server's lease TTL) and store ``progress``
        if given; returns the new lease expiry. Beat well within the TTL: a delivery that
        stops beating is reclaimed and delivered again."""
        request = heartbeat_request(self._codec, lease_token, progress)
        response = await self._call("Heartbeat", request, svc.WebhookHeartbeatResponse)
        return timestamp_from_wire(response, "lease_expires_at")

    async def report_result(
        self,
        lease_token: str,
        outcome: Outcome | str,
        result: Any = None,
        error: str | None = None,
        retry_after: DurationLike | None = None,
    ) -> None:
        """Finish the delivery with ``outcome`` (an :class:`Outcome` or its value):
        ``result`` is stored on success, ``error`` becomes the task's last error on a
        failure, ``retry_after`` (seconds or timedelta) overrides the retry backoff."""
        request = report_request(self._codec, lease_token, outcome, result, error, retry_after)
        await self._call("ReportResult", request, svc.WebhookReportResultResponse)
