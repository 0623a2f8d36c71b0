"""The log viewer's engine (``static/app.js``: the Web Worker half) under Node.js against
the real web server: it streams a build's log with fetch and a ReadableStream, indexes
line starts across chunks, hands out only the lines asked for, fetches the new tail from
its last offset (a line completed by the next commit included), and turns ANSI escapes
into classes or nothing.

The script runs in a ``vm`` context that looks like a worker (``self``, no
``document``); a small harness relays JSON lines between this test and the engine.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_testkit.bep import request, sample_events
from conveyor_testkit.bep_web import (  # noqa: F401  (pytest fixtures)
    WebRig,
    web_rig_fixture,
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.nats,
    pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js"),
]


HARNESS = r"""
const fs = require("fs"), vm = require("vm"), readline = require("readline");
const source = fs.readFileSync(process.argv[2], "utf8")
  + "\n;globalThis.ansiRuns = ansiRuns;";
const out = (m) => process.stdout.write(JSON.stringify(m) + "\n");
const context = { self: { postMessage: out }, TextDecoder, fetch, Date, setTimeout, console };
vm.createContext(context);
vm.runInContext(source, context);
readline.createInterface({ input: process.stdin }).on("line", (line) => {
  const command = JSON.parse(line);
  if (command.op === "post") context.self.onmessage({ data: command.msg });
  else if (command.op === "runs") out({ type: "runs", runs: context.ansiRuns(command.line) });
});
"""


class Engine:
    """The engine in a Node.js process: post it messages, read what it posts back."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        await self.process.stdin.drain()

    async def receive(self, kind: str, *, until: Any = None) -> dict[str, Any]:
        """The next message of type ``kind`` (for which ``until`` holds, if given)."""
        assert self.process.stdout is not None
        async with asyncio.timeout(15):
            while True:
                raw = await self.process.stdout.readline()
                assert raw, "the engine's process ended"
                message: dict[str, Any] = json.loads(raw)
                assert message["type"] != "error", message
                if message["type"] == kind and (until is None or until(message)):
                    return message

    async def lines(self, start: int, end: int) -> list[str]:
        """The text of lines ``start..end`` (0-based, end excluded) as the page gets it."""
        await self.send(op="post", msg={"type": "lines", "id": start, "from": start, "to": end})
        reply = await self.receive("lines", until=lambda m: m["id"] == start)
        return ["".join(text for text, _ in runs) for runs in reply["lines"]]


@pytest.fixture
async def engine(tmp_path: Path) -> Any:
    harness = tmp_path / "harness.js"
    harness.write_text(HARNESS)
    script = resources.files("conveyor_bep_web").joinpath("static", "app.js")
    process = await asyncio.create_subprocess_exec(
        "node",
        str(harness),
        str(script),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        yield Engine(process)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_ansi_escapes_become_classes_or_nothing(engine: Engine) -> None:
    cases = [
        ("plain", [["plain", ""]]),
        ("\x1b[1;31mERROR:\x1b[0m bad", [["ERROR:", "fg1 b"], [" bad", ""]]),
        ("\x1b[32mINFO:\x1b[39m ok", [["INFO:", "fg2"], [" ok", ""]]),
        ("\x1b[38;5;4mblue\x1b[38;2;1;2;3m rgb", [["blue", "fg4"], [" rgb", ""]]),
        ("old text\r\x1b[Knew", [["new", ""]]),  # what a carriage return overwrote goes
        ("crlf\r", [["crlf", ""]]),
        ("\x1b]0;title\x07a\x1b[2Kb\x1b[1Ac", [["a", ""], ["b", ""], ["c", ""]]),
        ("bell\x07 tab\tend", [["bell", ""], [" tab\tend", ""]]),
    ]
    for line, runs in cases:
        await engine.send(op="runs", line=line)
        assert (await engine.receive("runs"))["runs"] == runs, repr(line)


async def test_the_engine_streams_indexes_and_tails_a_build_log(
    web_rig: WebRig, engine: Engine
) -> None:
    inv = "viewer-1"
    feed = web_rig.feed()
    await feed.send(request(inv, 1, bazel=sample_events()[0]))
    expected: list[str] = []
    seq = 1
    for chunk in range(20):
        lines = [f"\x1b[33m{chunk:02}\x1b[0m line {len(expected) + i} ✓ é" for i in range(100)]
        expected += lines
        seq += 1
        text = "".join(f"{item}\n" for item in lines)
        await feed.send(request(inv, seq, bazel=bes.BuildEvent(progress=bes.Progress(stderr=text))))
    total = sum(len(f"{item}\n".encode()) for item in expected)
    url = f"{web_rig.web.url}/api/builds/{inv}/log"

    await engine.send(op="post", msg={"type": "load", "url": url})
    done = await engine.receive("progress", until=lambda m: m["done"])
    assert (done["bytes"], done["lines"]) == (total, 2000)
    shown = [item.replace("\x1b[33m", "").replace("\x1b[0m", "") for item in expected]
    assert await engine.lines(0, 3) == shown[0:3]
    assert await engine.lines(1498, 1503) == shown[1498:1503]
    assert await engine.lines(1995, 2100) == shown[1995:]  # clipped to the log's end

    # The tail: a line written in two commits is one line, completed by the second.
    seq += 1
    await feed.send(request(inv, seq, bazel=bes.BuildEvent(progress=bes.Progress(stderr="half"))))
    await engine.send(op="post", msg={"type": "tail"})
    grown = await engine.receive("progress", until=lambda m: m["done"])
    assert (grown["bytes"], grown["lines"]) == (total + 4, 2001)
    assert await engine.lines(2000, 2001) == ["half"]
    seq += 1
    await feed.send(
        request(inv, seq, bazel=bes.BuildEvent(progress=bes.Progress(stderr=" done\nnext\n")))
    )
    await engine.send(op="post", msg={"type": "tail"})
    final = await engine.receive("progress", until=lambda m: m["done"])
    assert (final["bytes"], final["lines"]) == (total + 15, 2002)
    assert await engine.lines(1999, 2002) == [shown[1999], "half done", "next"]
