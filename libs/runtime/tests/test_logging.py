"""configure_logging: one structured line per record, text or JSON."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from conveyor_runtime.logging import configure_logging, split_event


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quiet = {name: logging.getLogger(name).level for name in ("asyncio", "nats", "grpc")}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, old in quiet.items():
            logging.getLogger(name).setLevel(old)


@pytest.mark.usefixtures("restore_root_logger")
def test_text_lines_carry_event_and_fields() -> None:
    out = io.StringIO()
    configure_logging("info", "text", stream=out)
    log = logging.getLogger("conveyor_test")
    log.info("queue.claimed", extra={"queue": "emails", "note": "two words"})
    log.info("task.leased task_id=%s n=%d", "01ABC", 3)
    log.debug("hidden")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(' INFO conveyor_test queue.claimed queue=emails note="two words"')
    assert lines[1].endswith(" INFO conveyor_test task.leased task_id=01ABC n=3")


@pytest.mark.usefixtures("restore_root_logger")
def test_text_lines_escape_control_characters() -> None:
    # Found by the fuzz suite: a worker's Credit frame for queue "x\nERROR ..." wrote a
    # second, forged line into the api's log, and "\x1b[31m" drove the reader's terminal.
    out = io.StringIO()
    configure_logging("info", "text", stream=out)
    log = logging.getLogger("conveyor_test")
    log.warning("gateway.credit_unknown_queue queue=%s", "x\n2030-01-01 ERROR forged\x1b[31m")
    log.info("peer.said", extra={"text": "a\x00b\x85c", "tab": "a\tb"})
    log.info("unicode queue=%s", "caf\u00e9 \U0001f600")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("queue=x\\n2030-01-01 ERROR forged\\x1b[31m")
    assert lines[1].endswith("text=a\\x00b\\x85c tab=a\tb")
    assert lines[2].endswith("unicode queue=caf\u00e9 \U0001f600")


@pytest.mark.usefixtures("restore_root_logger")
def test_json_lines_parse_and_include_exceptions() -> None:
    out = io.StringIO()
    configure_logging("debug", "json", stream=out)
    log = logging.getLogger("conveyor_test")
    log.debug("gateway.registered", extra={"gateway": "g1", "capacity": 4})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("cycle.failed queue=%s", "q")
    first, second = (json.loads(line) for line in out.getvalue().splitlines() if line)
    assert first["event"] == "gateway.registered"
    assert (first["level"], first["logger"]) == ("debug", "conveyor_test")
    assert (first["gateway"], first["capacity"]) == ("g1", 4)
    assert first["ts"].endswith("Z")
    assert second["event"] == "cycle.failed"
    assert second["queue"] == "q"
    assert "RuntimeError: boom" in second["exc"]


@pytest.mark.usefixtures("restore_root_logger")
def test_configuring_twice_keeps_one_handler_and_rejects_bad_levels() -> None:
    configure_logging("info", "text", stream=io.StringIO())
    configure_logging("warning", "text", stream=io.StringIO())
    assert len(logging.getLogger().handlers) == 1
    assert logging.getLogger().level == logging.WARNING
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud", "text")


def test_split_event_reads_printf_style_fields() -> None:
    assert split_event("queue.claimed queue=emails n=3") == (
        "queue.claimed",
        {"queue": "emails", "n": "3"},
    )
    assert split_event("nats.error name=api error=OSError(111, 'refused here')") == (
        "nats.error",
        {"name": "api", "error": "OSError(111, 'refused here')"},
    )
    assert split_event("just words here") == ("just words here", {})
    assert split_event("event") == ("event", {})
