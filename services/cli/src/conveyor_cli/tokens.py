"""``conveyor token new|check``: make an api token, check the tokens an api would load."""

from __future__ import annotations

import os
import secrets

import click
from conveyor_runtime.tokens import TokenError, load_tokens, parse_token

from conveyor_cli.output import emit_json

#: Random bytes in a new secret (43 characters of base64url).
SECRET_BYTES = 32
ROLES_HELP = "admin, producer, worker, worker=<queue>+<queue>... or read-only"


@click.group()
def token() -> None:
    """Api tokens: each is name:role:secret (README, Tokens and roles)."""


@token.command("new")
@click.argument("name")
@click.option("--role", required=True, help=f"The token's role: {ROLES_HELP}")
def token_new(name: str, role: str) -> None:
    """Print a new token, NAME:ROLE:<random secret>, for the api's tokens file.

    Clients present only the secret, the part after the second colon
    (`--token`, CONVEYOR_TOKEN, the SDK's token=).
    """
    entry = f"{name}:{role}:{secrets.token_urlsafe(SECRET_BYTES)}"
    try:
        parse_token(entry, "the new token")
    except TokenError as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(entry)


@token.command("check")
@click.option(
    "--file",
    "path",
    envvar="CONVEYOR_AUTH_TOKENS_FILE",
    default=None,
    help="A tokens file (env CONVEYOR_AUTH_TOKENS_FILE)",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a list")
def token_check(path: str | None, as_json: bool) -> None:
    """Check the tokens an api would load from CONVEYOR_AUTH_TOKENS and the tokens file,
    and list their names and roles (never their secrets). Exit 1 on a bad entry."""
    raw = os.environ.get("CONVEYOR_AUTH_TOKENS", "")
    entries = [entry.strip() for entry in raw.split(",") if entry.strip()]
    try:
        tokens = load_tokens(entries, path)
    except TokenError as exc:
        raise click.ClickException(str(exc)) from None
    if not tokens:
        raise click.ClickException(
            "no tokens: set CONVEYOR_AUTH_TOKENS or CONVEYOR_AUTH_TOKENS_FILE, or pass --file"
        )
    if as_json:
        emit_json([{"name": t.name, "role": t.role_text} for t in tokens])
        return
    width = max(len(t.name) for t in tokens)
    for t in tokens:
        click.echo(f"{t.name:<{width}}  {t.role_text}")
