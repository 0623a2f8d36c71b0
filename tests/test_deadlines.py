"""Every NATS request and JetStream context in the services' code has a deadline.

A request without one waits nats-py's default or forever on a server that never
answers; the code says how long it is willing to wait. (A ``flush()`` without a timeout
waits nats-py's 10 s at most.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    path
    for top in ("libs", "services")
    for path in (ROOT / top).glob("*/src/**/*.py")
    # The SDK and the test rigs speak no NATS of their own.
    if "/testkit/" not in path.as_posix() and "/sdk/" not in path.as_posix()
)


def _calls(name: str) -> list[tuple[Path, ast.Call]]:
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == name
            ):
                found.append((path, node))
    return found


def _where(path: Path, node: ast.Call) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_the_scan_finds_the_code() -> None:
    assert len(SOURCES) > 50
    assert _calls("request"), "no NATS request found: is the scan still looking right?"


def test_every_nats_request_has_a_timeout() -> None:
    # nats-py's own requests take ``timeout``; the bus's sealed requests, ``within``.
    missing = [
        _where(path, node)
        for path, node in _calls("request")
        if not any(k.arg in ("timeout", "within") for k in node.keywords)
    ]
    assert not missing, f"NATS requests without a timeout: {missing}"


def test_every_jetstream_context_has_a_timeout() -> None:
    missing = [
        _where(path, node)
        for path, node in _calls("jetstream")
        if not any(k.arg == "timeout" for k in node.keywords)
    ]
    assert not missing, f"JetStream contexts without a timeout: {missing}"
