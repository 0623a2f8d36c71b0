"""Conveyor maintenance service: the leader-elected scheduler, reaper, dependency resolver
and storage upkeep."""

from __future__ import annotations

from conveyor_maintenance.maintenance import (
    REAPER,
    SCHEDULER,
    STORAGE,
    CronReport,
    Maintenance,
    ReaperReport,
)
from conveyor_maintenance.resolver import RESOLVER, DependencyResolver

__all__ = [
    "REAPER",
    "RESOLVER",
    "SCHEDULER",
    "STORAGE",
    "CronReport",
    "DependencyResolver",
    "Maintenance",
    "ReaperReport",
]
