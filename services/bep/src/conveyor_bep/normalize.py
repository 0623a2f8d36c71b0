"""Normalization: each (scrubbed) Build Event Protocol event becomes changes to the
invocation row plus rows for targets, test results, actions, named file sets and metrics.

:func:`normalize` is pure: it reads one ``build_event_stream.BuildEvent`` and adds what it
says to a :class:`Changes`, which a batch accumulates across its events. Rows are keyed the
way their tables are, and a later event's non-null columns win over an earlier one's, so a
batch holds at most one row per key (what a multi-row upsert needs) and every upsert sets
only the columns its events carried ("partial column sets").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format

from conveyor_bep.bazel import build_event_stream_pb2 as bes

Row = dict[str, Any]

#: Build metadata keys that name the branch, the commit and the user, in order of trust.
BRANCH_KEYS = ("BRANCH", "BUILD_BRANCH", "GIT_BRANCH", "BRANCH_NAME")
COMMIT_KEYS = ("COMMIT_SHA", "COMMIT", "GIT_COMMIT", "REPO_COMMIT", "BUILD_SCM_REVISION")
USER_KEYS = ("USER", "BUILD_USER")

_TEST_PASSED = bes.TestStatus.Name(bes.PASSED)
_TEST_FLAKY = bes.TestStatus.Name(bes.FLAKY)


def _text(value: str) -> str:
    # Postgres text cannot hold NUL.
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def _millis(value: int) -> datetime | None:
    return datetime.fromtimestamp(value / 1000, UTC) if value > 0 else None


#: ``bytestream://host[:port]/[instance/]blobs/<sha256>/<size>``: a file in a remote cache.
_BYTESTREAM_RE = re.compile(r"bytestream://[^/]*/(?:.*/)?blobs/([0-9a-f]{64})/([0-9]{1,19})")

#: The payloads that carry ``File`` messages: their fields of File lists and of one File.
#: (A test summary's files are its attempts' test logs again, without names: left out.)
_FILE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "named_set_of_files": (("files",), ()),
    "test_result": (("test_action_output",), ()),
    "build_tool_logs": (("log",), ()),
    "action": (("action_metadata_logs",), ("stdout", "stderr", "primary_output")),
    "completed": (("important_output", "directory_output"), ()),
}
#: The artifact kind of a payload's files.
ARTIFACT_KINDS = {
    "named_set_of_files": "output",
    "completed": "output",
    "test_result": "test_output",
    "build_tool_logs": "build_tool_log",
    "action": "action_output",
}
#: The event id field that names the label of a payload's files.
_LABEL_IDS = {
    "test_result": "test_result",
    "action": "action_completed",
    "completed": "target_completed",
}


def bytestream_digest(uri: str) -> tuple[str, int] | None:
    """``(sha256 hex, size)`` of a ``bytestream://`` URI, else None."""
    match = _BYTESTREAM_RE.fullmatch(uri)
    return (match[1], int(match[2])) if match else None


def _artifacts(event: bes.BuildEvent, kind: str, changes: Changes) -> None:
    payload = getattr(event, kind)
    label_id = _LABEL_IDS.get(kind)
    label = _text(getattr(event.id, label_id).label) if label_id else ""
    artifact_kind = ARTIFACT_KINDS[kind]
    lists, singles = _FILE_FIELDS[kind]
    files = [f for name in lists for f in getattr(payload, name)]
    files += [getattr(payload, name) for name in singles if payload.HasField(name)]
    for file in files:
        if file.uri.startswith("bytestream://"):
            parsed = bytestream_digest(file.uri)
            if parsed is not None:
                changes.artifacts[(artifact_kind, label, _text(file.name), parsed[0])] = parsed[1]


def _file(file: Any) -> Row:
    out: Row = {"name": _text(file.name)}
    if file.uri:
        out["uri"] = _text(file.uri)
    if file.path_prefix:
        out["path_prefix"] = [_text(p) for p in file.path_prefix]
    return out


