"""Conveyor's api service: TaskService, WorkerService sessions and AdminService over gRPC."""

from __future__ import annotations

from conveyor_api.server import ApiServer
from conveyor_api.version import __version__

__all__ = ["ApiServer", "__version__"]
