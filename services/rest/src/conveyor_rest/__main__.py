"""``python -m conveyor_rest``: the REST admin API and dashboard, in front of an api.

Flags or environment: ``--target`` (``CONVEYOR_TARGET``, default ``127.0.0.1:50051``),
``--host`` (``CONVEYOR_REST_HOST``, default ``127.0.0.1``), ``--port``
(``CONVEYOR_REST_PORT``, default 8080).
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from conveyor_rest.app import create_app


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m conveyor_rest", description=__doc__)
    parser.add_argument("--target", default=os.environ.get("CONVEYOR_TARGET", "127.0.0.1:50051"))
    parser.add_argument("--host", default=os.environ.get("CONVEYOR_REST_HOST", "127.0.0.1"))
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("CONVEYOR_REST_PORT", "8080"))
    )
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.target), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