@dataclass(slots=True)
class InvocationChanges:
    """What a batch changes on the invocation row: values to set (the last one wins),
    counters to add, tags to merge."""

    set: Row = field(default_factory=dict)
    add: dict[str, int] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def put(self, column: str, value: Any) -> None:
        if value is not None:
            self.set[column] = value

    def incr(self, column: str, by: int = 1) -> None:
        self.add[column] = self.add.get(column, 0) + by


@dataclass(slots=True)
class Changes:
    """Everything a batch's events say, merged."""

    invocation: InvocationChanges = field(default_factory=InvocationChanges)
    targets: dict[tuple[str, str], Row] = field(default_factory=dict)
    test_results: dict[tuple[str, int, int, int], Row] = field(default_factory=dict)
    actions: dict[int, Row] = field(default_factory=dict)
    named_sets: dict[str, Row] = field(default_factory=dict)
    metrics: dict[str, Any] | None = None
    finished: bool = False
    log: list[str] = field(default_factory=list)
    #: Tag (key, value) pairs seen for the first time in this invocation (facet counts).
    new_tags: dict[str, str] = field(default_factory=dict)
    #: Files in a remote cache (``bytestream://``) the events reference, which pin their
    #: blobs in the CAS sink: (artifact kind, label, file name, sha256) -> size.
    artifacts: dict[tuple[str, str, str, str], int] = field(default_factory=dict)

    def merge_target(self, label: str, aspect: str, row: Row) -> None:
        key = (label, aspect)
        current = self.targets.setdefault(key, {})
        current.update({k: v for k, v in row.items() if v is not None})


def _configuration_id(message: Any) -> str:
    return str(message.id) if message.id else ""


