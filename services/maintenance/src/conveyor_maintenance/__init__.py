"""Conveyor maintenance service: the leader-elected scheduler, reaper and storage upkeep."""

from __future__ import annotations

from conveyor_maintenance.maintenance import (
    REAPER,
    SCHEDULER,
    STORAGE,
    CronReport,
    Maintenance,
    ReaperReport,
)

__all__ = ["REAPER", "SCHEDULER", "STORAGE", "CronReport", "Maintenance", "ReaperReport"]
