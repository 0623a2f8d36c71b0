"""What every webhook gateway (and callback responder) of a manager shares."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor_api.coalesce import WakePublisher
from conveyor_api.gateway import Gateway, GatewayConfig, SendFrame, WorkerSpec
from conveyor_api.group_commit import AckBatcher
from conveyor_broker import Broker, WebhookWorker
from conveyor_broker.ids import new_id
from conveyor_runtime.subjects import Subjects
from nats.aio.client import Client as NATS

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


@dataclass(frozen=True, slots=True)
class Wiring:
    """The connections every webhook gateway and callback responder of a manager share:
    the broker, NATS, the subjects, the config, and the api's ack and wake batchers."""

    broker: Broker
    nc: NATS
    subjects: Subjects
    config: WebhookConfig
    acks: AckBatcher
    wakes: WakePublisher

    def gateway(
        self, kind: str, worker: WebhookWorker, send: SendFrame, *, accepts_dispatches: bool = False
    ) -> Gateway:
        """A new (not started) api Gateway serving registration ``worker``, with the id
        ``<kind>-<name>-<ulid>``, sending its frames to ``send``."""
        now = self.config.gateway.clock.now()
        spec = WorkerSpec(
            queues=dict(worker.queues),
            concurrency=worker.concurrency,
            labels={"webhook": worker.name},
            worker_id=f"webhook:{worker.name}",
            sdk_version=f"conveyor-webhook/{__version__}",
            accepts_dispatches=accepts_dispatches,
        )
        return Gateway(
            f"{kind}-{worker.name}-{new_id(now)}",
            spec,
            broker=self.broker,
            nc=self.nc,
            subjects=self.subjects,
            config=self.config.gateway,
            acks=self.acks,
            wakes=self.wakes,
            send=send,
            connected_at=now,
        )
