"""What every webhook gateway (and callback responder) of a manager shares."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from conveyor_broker import Broker, WebhookWorker
from conveyor_broker.ids import new_id
from conveyor_gateway import (
    AckBatcher,
    BreakerConfigs,
    Gateway,
    GatewayConfig,
    Outcomes,
    Transport,
    WakePublisher,
    WorkerSpec,
)
from conveyor_gateway.leases import OnExtended
from conveyor_runtime.bus import Bus
from conveyor_runtime.webhook_urls import AddressPolicy

from conveyor_webhook.http import ResolverFactory
from conveyor_webhook.version import __version__


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """What every webhook gateway of a manager shares."""

    gateway: GatewayConfig
    #: The api's public gRPC address, sent in every delivery (empty: none, and then an
    #: endpoint cannot work asynchronously: ``accepted`` fails the attempt).
    callback_address: str = ""
    breaker_threshold: int = 5
    breaker_cooldown: float = 30.0
    #: Where deliveries may connect (default: public addresses that are not this
    #: machine's; the manager's comes from the settings' allow-list).
    policy: AddressPolicy = field(default_factory=AddressPolicy)
    #: Makes the resolver each gateway's HTTP session looks names up with (None:
    #: aiohttp's own; tests give their own).
    resolver: ResolverFactory | None = None


@dataclass(frozen=True, slots=True)
class Wiring:
    """The connections every webhook gateway and callback responder of a manager share:
    the broker, the NATS bus, the config, and the ack and wake batchers."""

    broker: Broker
    bus: Bus
    config: WebhookConfig
    acks: AckBatcher
    wakes: WakePublisher
    #: The breaker configs per task type every gateway counts failures under (None:
    #: no breakers).
    breakers: BreakerConfigs | None = None

    def gateway(
        self,
        worker: WebhookWorker,
        transport: Transport,
        *,
        heartbeat_skips: Container[str] = frozenset(),
        on_extended: OnExtended | None = None,
    ) -> Gateway:
        """A new (not started) Gateway serving registration ``worker`` through
        ``transport``, with the id ``wh-<name>-<ulid>``."""
        now = self.config.gateway.clock.now()
        spec = WorkerSpec(
            queues=dict(worker.queues),
            concurrency=worker.concurrency,
            labels={"webhook": worker.name},
            worker_id=f"webhook:{worker.name}",
            sdk_version=f"conveyor-webhook/{__version__}",
            batch_types=tuple(worker.batch_types),
        )
        return Gateway(
            f"wh-{worker.name}-{new_id(now)}",
            spec,
            broker=self.broker,
            bus=self.bus,
            config=self.config.gateway,
            acks=self.acks,
            wakes=self.wakes,
            transport=transport,
            connected_at=now,
            heartbeat_skips=heartbeat_skips,
            on_extended=on_extended,
            breakers=self.breakers,
        )

    def outcomes(self, name: str) -> Outcomes:
        """The outcome mapping of a gateway, for Results no running gateway holds (logged
        as ``name``)."""
        return Outcomes(
            name, broker=self.broker, acks=self.acks, wakes=self.wakes, config=self.config.gateway
        )
