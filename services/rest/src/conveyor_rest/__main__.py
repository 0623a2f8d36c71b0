"""``python -m conveyor_rest [flags]`` (``conveyor serve rest``): the REST admin API and
the ``/ui`` dashboard, in front of an api, until SIGTERM/SIGINT.

Flags mirror RestSettings (``--help`` lists them), ``CONVEYOR_*`` variables too:
``--target`` (``CONVEYOR_TARGET``, default ``127.0.0.1:50051``; ``https://host:port`` with
``--tls-ca`` for an api that speaks TLS), ``--rest-host`` / ``--rest-port``
(``CONVEYOR_REST_HOST``, ``CONVEYOR_REST_PORT``: 127.0.0.1:8080), ``--token``
(``CONVEYOR_TOKEN``: the charts' sampler's), ``--sample-interval``, ``--health-file``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import uvloop
from conveyor_runtime.logging import configure_logging
from conveyor_runtime.settings import RestSettings
from pydantic import ValidationError

from conveyor_rest.health import HealthBeat
from conveyor_rest.link import ApiTarget
from conveyor_rest.serve import start_rest

logger = logging.getLogger("conveyor_rest")


async def serve(settings: RestSettings) -> None:
    """Serve until SIGTERM or SIGINT (a second one cuts open requests short)."""
    target = ApiTarget.from_settings(settings)
    token = settings.token.get_secret_value() if settings.token else None
    ssl = (
        {"ssl_certfile": settings.rest_tls_cert, "ssl_keyfile": settings.rest_tls_key}
        if settings.rest_tls_cert
        else None
    )
    rest = await start_rest(
        target,
        settings.rest_host,
        settings.rest_port,
        sample_interval=settings.sample_interval,
        token=token,
        ssl=ssl,
        # uvicorn's own start and stop lines say less than ours; its errors still log.
        log_level="warning" if settings.log_level != "error" else "error",
    )
    health = (
        HealthBeat(settings.health_file, rest.link.admin, token=token)
        if settings.health_file
        else None
    )
    if health is not None:
        health.start()

    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if rest.server.should_exit:
            rest.server.force_exit = True
        logger.info("service.stopping name=rest signal=%s", sig.name)
        rest.server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    logger.info(
        "rest.started url=%s api=%s tls=%s sample_interval=%s",
        rest.url,
        target.address,
        "on" if target.tls else "OFF",
        settings.sample_interval,
    )
    try:
        await rest.task
    finally:
        if health is not None:
            await health.stop()
        rest.server.force_exit = True
        await rest.stop()
    logger.info("service.stopped name=rest")


def settings_errors(exc: ValidationError) -> str:
    """One line per problem of ``exc``, without the values given (a token is secret)."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        message = str(error["msg"]).removeprefix("Value error, ")
        where = ".".join(str(part) for part in error["loc"])
        lines.append(f"  {where}: {message}" if where else f"  {message}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and environment, then serve; the exit code (2: invalid settings)."""
    try:
        settings = RestSettings.from_args(sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        print(f"conveyor-rest: invalid settings:\n{settings_errors(exc)}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    try:
        uvloop.run(serve(settings))
    except OSError as exc:
        logger.error("service.failed name=rest error=%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
