"""Conveyor webhook service: webhook workers (the manager and one gateway per registration)."""

from __future__ import annotations

from conveyor_webhook.breaker import BreakerState, CircuitBreaker
from conveyor_webhook.callbacks import CallbackResponder
from conveyor_webhook.config import WebhookConfig, Wiring
from conveyor_webhook.gateway import WebhookGateway
from conveyor_webhook.manager import ROLE, WebhookManager

__all__ = [
    "ROLE",
    "BreakerState",
    "CallbackResponder",
    "CircuitBreaker",
    "WebhookConfig",
    "WebhookGateway",
    "WebhookManager",
    "Wiring",
]
