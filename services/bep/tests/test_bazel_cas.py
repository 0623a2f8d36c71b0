"""The CAS sink under the real Bazel (Debian's bazel-bootstrap, Bazel 4.2.3): ``bazel test``
of the sample workspace with ``--bes_backend`` and ``--remote_cache`` both pointed at one
``conveyor-bep serve`` process.

Bazel uploads the files its events reference (test logs, outputs, the profile) to the
remote cache before it sends those events, with the project's key in
``--remote_header=x-api-key=...``; the stream then pins them to the invocation. The test
checks the test log and the profile arrived, are pinned to the build, and read back over
ByteStream with the bytes Bazel has on disk; and that another project cannot read them.

Skipped where Bazel is missing, except under CI, where a missing Bazel fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import grpc
import pytest
from conveyor_bep.bazel.google.bytestream import bytestream_pb2, bytestream_pb2_grpc
from conveyor_bep.blobs import blob_path
from conveyor_bep.normalize import bytestream_digest
from conveyor_testkit.bazel import (
    bazel_available,
    bep_cli,
    remove_output_root,
    run_bazel,
    sample_workspace,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.slow]

if not bazel_available() and os.environ.get("CI", "").lower() not in ("1", "true"):
    pytest.skip("bazel is not installed (scripts/install-bazel)", allow_module_level=True)

_LISTENING = re.compile(r"conveyor-bep listening on [^:]+:(\d+)")


def _serve(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "conveyor_bep", "serve", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def _read(port: int, key: str, digest: str, size: int) -> bytes:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = bytestream_pb2_grpc.ByteStreamStub(channel)  # type: ignore[no-untyped-call]
        request = bytestream_pb2.ReadRequest(resource_name=f"blobs/{digest}/{size}")
        out = b""
        async for response in stub.Read(request, metadata=(("x-api-key", key),), timeout=10):
            out += response.data
        return out


async def test_bazel_uploads_what_its_events_reference_and_the_build_pins_it(
    fresh_pg_dsn: str, tmp_path: Path
) -> None:
    blob_root = tmp_path / "blobs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        CONVEYOR_DSN=fresh_pg_dsn,
        CONVEYOR_BEP_USE_NATS="false",
        CONVEYOR_LOG_LEVEL="warning",
        CONVEYOR_BEP_COMMIT_INTERVAL="0.005",
        CONVEYOR_BEP_BLOB_ROOT=str(blob_root),
    )
    bep_cli(env, "migrate")
    bep_cli(env, "project", "create", "sample")
    bep_cli(env, "project", "create", "stranger")
    key = bep_cli(env, "key", "create", "sample")
    stranger = bep_cli(env, "key", "create", "stranger")
    proc = _serve(env)
    output_root = tmp_path / "bazel-root"
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = _LISTENING.search(line)
        assert match is not None, line + proc.stdout.read()
        port = int(match[1])
        workspace = sample_workspace(tmp_path)
        json_file = tmp_path / "events.json"
        done = await asyncio.to_thread(
            run_bazel,
            workspace,
            "test",
            "//...",
            f"--bes_backend=grpc://127.0.0.1:{port}",
            f"--project_id={key}",
            f"--remote_cache=grpc://127.0.0.1:{port}",
            f"--remote_header=x-api-key={key}",
            "--bes_timeout=120s",
            f"--build_event_json_file={json_file}",
            output_user_root=output_root,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        events = [json.loads(x) for x in json_file.read_text().splitlines() if x]
        invocation_id = next(e for e in events if "started" in e["id"])["started"]["uuid"]
        result = next(e for e in events if "testResult" in e["id"])
        outputs = {f["name"]: f["uri"] for f in result["testResult"]["testActionOutput"]}
        assert outputs["test.log"].startswith(f"bytestream://127.0.0.1:{port}/blobs/")
        log = bytestream_digest(outputs["test.log"])
        assert log is not None
        tool_logs = next(e for e in events if "buildToolLogs" in e["id"])["buildToolLogs"]
        profile_uri = next(f["uri"] for f in tool_logs["log"] if f["name"] == "command.profile.gz")
        profile = bytestream_digest(profile_uri)
        assert profile is not None

        conn = await asyncpg.connect(fresh_pg_dsn)
        try:
            pins = {
                (r["kind"], r["label"], r["name"]): (r["digest"], r["size"])
                for r in await conn.fetch(
                    "SELECT * FROM bep.artifacts WHERE invocation_id = $1", invocation_id
                )
            }
            blobs = {
                r["digest"]: r
                for r in await conn.fetch(
                    "SELECT b.* FROM bep.blobs b JOIN bep.projects p ON p.id = b.project_id"
                    " WHERE p.slug = 'sample'"
                )
            }
        finally:
            await conn.close()
        assert pins[("test_output", "//:pass_test", "test.log")] == log
        assert pins[("build_tool_log", "", "command.profile.gz")] == profile
        assert pins[("output", "//:hello", "hello.txt")][0] in blobs
        for digest, size in (log, profile):
            assert blobs[digest]["size"] == size
            assert blobs[digest]["key_prefix"] == "sample"

        local_log = (workspace / "bazel-testlogs" / "pass_test" / "test.log").read_bytes()
        assert b"pass_test: ok" in local_log
        assert hashlib.sha256(local_log).hexdigest() == log[0]
        assert await _read(port, key, *log) == local_log
        assert blob_path(blob_root, "sample", log[0]).read_bytes() == local_log
        stored_profile = await _read(port, key, *profile)
        assert hashlib.sha256(stored_profile).hexdigest() == profile[0]
        assert stored_profile[:2] == b"\x1f\x8b"  # gzip
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _read(port, stranger, *log)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        # The key never reaches a table (--remote_header is scrubbed from the command line).
        conn = await asyncpg.connect(fresh_pg_dsn)
        try:
            text = str(await conn.fetch("SELECT * FROM bep.invocations"))
        finally:
            await conn.close()
        assert key.split("_", 2)[2] not in text
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
        remove_output_root(output_root)
