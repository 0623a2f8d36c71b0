"""Bazel in a test: the sample workspace (``examples/bazel``), a ``bazel`` run kept apart
from the machine's own Bazel state, and a reader of the Build Event Protocol's binary file.

Bazel is Debian's ``bazel-bootstrap`` (Bazel 4.2.3, installed by ``scripts/install-bazel``);
the sample needs no network. The Build Event messages are the ones that
``scripts/bep_protos.py`` generates into ``conveyor_bep.bazel`` (imported only when read).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor_bep.bazel.build_event_stream_pb2 import BuildEvent

__all__ = [
    "SAMPLE_WORKSPACE",
    "bazel_available",
    "read_binary_stream",
    "remove_output_root",
    "run_bazel",
    "sample_workspace",
]

ROOT = Path(__file__).resolve().parents[4]
#: The sample workspace of the repository: genrules and tests that pass, fail or flake.
SAMPLE_WORKSPACE = ROOT / "examples" / "bazel"
#: The commands that analyse test rules, and so need ``@remote_coverage_tools``.
_TEST_COMMANDS = frozenset({"test", "coverage"})


def bazel_available() -> bool:
    """Whether a ``bazel`` is on PATH."""
    return shutil.which("bazel") is not None


def sample_workspace(tmp_path: Path) -> Path:
    """A copy of :data:`SAMPLE_WORKSPACE` under ``tmp_path`` (without the ``bazel-*``
    links a run in the original leaves), to build in without touching the repository."""
    target = tmp_path / "bazel-example"
    shutil.copytree(
        SAMPLE_WORKSPACE,
        target,
        symlinks=True,
        ignore=lambda _dir, names: [n for n in names if n.startswith("bazel-")],
    )
    return target


def run_bazel(
    workspace: Path,
    *args: str,
    output_user_root: Path,
    timeout: float = 240.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``bazel --batch --output_user_root=OUTPUT_USER_ROOT ARGS...`` in ``workspace``
    and return it, output captured as text, whatever its exit status (Bazel exits 1 for
    a build failure, 3 for failed tests, 4 for ``test`` with no test targets).

    ``--batch`` leaves no server behind; the output root keeps the run off the user's
    cache. For ``test`` and ``coverage`` the workspace's ``remote_coverage_tools`` stub is
    passed with ``--override_repository`` (an absolute path: Bazel 4.2.3 does not expand
    ``%workspace%`` there), so nothing is downloaded even where the WORKSPACE lacks it.
    """
    command = list(args)
    stub = workspace / "remote_coverage_tools"
    if command and command[0] in _TEST_COMMANDS and stub.is_dir():
        command.insert(1, f"--override_repository=remote_coverage_tools={stub.resolve()}")
    return subprocess.run(
        ["bazel", "--batch", f"--output_user_root={output_user_root}", *command],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def remove_output_root(output_user_root: Path) -> None:
    """Delete a Bazel output root, which Bazel leaves with read-only directories."""
    if not output_user_root.exists():
        return
    for directory, _dirs, _files in os.walk(output_user_root):
        mode = os.lstat(directory).st_mode
        if not stat.S_ISLNK(mode):
            os.chmod(directory, mode | stat.S_IRWXU)
    shutil.rmtree(output_user_root)


def read_binary_stream(path: Path) -> list[BuildEvent]:
    """The Build Event messages of a ``--build_event_binary_file``: each one a varint
    length, then that many bytes of a serialized ``build_event_stream.BuildEvent``.
    ValueError when the file ends inside a length or a message."""
    from conveyor_bep.bazel.build_event_stream_pb2 import BuildEvent
    from conveyor_bep.writer import decode_delimited

    try:
        return [BuildEvent.FromString(raw) for raw in decode_delimited(path.read_bytes())]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def bep_cli(env: dict[str, str], *args: str) -> str:
    """Run ``conveyor-bep ARGS`` (migrate, project create, key create...) with ``env``;
    its output, stripped (asserting it succeeded)."""
    done = subprocess.run(
        [sys.executable, "-m", "conveyor_bep", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
