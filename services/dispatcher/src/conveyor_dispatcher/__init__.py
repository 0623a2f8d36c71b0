"""Conveyor dispatcher service: one dispatch loop per owned queue."""

from __future__ import annotations

from conveyor_dispatcher.credits import CreditBook, GatewayCredits
from conveyor_dispatcher.dispatcher import Dispatcher
from conveyor_dispatcher.queue import QueueConfig, QueueDispatcher
from conveyor_dispatcher.swrr import SmoothWeightedRoundRobin

__all__ = [
    "CreditBook",
    "Dispatcher",
    "GatewayCredits",
    "QueueConfig",
    "QueueDispatcher",
    "SmoothWeightedRoundRobin",
]
