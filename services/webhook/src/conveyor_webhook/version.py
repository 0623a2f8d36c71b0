"""The webhook service's version (the ``User-Agent`` of every delivery)."""

from __future__ import annotations

__version__ = "0.1.0"
