"""The REST process's health file (``CONVEYOR_HEALTH_FILE``, for ``conveyor health``):
rewritten every few seconds while the api answers this process.

Answers means any status but UNAVAILABLE and DEADLINE_EXCEEDED to an AdminService.WhoAmI
call with the process's own token: a refusal (no token, a bad one) is still the api
answering, and the routes pass each caller's own token anyway."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2 as pb

from conveyor_rest.periodic import Periodic

logger = logging.getLogger(__name__)

#: Seconds between beats (``conveyor health`` allows a file 10 s old by default).
INTERVAL = 2.0
#: The statuses that mean the api did not answer.
SILENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class HealthBeat(Periodic):
    """Touches ``path`` after each :meth:`check` the api answers; :meth:`start` checks
    every ``interval`` seconds in the background until :meth:`stop`."""

    name = "conveyor-rest-health"

    def __init__(
        self,
        path: str,
        admin: Callable[[], Any],
        *,
        token: str | None = None,
        interval: float = INTERVAL,
    ) -> None:
        super().__init__(interval)
        self.path = Path(path)
        self._admin = admin
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._healthy: bool | None = None

    async def check(self) -> bool:
        """Ask the api once; touch the file when it answered. True when it did."""
        try:
            await self._admin().WhoAmI(
                pb.WhoAmIRequest(), metadata=self._metadata, timeout=self.interval
            )
            answered, why = True, ""
        except grpc.aio.AioRpcError as exc:
            answered = exc.code() not in SILENT
            why = f"{exc.code().name}: {exc.details()}"
        if answered:
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(f"{time.time():.3f}\n")
            os.replace(tmp, self.path)
        if answered != self._healthy:
            if answered:
                logger.info("health.healthy path=%s", self.path)
            else:
                logger.warning(
                    "health.unhealthy path=%s reasons=api not answering (%s)", self.path, why
                )
            self._healthy = answered
        return answered

    async def round(self) -> None:
        """A beat: :meth:`check`."""
        await self.check()
