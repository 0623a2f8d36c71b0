"""Scrubbing as pure functions, and the segment framing."""

from __future__ import annotations

import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep.bazel import command_line_pb2
from conveyor_bep.scrub import REDACTED, mask_bytes, scrub_args, scrub_message, scrub_text
from conveyor_bep.writer import decode_delimited, encode_delimited


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("https://bob:hunter2pass@cache.example.com/x", "hunter2pass"),
        ("GET /a?x=1&access_token=abcd1234efgh&y=2", "abcd1234efgh"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.x.y", "eyJhbGciOiJIUzI1NiJ9"),
        ("key conveyor_0123456789abcdef_ABCDEFGHIJKLMNOPQRSTUVWX", "ABCDEFGHIJKLMNOP"),
    ],
)
def test_scrub_text_redacts(text: str, secret: str) -> None:
    cleaned = scrub_text(text)
    assert secret not in cleaned
    assert REDACTED in cleaned


def test_plain_text_is_left_alone() -> None:
    text = "INFO: Build completed successfully, 4 total actions (token bucket ok)"
    assert scrub_text(text) == text


def test_scrub_args_both_flag_forms() -> None:
    args = [
        "--remote_header=x-api-key=s3cretvalue",
        "--remote_header",
        "Authorization=Bearer abcdefghijk",
        "--client_env=AWS_SECRET_ACCESS_KEY=awsvalue1",
        "--client_env=PATH=/usr/bin",
        "--project_id=conveyor_0123456789abcdef_ABCDEFGHIJKLMNOPQRST",
        "//pkg:target",
    ]
    out = scrub_args(args)
    joined = " ".join(out)
    for secret in ("s3cretvalue", "abcdefghijk", "awsvalue1", "ABCDEFGHIJKLMNOP"):
        assert secret not in joined
    assert "--client_env=PATH=/usr/bin" in out
    assert out[-1] == "//pkg:target"


def test_structured_options_and_metadata() -> None:
    option = command_line_pb2.Option(
        combined_form="--bes_header=x-api-key=topsecret1",
        option_name="bes_header",
        option_value="x-api-key=topsecret1",
    )
    line = command_line_pb2.CommandLine(
        sections=[
            command_line_pb2.CommandLineSection(
                option_list=command_line_pb2.OptionList(option=[option])
            )
        ]
    )
    scrub_message(line)
    assert b"topsecret1" not in line.SerializeToString()
    meta = bes.BuildEvent(build_metadata=bes.BuildMetadata(metadata={"NPM_TOKEN": "npmsecret"}))
    scrub_message(meta)
    assert meta.build_metadata.metadata["NPM_TOKEN"] == REDACTED


def test_mask_bytes_keeps_length_and_framing() -> None:
    event = bes.BuildEvent(progress=bes.Progress(stderr="x"))
    unknown = b"--remote_header=x-api-key=abcdefgh"
    # field 999 (a newer Bazel's), length-delimited: tag varint 0xba 0x3e
    data = event.SerializeToString() + b"\xba\x3e" + bytes([len(unknown)]) + unknown
    masked = mask_bytes(data)
    assert len(masked) == len(data)
    assert b"abcdefgh" not in masked
    assert bes.BuildEvent.FromString(masked).progress.stderr == "x"


def test_delimited_framing_round_trips_and_refuses_truncation() -> None:
    messages = [b"", b"a", b"x" * 300]
    data = encode_delimited(messages)
    assert decode_delimited(data) == messages
    with pytest.raises(ValueError, match="truncated"):
        decode_delimited(data[:-1])
    with pytest.raises(ValueError, match="truncated"):
        decode_delimited(b"\x80")
