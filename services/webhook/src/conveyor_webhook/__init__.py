"""Conveyor webhook service: webhook workers (the manager and one gateway per registration)."""

from __future__ import annotations

from conveyor_webhook.breaker import BreakerState, CircuitBreaker
from conveyor_webhook.gateway import WebhookConfig, WebhookGateway
from conveyor_webhook.manager import ROLE, WebhookManager

__all__ = [
    "ROLE",
    "BreakerState",
    "CircuitBreaker",
    "WebhookConfig",
    "WebhookGateway",
    "WebhookManager",
]
