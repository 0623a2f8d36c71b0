"""The README's configuration reference is generated from the settings classes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conveyor_runtime.settings import ApiSettings, DispatcherSettings, reference_markdown
from pydantic import ValidationError

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_settings_reference_is_current() -> None:
    text = README.read_text()
    start = text.index("<!-- settings-reference:start -->\n") + len(
        "<!-- settings-reference:start -->\n"
    )
    end = text.index("<!-- settings-reference:end -->")
    assert text[start:end] == reference_markdown(), (
        "README configuration reference is stale: run scripts/settings_reference.py"
    )


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_BATCH_MAX", "7")
    assert DispatcherSettings.from_args([]).batch_max == 7
    assert DispatcherSettings.from_args(["--batch-max", "9"]).batch_max == 9


def test_api_refuses_to_start_without_auth_unless_told() -> None:
    # On loopback: a plaintext port needs no allow_plaintext (see test_tls_settings.py).
    with pytest.raises(ValidationError, match="no auth tokens"):
        ApiSettings.from_args(["--host", "127.0.0.1"])
    flag = "a:admin:0123456789abcdef,b:producer:fedcba9876543210"
    assert [
        t.name for t in ApiSettings.from_args(["--host", "127.0.0.1", "--auth-tokens", flag]).tokens
    ] == ["a", "b"]


def test_bad_values_are_rejected_with_the_field_name() -> None:
    with pytest.raises(ValidationError, match="lease_ttl"):
        DispatcherSettings.from_args(["--lease-ttl", "-1"])
