"""The SDK's own version, sent in Hello and compared by the server."""

from __future__ import annotations

#: Semantic version of this SDK (``MAJOR.MINOR.PATCH``); kept equal to the dist version.
__version__ = "0.1.0"
