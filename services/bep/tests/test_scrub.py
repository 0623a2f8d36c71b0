"""Scrubbing as pure functions, and the segment framing."""

from __future__ import annotations

import re

import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep.bazel import command_line_pb2
from conveyor_bep.scrub import (
    _FOLDS_TO_ASCII,
    _PARAM_WORDS,
    _SECRET_WORDS,
    ENV_FLAGS,
    REDACTED,
    SECRET_FLAGS,
    mask_bytes,
    may_hold_secret,
    scrub_args,
    scrub_message,
    scrub_option,
    scrub_text,
)
from conveyor_bep.writer import decode_delimited, encode_delimited
from hypothesis import given, settings
from hypothesis import strategies as st


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


@pytest.mark.parametrize("flag", sorted(SECRET_FLAGS))
def test_mask_bytes_covers_every_secret_flag(flag: str) -> None:
    # The byte pass is built from the same flag names as the field pass.
    assert scrub_option(flag, "value123") == REDACTED
    masked = mask_bytes(f"--{flag}=value123 --color=yes".encode())
    assert b"value123" not in masked
    assert masked.endswith(b" --color=yes")


def test_mask_bytes_covers_secret_environment_assignments() -> None:
    masked = mask_bytes(b"--client_env=MY_SESSION_KEY=s3cr3tval --client_env=HOME=/root")
    assert b"s3cr3tval" not in masked
    assert b"HOME=/root" in masked


def test_delimited_framing_round_trips_and_refuses_truncation() -> None:
    messages = [b"", b"a", b"x" * 300]
    data = encode_delimited(messages)
    assert decode_delimited(data) == messages
    with pytest.raises(ValueError, match="truncated"):
        decode_delimited(data[:-1])
    with pytest.raises(ValueError, match="truncated"):
        decode_delimited(b"\x80")


# The prefilter that lets most events skip both passes must never skip one they would
# change: checked against the passes themselves on generated input, secret fragments mixed
# into arbitrary text.
_FRAGMENTS = [
    "https://user:pw@host/x",
    "token=abc",
    "Bearer abcdefgh1234",
    "basic QWxhZGRpbjpvcGVu",
    "--remote_header=x",
    "--client_env=MY_TOKEN=v",
    "conveyor_abc_0123456789abcdef01",
    "api-key",
    "SeCrEt",
    "\u017fecret",  # the long s: a case-insensitive str pattern reads it as "s"
    "\u212a",  # the Kelvin sign, "k" to one
    "sig=1",
    "path/to/file",
    "//pkg:target",
    " ",
    "=",
    "@",
    ":",
]
_texts = st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=8)), max_size=6).map(
    "".join
)


@settings(max_examples=400, deadline=None)
@given(_texts)
def test_the_prefilter_never_skips_what_scrub_text_changes(text: str) -> None:
    if scrub_text(text) != text:
        assert may_hold_secret(text.encode())


@settings(max_examples=300, deadline=None)
@given(st.lists(_texts, max_size=5))
def test_the_prefilter_never_skips_what_scrub_args_changes(args: list[str]) -> None:
    if scrub_args(args) != args:
        assert may_hold_secret("\x00".join(args).encode())


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_texts, _texts, max_size=4), st.lists(_texts, max_size=4))
def test_the_prefilter_never_skips_a_message_the_walk_changes(
    metadata: dict[str, str], options: list[str]
) -> None:
    for event in (
        bes.BuildEvent(build_metadata=bes.BuildMetadata(metadata=metadata)),
        bes.BuildEvent(options_parsed=bes.OptionsParsed(cmd_line=options)),
        bes.BuildEvent(progress=bes.Progress(stderr="\n".join(options))),
    ):
        raw = event.SerializeToString()
        scrub_message(event)
        if event.SerializeToString() != raw or mask_bytes(raw) != raw:
            assert may_hold_secret(raw)


def test_plain_events_skip_the_passes() -> None:
    event = bes.BuildEvent(progress=bes.Progress(stdout="INFO: Build completed, 1 test\n"))
    assert not may_hold_secret(event.SerializeToString())


def test_every_letter_a_pattern_folds_to_ascii_triggers_the_passes() -> None:
    # Python's case-insensitive str patterns match these non-ASCII letters to ASCII ones;
    # the prefilter (on bytes) must know every one of them.
    ascii_letter = re.compile("(?i)[a-z]")
    folding = {chr(c) for c in range(0x80, 0x110000) if ascii_letter.fullmatch(chr(c))}
    assert folding == set(_FOLDS_TO_ASCII)
    for letter in folding:
        assert may_hold_secret(f"x{letter}y".encode())


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.from_regex(re.compile(f"(?:{_SECRET_WORDS})", re.I), fullmatch=True),
        st.from_regex(re.compile(f"(?:{_PARAM_WORDS})=", re.I), fullmatch=True),
        st.sampled_from(sorted(SECRET_FLAGS | ENV_FLAGS)),
    ),
    st.text(max_size=5),
    st.text(max_size=5),
)
def test_every_spelling_of_a_secret_word_triggers_the_passes(
    word: str, before: str, after: str
) -> None:
    assert may_hold_secret(f"{before}{word}{after}".encode())
