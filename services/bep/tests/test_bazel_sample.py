"""The sample workspace (examples/bazel) under the real Bazel (Debian's bazel-bootstrap,
installed by scripts/install-bazel): the Build Event Protocol files it writes parse with
the generated ``conveyor_bep.bazel`` classes and say what happened.

Skipped where Bazel is missing, except under CI, where a missing Bazel fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_testkit.bazel import (
    bazel_available,
    read_binary_stream,
    remove_output_root,
    run_bazel,
    sample_workspace,
)

pytestmark = pytest.mark.e2e

#: Bazel's exit status for a build whose tests failed.
TESTS_FAILED = 3


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def output_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One Bazel output root for the module's runs (the install base is unpacked once)."""
    if not bazel_available():
        if _in_ci():
            pytest.fail("bazel is not on PATH under CI: scripts/install-bazel installs it")
        pytest.skip("bazel is not on PATH (scripts/install-bazel installs it)")
    root = tmp_path_factory.mktemp("bazel-root")
    yield root
    remove_output_root(root)


def _bazel_test(
    workspace: Path, output_root: Path, events: Path, *args: str
) -> tuple[int, list[bes.BuildEvent], list[str]]:
    """``bazel test ARGS`` writing both event files; (exit status, binary events, JSON
    lines)."""
    done = run_bazel(
        workspace,
        "test",
        f"--build_event_json_file={events}.json",
        f"--build_event_binary_file={events}.bin",
        *args,
        output_user_root=output_root,
    )
    assert Path(f"{events}.bin").exists(), done.stderr
    stream = read_binary_stream(Path(f"{events}.bin"))
    lines = Path(f"{events}.json").read_text().splitlines()
    return done.returncode, stream, lines


def _finished(stream: list[bes.BuildEvent]) -> bes.BuildFinished:
    finished = [event.finished for event in stream if event.HasField("finished")]
    assert len(finished) == 1
    return finished[0]


def _results(stream: list[bes.BuildEvent]) -> dict[str, list[int]]:
    """{label: the status of each attempt, in order} of the TestResult events."""
    results: dict[str, list[int]] = {}
    for event in stream:
        if event.HasField("test_result"):
            results.setdefault(event.id.test_result.label, []).append(event.test_result.status)
    return results


def _summaries(stream: list[bes.BuildEvent]) -> dict[str, int]:
    return {
        event.id.test_summary.label: event.test_summary.overall_status
        for event in stream
        if event.HasField("test_summary")
    }


def test_sample_workspace_passes(tmp_path: Path, output_root: Path) -> None:
    workspace = sample_workspace(tmp_path)
    status, stream, lines = _bazel_test(workspace, output_root, tmp_path / "events", "//...")

    assert status == 0
    assert stream, "no events in the binary file"
    assert len(stream) == len(lines)
    assert stream[0].HasField("started")
    finished = _finished(stream)
    assert finished.overall_success
    assert finished.exit_code.name == "SUCCESS"
    assert finished.exit_code.code == 0
    assert _results(stream) == {"//:pass_test": [bes.PASSED]}
    assert _summaries(stream) == {"//:pass_test": bes.PASSED}
    # The manual targets stay out of //...
    completed = {e.id.target_completed.label for e in stream if e.HasField("completed")}
    assert completed == {"//:hello", "//:pass_test"}


def test_failing_and_flaky_tests(tmp_path: Path, output_root: Path) -> None:
    workspace = sample_workspace(tmp_path)
    flaky_dir = tmp_path / "flaky"
    flaky_dir.mkdir()
    status, stream, lines = _bazel_test(
        workspace,
        output_root,
        tmp_path / "events",
        "--flaky_test_attempts=2",
        f"--test_env=FLAKY_DIR={flaky_dir}",
        "//:pass_test",
        "//:fail_test",
        "//:flaky_test",
    )

    assert status == TESTS_FAILED
    assert len(stream) == len(lines)
    finished = _finished(stream)
    assert not finished.overall_success
    assert finished.exit_code.name == "TESTS_FAILED"
    assert _results(stream) == {
        "//:pass_test": [bes.PASSED],
        "//:fail_test": [bes.FAILED, bes.FAILED],
        "//:flaky_test": [bes.FAILED, bes.PASSED],
    }
    assert _summaries(stream) == {
        "//:pass_test": bes.PASSED,
        "//:fail_test": bes.FAILED,
        "//:flaky_test": bes.FLAKY,
    }
