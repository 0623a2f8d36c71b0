"""docs/architecture.md stays true to the code: every NATS subject and KV bucket the
services use is in its table, and every file it points at exists."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from conveyor_runtime.subjects import Subjects

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def subject_patterns() -> list[str]:
    """Each subject of :class:`Subjects`, with its parameters as ``<name>`` placeholders and
    without the prefix (``q.<queue>.wake``)."""
    subjects = Subjects("P")
    patterns = []
    for name, member in inspect.getmembers(Subjects, inspect.isfunction):
        if name.startswith("_") or name in {"queue_of", "queue_wildcard", "events_wildcard"}:
            continue
        params = [p for p in inspect.signature(member).parameters if p != "self"]
        subject = getattr(subjects, name)(*(f"<{p}>" for p in params))
        patterns.append(subject.removeprefix("P."))
    return patterns


def test_every_subject_is_in_the_subject_table() -> None:
    text = DOC.read_text()
    patterns = subject_patterns()
    assert "q.<queue>.wake" in patterns  # the placeholders match the doc's spelling
    missing = [p for p in patterns if f"`{p}`" not in text]
    assert not missing, f"docs/architecture.md's subject table lacks {missing}"
    for bucket in (Subjects("P").owners_bucket, Subjects("P").leaders_bucket):
        assert bucket.replace("P_", "<prefix>_") in text


def test_every_file_the_doc_names_exists() -> None:
    text = DOC.read_text()
    paths = set(re.findall(r"`((?:libs|services|protos|scripts|docs)/[\w./-]+)`", text))
    assert paths, "the doc names no file at all"
    missing = sorted(p for p in paths if "..." not in p and not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
