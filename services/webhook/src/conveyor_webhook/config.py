"""What every webhook gateway (and callback responder) of a manager shares."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor_api.gateway import GatewayConfig


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """What every webhook gateway of a manager shares."""

    gateway: GatewayConfig
    #: The api's public gRPC address, sent in every delivery (empty: none, and then an
    #: endpoint cannot work asynchronously: ``accepted`` fails the attempt).
    callback_address: str = ""
    breaker_threshold: int = 5
    breaker_cooldown: float = 30.0
