"""Conveyor maintenance service: the leader-elected scheduler and reaper."""

from __future__ import annotations

from conveyor_maintenance.maintenance import REAPER, SCHEDULER, Maintenance, ReaperReport

__all__ = ["REAPER", "SCHEDULER", "Maintenance", "ReaperReport"]
