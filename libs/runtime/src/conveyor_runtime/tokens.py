"""The api's bearer tokens: ``name:role:secret`` entries, parsed and checked once at start.

A token has a name (for logs and refusals: it is never secret), one role, and a secret,
which is what a client presents (``authorization: Bearer <secret>``). The roles:

- ``admin``: every call.
- ``producer``: TaskService (enqueue, get a task).
- ``worker``: WorkerService.Session on any queue; ``worker=<queue>+<queue>...`` limits
  the token to sessions whose Hello names only those queues.
- ``read-only``: the AdminService calls that only read (tasks, queues, webhook
  registrations, cluster info, WatchEvents).

Entries come from ``CONVEYOR_AUTH_TOKENS`` (comma-separated) and from
``CONVEYOR_AUTH_TOKENS_FILE`` (one a line, blank lines and ``#`` comment lines skipped).
A bare token without colons (the format before roles) is refused with a message saying
how to rewrite it: it would otherwise keep every power without anyone deciding so.

No error message ever contains a secret, nor a field that failed its check (a secret
written in the wrong place must not end up in a log): messages name the entry by its
place and, once it is known to be well formed, by its name. Only a SHA-256 digest of
each secret is kept, so every comparison is of two 32-byte strings and its time says
nothing about lengths.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from conveyor_broker.errors import InvalidTask
from conveyor_broker.validation import check_queue


class Role(StrEnum):
    """What a token may do."""

    ADMIN = "admin"
    PRODUCER = "producer"
    WORKER = "worker"
    READ_ONLY = "read-only"


#: Shortest secret accepted: 16 characters of the b64token alphabet.
MIN_SECRET_LENGTH = 16
#: Separates the queues of a limited worker role: ``worker=emails+reports``.
QUEUE_SEPARATOR = "+"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
#: RFC 6750's b64token alphabet: what fits in ``authorization: Bearer`` unquoted.
_SECRET_RE = re.compile(r"[A-Za-z0-9._~+/=-]+\Z")

#: The format, as every parse error explains it.
FORMAT = (
    "each token is name:role:secret; role is admin, producer, worker, "
    "worker=<queue>+<queue>... or read-only; the secret is at least "
    f"{MIN_SECRET_LENGTH} letters, digits or -._~+/= (`conveyor token new` makes one)"
)


class TokenError(ValueError):
    """A token entry that cannot be used. The message never contains a secret."""


def digest(secret: str | bytes) -> bytes:
    """The SHA-256 digest a secret is kept and compared as."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


@dataclass(frozen=True, slots=True)
class Token:
    """One configured token, without its secret."""

    name: str
    role: Role
    #: The queues a ``worker`` token may serve; None: any (and for every other role).
    queues: frozenset[str] | None = None
    #: SHA-256 of the secret (see :func:`digest`).
    secret_digest: bytes = field(default=b"", repr=False)

    @property
    def role_text(self) -> str:
        """The role as written in the entry: ``worker=emails+reports`` for a limited one."""
        if self.queues is None:
            return str(self.role)
        return f"{self.role}={QUEUE_SEPARATOR.join(sorted(self.queues))}"


def _role(text: str, where: str) -> tuple[Role, frozenset[str] | None]:
    base, equals, listed = text.partition("=")
    try:
        role = Role(base)
    except ValueError:
        raise TokenError(f"{where}: unknown role; {FORMAT}") from None
    if not equals:
        return role, None
    if role is not Role.WORKER:
        raise TokenError(f"{where}: only the worker role takes a list of queues; {FORMAT}")
    queues = listed.split(QUEUE_SEPARATOR)
    for queue in queues:
        try:
            check_queue(queue)
        except InvalidTask as exc:
            raise TokenError(f"{where}: worker role: {exc}") from None
    return role, frozenset(queues)


def parse_token(entry: str, where: str) -> Token:
    """The token an entry describes; TokenError (starting with ``where``) if it is not
    ``name:role:secret``."""
    entry = entry.strip()
    parts = entry.split(":", 2)
    if len(parts) == 1:
        raise TokenError(
            f"{where} is a bare token with no name or role, the format before roles; "
            f"{FORMAT}. To keep what it could do, write it as <name>:admin:<the token>, "
            "then narrow the role"
        )
    if len(parts) == 2:
        raise TokenError(f"{where} has one colon; {FORMAT}")
    name, role_text, secret = parts
    if not _NAME_RE.match(name):
        raise TokenError(
            f"{where}: the name must be 1-64 letters, digits, '_', '.' or '-', starting "
            f"with a letter or digit; {FORMAT}"
        )
    where = f"{where} (token {name!r})"
    role, queues = _role(role_text, where)
    if len(secret) < MIN_SECRET_LENGTH:
        raise TokenError(
            f"{where}: the secret has {len(secret)} characters; at least "
            f"{MIN_SECRET_LENGTH} are needed ({FORMAT})"
        )
    if not _SECRET_RE.match(secret):
        raise TokenError(
            f"{where}: the secret may hold only letters, digits and -._~+/= ({FORMAT})"
        )
    return Token(name=name, role=role, queues=queues, secret_digest=digest(secret))


def check_unique(tokens: Sequence[Token]) -> None:
    """TokenError if two tokens share a name or a secret (a secret must say who it is)."""
    by_name: dict[str, Token] = {}
    by_secret: dict[bytes, Token] = {}
    for token in tokens:
        if token.name in by_name:
            raise TokenError(f"two tokens are named {token.name!r}; names must be unique")
        same = by_secret.get(token.secret_digest)
        if same is not None:
            raise TokenError(
                f"tokens {same.name!r} and {token.name!r} have the same secret; "
                "every token needs its own"
            )
        by_name[token.name] = token
        by_secret[token.secret_digest] = token


def file_entries(path: str | Path) -> list[tuple[str, str]]:
    """``(where, entry)`` for every token line of a tokens file: one token a line, blank
    lines and lines starting with ``#`` skipped. TokenError if it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TokenError(f"cannot read the tokens file {str(path)!r}: {reason}") from None
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            entries.append((f"tokens file {str(path)!r} line {number}", stripped))
    return entries


def load_tokens(entries: Iterable[str], path: str | Path | None = None) -> tuple[Token, ...]:
    """Every token of ``entries`` (``CONVEYOR_AUTH_TOKENS``), then of the file at ``path``
    (``CONVEYOR_AUTH_TOKENS_FILE``); TokenError naming the first bad entry."""
    located = [
        (f"CONVEYOR_AUTH_TOKENS entry {n}", entry) for n, entry in enumerate(entries, start=1)
    ]
    if path:
        located += file_entries(path)
    tokens = [parse_token(entry, where) for where, entry in located]
    check_unique(tokens)
    return tuple(tokens)
