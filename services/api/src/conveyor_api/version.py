"""The api service's version, reported in Welcome and GetClusterInfo."""

from __future__ import annotations

__version__ = "0.1.0"
