"""Conveyor's gateway: serves one worker in the cluster, whether a stream session (the
api) or a webhook registration (the webhook service) reached through its own
:class:`Transport`. Also what both services share around it: the outcome mapping
(:class:`Outcomes`), group commit (:class:`AckBatcher`, :class:`EnqueueCommitter`) and the
hints to dispatchers, the scheduler and the resolver (:class:`WakePublisher`,
:class:`ResolvePublisher`), and a holder's liveness (:class:`HolderBeat`)."""

from __future__ import annotations

from conveyor_gateway.breakers import BreakerConfigs
from conveyor_gateway.capacity import split_capacity
from conveyor_gateway.config import GatewayConfig, WorkerSpec
from conveyor_gateway.gateway import Gateway
from conveyor_gateway.group_commit import AckBatcher, EnqueueCommitter
from conveyor_gateway.hints import ResolvePublisher, WakePublisher
from conveyor_gateway.liveness import HolderBeat, holder_name
from conveyor_gateway.outcomes import Outcomes
from conveyor_gateway.transport import Transport

__all__ = [
    "AckBatcher",
    "BreakerConfigs",
    "EnqueueCommitter",
    "Gateway",
    "GatewayConfig",
    "HolderBeat",
    "Outcomes",
    "ResolvePublisher",
    "Transport",
    "WakePublisher",
    "WorkerSpec",
    "holder_name",
    "split_capacity",
]
