"""Parsing the api's bearer tokens (``name:role:secret``), from the environment and from a
tokens file, and what ApiSettings makes of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from conveyor_runtime.service import service_main, settings_errors
from conveyor_runtime.settings import ApiSettings
from conveyor_runtime.tokens import (
    MIN_SECRET_LENGTH,
    Role,
    Token,
    TokenError,
    digest,
    load_tokens,
    parse_token,
)
from pydantic import ValidationError

SECRET = "k7Qv-2mZ_x9LpR4tWc8N"  # 20 characters of the b64token alphabet
OTHER = "Zb3n.Yw~8+Lq/Xv1Ho6="


@pytest.mark.parametrize(
    ("entry", "name", "role", "queues"),
    [
        (f"ops:admin:{SECRET}", "ops", Role.ADMIN, None),
        (f"ci-1:producer:{SECRET}", "ci-1", Role.PRODUCER, None),
        (f"pool.a:worker:{SECRET}", "pool.a", Role.WORKER, None),
        (f"mail:worker=emails:{SECRET}", "mail", Role.WORKER, {"emails"}),
        (f"mail:worker=emails+reports:{SECRET}", "mail", Role.WORKER, {"emails", "reports"}),
        (f"dash:read-only:{SECRET}", "dash", Role.READ_ONLY, None),
        (f"  ops:admin:{SECRET}  ", "ops", Role.ADMIN, None),
        (f"ops:admin:{OTHER}", "ops", Role.ADMIN, None),
    ],
)
def test_good_entries(entry: str, name: str, role: Role, queues: set[str] | None) -> None:
    token = parse_token(entry, "entry 1")
    assert (token.name, token.role) == (name, role)
    assert token.queues == (None if queues is None else frozenset(queues))
    assert token.secret_digest == digest(entry.strip().split(":", 2)[2])


def test_a_secret_may_hold_colons_after_the_role() -> None:
    # name and role end at the first two colons; whatever follows is the secret.
    assert parse_token(f"a:admin:{SECRET}", "x").secret_digest == digest(SECRET)
    with pytest.raises(TokenError, match="letters, digits and"):
        parse_token(f"a:admin:{SECRET}:more", "x")


def test_role_text_round_trips() -> None:
    assert parse_token(f"m:worker=b+a:{SECRET}", "x").role_text == "worker=a+b"
    assert parse_token(f"m:read-only:{SECRET}", "x").role_text == "read-only"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        # The format before roles: refused, with how to rewrite it.
        (SECRET, "is a bare token with no name or role"),
        (SECRET, "write it as <name>:admin:<the token>"),
        (f"ci:{SECRET}", "has one colon"),
        (f":admin:{SECRET}", "the name must be"),
        (f"-x:admin:{SECRET}", "the name must be"),
        (f"a b:admin:{SECRET}", "the name must be"),
        (f"ci:superuser:{SECRET}", "(token 'ci'): unknown role"),
        (f"ci:readonly:{SECRET}", "unknown role"),
        (f"ci::{SECRET}", "unknown role"),
        (f"ci:producer=q:{SECRET}", "only the worker role takes a list of queues"),
        (f"ci:worker=:{SECRET}", "invalid queue name ''"),
        (f"ci:worker=a++b:{SECRET}", "invalid queue name ''"),
        (f"ci:worker=a,b:{SECRET}", "invalid queue name 'a,b'"),
        ("ci:admin:", f"the secret has 0 characters; at least {MIN_SECRET_LENGTH}"),
        ("ci:admin:change-me", "the secret has 9 characters"),
        ("ci:admin:0123456789abcde", "the secret has 15 characters"),
        (f"ci:admin:{SECRET} extra", "the secret may hold only"),
        (f"ci:admin:{SECRET}#note", "the secret may hold only"),
        (f"ci:admin:é{SECRET}", "the secret may hold only"),
    ],
)
def test_bad_entries_say_what_is_wrong(entry: str, message: str) -> None:
    with pytest.raises(TokenError) as info:
        parse_token(entry, "CONVEYOR_AUTH_TOKENS entry 3")
    text = str(info.value)
    assert text.startswith("CONVEYOR_AUTH_TOKENS entry 3")
    assert message in text
    assert "name:role:secret" in text or "invalid queue name" in text
    assert SECRET not in text


def test_names_and_secrets_are_unique() -> None:
    with pytest.raises(TokenError, match="two tokens are named 'a'"):
        load_tokens([f"a:admin:{SECRET}", f"a:producer:{OTHER}"])
    with pytest.raises(TokenError, match="tokens 'a' and 'b' have the same secret"):
        load_tokens([f"a:admin:{SECRET}", f"b:producer:{SECRET}"])


def test_a_tokens_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(
        "# Conveyor api tokens\n"
        "\n"
        f"ops:admin:{SECRET}\n"
        "   # indented comment\n"
        f"  mail:worker=emails+reports:{OTHER}  \n"
    )
    ops, mail = load_tokens([], path)
    assert (ops.name, ops.role) == ("ops", Role.ADMIN)
    assert mail.queues == frozenset({"emails", "reports"})
    # The file adds to the environment's tokens; duplicates across the two are caught.
    env = load_tokens([f"ci:producer:{'p' * 16}"], path)
    assert [t.name for t in env] == ["ci", "ops", "mail"]
    with pytest.raises(TokenError, match="two tokens are named 'ops'"):
        load_tokens([f"ops:producer:{'p' * 16}"], path)


def test_a_bad_tokens_file_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# header\nops:admin:{SECRET}\n{OTHER}\n")
    with pytest.raises(TokenError) as info:
        load_tokens([], path)
    assert str(info.value).startswith(f"tokens file {str(path)!r} line 3 is a bare token")
    assert OTHER not in str(info.value)
    with pytest.raises(TokenError, match=r"cannot read the tokens file .*No such file"):
        load_tokens([], tmp_path / "missing")


def test_a_token_shows_no_secret() -> None:
    token = parse_token(f"ops:admin:{SECRET}", "x")
    assert SECRET not in repr(token)
    assert "secret_digest" not in repr(token)
    assert token == Token("ops", Role.ADMIN, None, digest(SECRET))


# ------------------------------------------------------------- ApiSettings


def test_settings_parse_tokens_from_the_environment_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"mail:worker=emails:{OTHER}\n")
    monkeypatch.setenv("CONVEYOR_AUTH_TOKENS", f"ops:admin:{SECRET}, ci:producer:{'p' * 16}")
    monkeypatch.setenv("CONVEYOR_AUTH_TOKENS_FILE", str(path))
    settings = ApiSettings(host="127.0.0.1")
    assert [(t.name, t.role_text) for t in settings.tokens] == [
        ("ops", "admin"),
        ("ci", "producer"),
        ("mail", "worker=emails"),
    ]
    assert SECRET not in repr(settings)
    monkeypatch.delenv("CONVEYOR_AUTH_TOKENS_FILE")
    flagged = ApiSettings.from_args(["--host", "127.0.0.1", "--auth-tokens-file", str(path)])
    assert [t.name for t in flagged.tokens] == ["ops", "ci", "mail"]


def test_a_tokens_file_alone_is_enough_and_an_empty_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"ops:admin:{SECRET}\n")
    assert [t.name for t in ApiSettings(host="127.0.0.1", auth_tokens_file=str(path)).tokens] == [
        "ops"
    ]
    path.write_text("# nothing yet\n")
    with pytest.raises(ValidationError, match="no auth tokens configured"):
        ApiSettings(host="127.0.0.1", auth_tokens_file=str(path))
    assert (
        ApiSettings(host="127.0.0.1", auth_tokens_file=str(path), allow_unauthenticated=True).tokens
        == ()
    )


def test_settings_errors_never_quote_a_secret() -> None:
    for tokens in (SECRET, f"ops:admin:{SECRET},{OTHER}", f"ops:nope:{SECRET}"):
        with pytest.raises(ValidationError) as info:
            ApiSettings(host="127.0.0.1", auth_tokens=tokens)
        text = settings_errors(info.value)
        assert "CONVEYOR_AUTH_TOKENS entry" in text
        assert SECRET not in text
        assert OTHER not in text


def test_an_api_with_a_bare_token_does_not_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_AUTH_TOKENS", SECRET)
    monkeypatch.setenv("CONVEYOR_HOST", "127.0.0.1")  # loopback: plaintext is allowed

    async def serve(_settings: ApiSettings, _stop: object) -> None:
        raise AssertionError("must not start")

    assert service_main(ApiSettings, serve, [], name="api") == 2
    err = capsys.readouterr().err
    assert "conveyor-api: invalid settings:" in err
    assert "CONVEYOR_AUTH_TOKENS entry 1 is a bare token" in err
    assert "name:role:secret" in err
    assert SECRET not in err