def normalize(event: bes.BuildEvent, seq: int, changes: Changes) -> None:
    """Add what ``event`` (number ``seq`` in its stream) says to ``changes``."""
    kind = event.WhichOneof("payload")
    inv = changes.invocation
    event_id = event.id
    if kind in _FILE_FIELDS:
        _artifacts(event, kind, changes)
    if kind == "progress":
        for text in (event.progress.stderr, event.progress.stdout):
            if text:
                changes.log.append(_text(text))
    elif kind == "started":
        started = event.started
        inv.put("command", _text(started.command) or None)
        inv.put("tool_version", _text(started.build_tool_version) or None)
        inv.put("started_at", _millis(started.start_time_millis))
    elif kind == "unstructured_command_line":
        inv.put("command_line", [_text(a) for a in event.unstructured_command_line.args])
    elif kind == "options_parsed":
        parsed = event.options_parsed
        inv.put(
            "options",
            json.dumps(
                {
                    "startup_options": list(parsed.startup_options),
                    "explicit_startup_options": list(parsed.explicit_startup_options),
                    "cmd_line": list(parsed.cmd_line),
                    "explicit_cmd_line": list(parsed.explicit_cmd_line),
                    "tool_tag": parsed.tool_tag,
                }
            ).replace("\\u0000", "\\ufffd"),
        )
    elif kind == "workspace_status":
        for item in event.workspace_status.item:
            if item.key == "BUILD_USER":
                inv.set.setdefault("user_name", _text(item.value))
            elif item.key == "BUILD_HOST":
                inv.put("host_name", _text(item.value))
            elif item.key in COMMIT_KEYS:
                inv.set.setdefault("commit_sha", _text(item.value))
    elif kind == "build_metadata":
        metadata = {_text(k): _text(v) for k, v in event.build_metadata.metadata.items()}
        inv.tags.update(metadata)
        changes.new_tags.update(metadata)
        for column, keys in (
            ("branch", BRANCH_KEYS),
            ("commit_sha", COMMIT_KEYS),
            ("user_name", USER_KEYS),
        ):
            for key in keys:
                if metadata.get(key):
                    inv.set[column] = metadata[key]
                    break
    elif kind == "expanded":
        if event_id.HasField("pattern"):
            inv.put("patterns", [_text(p) for p in event_id.pattern.pattern])
    elif kind == "configured":
        configured = event.configured
        tid = event_id.target_configured
        inv.incr("targets_configured")
        changes.merge_target(
            _text(tid.label),
            _text(tid.aspect),
            {
                "kind": _text(configured.target_kind) or None,
                "test_size": bes.TestSize.Name(configured.test_size)
                if configured.test_size
                else None,
                "tags": [_text(t) for t in configured.tag],
            },
        )
    elif kind == "completed":
        completed = event.completed
        cid = event_id.target_completed
        inv.incr("targets_completed")
        if not completed.success:
            inv.incr("targets_failed")
        failure = completed.failure_detail.message if completed.HasField("failure_detail") else ""
        changes.merge_target(
            _text(cid.label),
            _text(cid.aspect),
            {
                "configuration": _configuration_id(cid.configuration) or None,
                "success": completed.success,
                "failure": _text(failure) or None,
            },
        )
    elif kind == "action":
        action = event.action
        aid = event_id.action_completed
        if not action.success:
            inv.incr("actions_failed")
        changes.actions[seq] = {
            "label": _text(aid.label or action.label) or None,
            "mnemonic": _text(action.type) or None,
            "configuration": _configuration_id(aid.configuration) or None,
            "primary_output": _text(aid.primary_output) or None,
            "success": action.success,
            "exit_code": action.exit_code,
            "stdout_uri": _text(action.stdout.uri) or None,
            "stderr_uri": _text(action.stderr.uri) or None,
            "command_line": [_text(a) for a in action.command_line],
            "failure": _text(action.failure_detail.message) or None
            if action.HasField("failure_detail")
            else None,
        }
    elif kind == "named_set_of_files":
        nset = event.named_set_of_files
        changes.named_sets[_text(event_id.named_set.id)] = {
            "files": json.dumps([_file(f) for f in nset.files]),
            "file_sets": [_text(s.id) for s in nset.file_sets],
        }
    elif kind == "test_result":
        result = event.test_result
        rid = event_id.test_result
        info = result.execution_info
        changes.test_results[(_text(rid.label), rid.run, rid.shard, rid.attempt)] = {
            "configuration": _configuration_id(rid.configuration) or None,
            "status": bes.TestStatus.Name(result.status),
            "status_details": _text(result.status_details) or None,
            "cached_locally": result.cached_locally,
            "cached_remotely": info.cached_remotely,
            "started_at": _millis(result.test_attempt_start_millis_epoch),
            "duration_ms": result.test_attempt_duration_millis,
            "strategy": _text(info.strategy) or None,
            "exit_code": info.exit_code,
            "outputs": json.dumps([_file(f) for f in result.test_action_output]),
        }
    elif kind == "test_summary":
        summary = event.test_summary
        sid = event_id.test_summary
        status = bes.TestStatus.Name(summary.overall_status)
        inv.incr("tests_total")
        if status == _TEST_PASSED:
            inv.incr("tests_passed")
        elif status == _TEST_FLAKY:
            inv.incr("tests_flaky")
        else:
            inv.incr("tests_failed")
        changes.merge_target(
            _text(sid.label),
            "",
            {
                "configuration": _configuration_id(sid.configuration) or None,
                "test_status": status,
                "test_runs": summary.total_run_count,
                "test_cached": summary.total_num_cached,
                "test_duration_ms": summary.total_run_duration_millis,
            },
        )
    elif kind == "finished":
        finished = event.finished
        exit_code = finished.exit_code
        inv.put("exit_code", exit_code.code)
        inv.put("exit_name", _text(exit_code.name) or None)
        inv.put("status", "success" if exit_code.code == 0 else "failed")
        inv.put("finished_at", _millis(finished.finish_time_millis))
    elif kind == "aborted":
        inv.set.setdefault("status", "aborted")
    elif kind == "build_metrics":
        metrics = event.build_metrics
        inv.put("actions_created", metrics.action_summary.actions_created)
        inv.put("actions_executed", metrics.action_summary.actions_executed)
        changes.metrics = json_format.MessageToDict(metrics, preserving_proto_field_name=True)


def console_text(text: str) -> str:
    """Console output of a BES ``ConsoleOutput`` event, made storable."""
    return _text(text)
