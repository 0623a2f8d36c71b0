"""Input checks: what :class:`~conveyor_broker.interface.Broker` runs before any
implementation sees a call, and what the api runs on requests before they reach a broker.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from urllib.parse import SplitResult, urlsplit

from conveyor_broker import cron
from conveyor_broker.errors import InvalidTask
from conveyor_broker.ids import is_ulid
from conveyor_broker.types import (
    BreakerConfig,
    BreakerScope,
    ConcurrencyLimit,
    CronEntrySpec,
    CronMisfire,
    GroupConfig,
    NewTask,
    RateLimit,
    WebhookWorkerSpec,
)

#: Queue (and webhook worker) names are single NATS subject tokens: 1-128 ASCII letters,
#: digits, '_' and '-', starting with a letter or digit. Always matched with
#: ``fullmatch``: ``match`` with a ``$`` anchor also takes a trailing newline ("q\n").
QUEUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
MAX_QUEUE_LEN = 128
MAX_TYPE_LEN = 256
MAX_KEY_LEN = 256
MAX_HEADERS = 64
MAX_HEADER_LEN = 4096
#: What no text field may hold: the C0 and C1 control characters (NUL included: Postgres
#: cannot store it in text), DEL, and lone surrogates (not encodable as UTF-8).
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")
#: The longest error text a task keeps (``last_error``): longer ones are cut.
MAX_ERROR_LEN = 4096
#: Default cap on one task's payload.
MAX_PAYLOAD = 1024 * 1024
MAX_RETRY_CAP = 1000
#: Most dependencies one task may wait for (a fan-in of this many parents to one child).
MAX_DEPENDENCIES = 10_000
_BYTES = (bytes, bytearray, memoryview)


def check_queue(queue: str) -> None:
    """Raise InvalidTask unless ``queue`` is a valid queue name (:data:`QUEUE_RE`)."""
    if not isinstance(queue, str) or not QUEUE_RE.fullmatch(queue):
        raise InvalidTask(
            f"invalid queue name {queue!r}: 1-128 ASCII letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )


def check_name_cursor(name: str) -> None:
    """Raise InvalidTask unless ``name`` can be a paging cursor over stored names (the last
    queue of a page). Looser than :func:`check_queue` on purpose: a name stored before the
    rules were strict must not stop paging past it."""
    if not isinstance(name, str) or not 0 < len(name) <= 4 * MAX_QUEUE_LEN or "\x00" in name:
        raise InvalidTask(f"malformed cursor {name!r}")


def check_text(name: str, value: str) -> None:
    """Raise InvalidTask when the text field ``name`` holds a control character (or a lone
    surrogate): see :data:`CONTROL_RE`."""
    # isprintable() is the fast path (a C loop): every control character is unprintable,
    # but so are a few allowed ones (U+00A0, U+200B, ...), which the regex then clears.
    if value.isprintable():
        return
    found = CONTROL_RE.search(value)
    if found is not None:
        raise InvalidTask(
            f"{name} contains the control character {found.group()!r} at index "
            f"{found.start()}: text fields may not hold U+0000-U+001F or U+007F-U+009F"
        )


def clean_error(text: str) -> str:
    """``text`` as a task's ``last_error`` keeps it: at most :data:`MAX_ERROR_LEN`
    characters, NUL and lone surrogates replaced by U+FFFD.

    Error texts come from workers and endpoints (an exception's message may well hold a
    NUL); the outcome must be stored whatever they say, so they are mended, not refused.
    """
    if len(text) > MAX_ERROR_LEN:
        text = text[: MAX_ERROR_LEN - 3] + "..."
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        text = _SURROGATE_RE.sub("\ufffd", text)
    return text


def check_task_id(task_id: str) -> None:
    """Raise InvalidTask unless ``task_id`` is a ULID string."""
    if not isinstance(task_id, str) or not is_ulid(task_id):
        raise InvalidTask(f"invalid task id {task_id!r}: expected a 26-character ULID")


def check_aware(name: str, value: datetime | None) -> None:
    """Raise InvalidTask when ``value`` is a naive datetime."""
    if value is not None and value.tzinfo is None:
        raise InvalidTask(f"{name} must be timezone-aware")


_ZERO = timedelta(0)


def check_lease_ttl(ttl: timedelta) -> None:
    """Raise InvalidTask unless a lease ``ttl`` is > 0."""
    if ttl <= _ZERO:
        raise InvalidTask(f"lease ttl must be > 0, got {ttl}")


def check_not_negative(name: str, value: timedelta) -> None:
    """Raise InvalidTask when the duration ``value`` is negative."""
    if value < _ZERO:
        raise InvalidTask(f"{name} must be >= 0, got {value}")


def check_batch_size(items: Sequence[object], *, upper: int) -> None:
    """Raise InvalidTask when a batch has more than ``upper`` items."""
    if len(items) > upper:
        raise InvalidTask(f"a batch holds at most {upper} items, got {len(items)}")


def check_cursor(cursor: str | None) -> None:
    """Raise InvalidTask unless ``cursor`` is None or a ListTasks cursor (a task id)."""
    if cursor is not None and (not isinstance(cursor, str) or not is_ulid(cursor)):
        raise InvalidTask(f"malformed cursor {cursor!r}")


def _check_positive(name: str, value: timedelta | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < _ZERO or (value == _ZERO and not allow_zero):
        raise InvalidTask(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_new_task(task: NewTask, *, max_payload: int = MAX_PAYLOAD) -> None:
    """Raise InvalidTask describing the first problem with ``task``."""
    check_queue(task.queue)
    if not isinstance(task.type, str) or not task.type or len(task.type) > MAX_TYPE_LEN:
        raise InvalidTask(f"task type must be 1-{MAX_TYPE_LEN} characters")
    check_text("task type", task.type)
    if task.id is not None:
        check_task_id(task.id)
    if not isinstance(task.payload, _BYTES):
        raise InvalidTask("payload must be bytes")
    if len(task.payload) > max_payload:
        raise InvalidTask(f"payload is {len(task.payload)} bytes; the limit is {max_payload}")
    if len(task.headers) > MAX_HEADERS:
        raise InvalidTask(f"at most {MAX_HEADERS} headers")
    for key, value in task.headers.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidTask("headers must map non-empty strings to strings")
        if len(key) + len(value) > MAX_HEADER_LEN:
            raise InvalidTask(f"header {key!r} is longer than {MAX_HEADER_LEN} characters")
        check_text("a header key", key)
        check_text(f"header {key!r}", value)
    if task.max_retry is not None and not 0 <= task.max_retry <= MAX_RETRY_CAP:
        raise InvalidTask(f"max_retry must be in 0..{MAX_RETRY_CAP}, got {task.max_retry}")
    _check_positive("timeout", task.timeout)
    _check_positive("retention", task.retention, allow_zero=True)
    _check_positive("unique_ttl", task.unique_ttl)
    check_aware("deadline", task.deadline)
    check_aware("process_at", task.process_at)
    check_aware("expires_at", task.expires_at)
    if task.unique_ttl is not None and not task.unique_key:
        raise InvalidTask("unique_ttl needs a unique_key")
    for name, key_value in (
        ("unique_key", task.unique_key),
        ("group", task.group),
        ("concurrency_key", task.concurrency_key),
    ):
        if key_value is None:
            continue
        if not isinstance(key_value, str) or not 0 < len(key_value) <= MAX_KEY_LEN:
            raise InvalidTask(f"{name} must be 1-{MAX_KEY_LEN} characters")
        check_text(name, key_value)
    if task.group is not None and task.concurrency_key is not None:
        # A group is leased whole, as one delivery: a key's slot per task has no meaning.
        raise InvalidTask("a task in an aggregation group cannot have a concurrency_key")
    if len(task.depends_on) > MAX_DEPENDENCIES:
        raise InvalidTask(
            f"a task depends on at most {MAX_DEPENDENCIES} tasks, got {len(task.depends_on)}"
        )
    for dep in task.depends_on:
        check_task_id(dep)
    if task.id is not None and task.id in task.depends_on:
        raise InvalidTask("a task cannot depend on itself")


def check_lease_wants(wants: Sequence[tuple[str, int]], *, upper: int) -> None:
    """A lease_many request: distinct valid queues, each limit 1..``upper``, and at most
    ``upper`` in all. Raises InvalidTask."""
    seen: set[str] = set()
    total = 0
    for queue, limit in wants:
        check_queue(queue)
        check_limit(limit, upper=upper)
        if queue in seen:
            raise InvalidTask(f"queue {queue!r} is asked for twice")
        seen.add(queue)
        total += limit
    if total > upper:
        raise InvalidTask(f"at most {upper} tasks in one lease, asked for {total}")


#: The longest holder name (see Broker.beat_holder).
MAX_HOLDER_LEN = 256


def check_holder(holder: str) -> None:
    """Raise InvalidTask unless ``holder`` is a holder name: 1..MAX_HOLDER_LEN characters,
    no control character."""
    if not isinstance(holder, str) or not 0 < len(holder) <= MAX_HOLDER_LEN:
        raise InvalidTask(f"a holder name has 1..{MAX_HOLDER_LEN} characters, got {holder!r}")
    check_text("holder", holder)


def check_holders(holders: Sequence[str], *, limit: int) -> None:
    """The holders of one queue's lease: at most ``limit``, each a holder name or ""
    (held by nobody). Raises InvalidTask."""
    if isinstance(holders, str):
        raise InvalidTask("holders is a sequence of names, not one name")
    if len(holders) > limit:
        raise InvalidTask(f"{len(holders)} holders for a lease of at most {limit} tasks")
    for holder in holders:
        if holder != "":
            check_holder(holder)


def check_batch(
    tasks: Sequence[NewTask], *, max_batch: int, max_payload: int = MAX_PAYLOAD
) -> None:
    """Check every task of a batch and its size."""
    if len(tasks) > max_batch:
        raise InvalidTask(f"a batch holds at most {max_batch} tasks, got {len(tasks)}")
    for index, task in enumerate(tasks):
        try:
            check_new_task(task, max_payload=max_payload)
        except InvalidTask as exc:
            raise InvalidTask(f"task {index}: {exc}") from None


def check_limit(limit: int, *, upper: int = 1000) -> None:
    """Raise InvalidTask unless 1 <= limit <= upper."""
    if not 1 <= limit <= upper:
        raise InvalidTask(f"limit must be in 1..{upper}, got {limit}")


#: Webhook registration limits.
MAX_WEBHOOK_CONCURRENCY = 10_000
MAX_WEBHOOK_SECRETS = 10
MAX_WEBHOOK_SECRET_LEN = 512
#: The shortest signing secret a registration takes, in bytes of key (Standard Webhooks
#: asks for 24 to 64; an HMAC-SHA256 key shorter than its 32-byte output wastes strength).
MIN_WEBHOOK_SECRET_BYTES = 32
#: The longest stored form of a secret (sealed: prefix, key id, nonce, tag, base64).
MAX_STORED_SECRET_LEN = 1024
WHSEC_PREFIX = "whsec_"
MAX_WEBHOOK_URL_LEN = 2048
MAX_WEBHOOK_TIMEOUT = timedelta(hours=1)
MAX_QUEUE_WEIGHT = 1000
#: The most task types a webhook registration takes as aggregation groups (as many as a
#: stream worker's Hello may list).
MAX_WEBHOOK_BATCH_TYPES = 100


def check_webhook_name(name: str) -> None:
    """Raise InvalidTask unless ``name`` is a valid webhook worker name (queue-name rules)."""
    if not isinstance(name, str) or not QUEUE_RE.fullmatch(name):
        raise InvalidTask(
            f"invalid webhook worker name {name!r}: 1-128 ASCII letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )


def check_webhook_worker(spec: WebhookWorkerSpec) -> None:
    """Raise InvalidTask unless ``spec`` is a registration a broker may store."""
    check_webhook_name(spec.name)
    parsed = _split_url(spec.url)
    if (
        parsed is None
        or parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or len(spec.url) > MAX_WEBHOOK_URL_LEN
    ):
        raise InvalidTask(f"invalid webhook url {spec.url!r}: an http:// or https:// URL")
    if not spec.queues:
        raise InvalidTask("a webhook worker serves at least one queue")
    for queue, weight in spec.queues.items():
        check_queue(queue)
        if not isinstance(weight, int) or not 1 <= weight <= MAX_QUEUE_WEIGHT:
            raise InvalidTask(f"weight of queue {queue!r} must be 1..{MAX_QUEUE_WEIGHT}")
    if (
        not isinstance(spec.concurrency, int)
        or not 1 <= spec.concurrency <= MAX_WEBHOOK_CONCURRENCY
    ):
        raise InvalidTask(f"webhook concurrency must be 1..{MAX_WEBHOOK_CONCURRENCY}")
    if not timedelta(0) < spec.timeout <= MAX_WEBHOOK_TIMEOUT:
        raise InvalidTask(f"webhook timeout must be > 0 and at most {MAX_WEBHOOK_TIMEOUT}")
    check_webhook_batch_types(spec.batch_types)
    check_stored_secrets(spec.secrets)


def check_webhook_batch_types(batch_types: Sequence[str]) -> None:
    """Raise InvalidTask unless ``batch_types`` can be a registration's batch types: at
    most :data:`MAX_WEBHOOK_BATCH_TYPES`, each a valid task type (1-256 characters, no
    control characters). Duplicates are allowed here: a broker stores each type once."""
    if isinstance(batch_types, str):
        raise InvalidTask("webhook batch types must be a list of task types, not one string")
    if len(batch_types) > MAX_WEBHOOK_BATCH_TYPES:
        raise InvalidTask(
            f"a webhook worker has at most {MAX_WEBHOOK_BATCH_TYPES} batch types, "
            f"got {len(batch_types)}"
        )
    for batch_type in batch_types:
        if not isinstance(batch_type, str) or not 0 < len(batch_type) <= MAX_TYPE_LEN:
            raise InvalidTask(
                f"invalid webhook batch type {str(batch_type)[:80]!r}: a task type of "
                f"1-{MAX_TYPE_LEN} characters"
            )
        check_text("webhook batch type", batch_type)


def unique_batch_types(batch_types: Sequence[str]) -> tuple[str, ...]:
    """``batch_types`` with each type once, in the order of first appearance."""
    return tuple(dict.fromkeys(batch_types))


def check_stored_secrets(secrets: Sequence[str]) -> None:
    """Raise InvalidTask unless ``secrets`` are what a broker may store for one
    registration."""
    if len(secrets) > MAX_WEBHOOK_SECRETS:
        raise InvalidTask(f"a webhook worker has at most {MAX_WEBHOOK_SECRETS} secrets")
    for secret in secrets:
        # Stored forms: sealed by the api (conveyor_runtime.webhook_secrets), or plaintext
        # from before. What an operator may register is check_webhook_secret's business.
        if not isinstance(secret, str) or not 1 <= len(secret) <= MAX_STORED_SECRET_LEN:
            raise InvalidTask(f"a stored webhook secret is 1..{MAX_STORED_SECRET_LEN} characters")
        if CONTROL_RE.search(secret):
            # Not check_text: its message would quote part of the secret.
            raise InvalidTask("a webhook secret may not hold control characters")


def check_webhook_secret(secret: str) -> None:
    """Raise InvalidTask unless ``secret`` is a signing secret an operator may register:
    ``whsec_`` + the standard base64 of at least :data:`MIN_WEBHOOK_SECRET_BYTES` bytes
    (the Standard Webhooks form), or any other text of at least that many UTF-8 bytes, at
    most :data:`MAX_WEBHOOK_SECRET_LEN` characters, no control characters. The message
    never quotes the secret."""
    if not isinstance(secret, str) or not secret:
        raise InvalidTask("a webhook secret may not be empty")
    if len(secret) > MAX_WEBHOOK_SECRET_LEN:
        raise InvalidTask(f"a webhook secret is at most {MAX_WEBHOOK_SECRET_LEN} characters")
    if CONTROL_RE.search(secret):
        raise InvalidTask("a webhook secret may not hold control characters")
    rule = (
        f"a webhook secret must hold at least {MIN_WEBHOOK_SECRET_BYTES} bytes: "
        f"whsec_ followed by the base64 of {MIN_WEBHOOK_SECRET_BYTES} random bytes "
        "(`conveyor webhook new-secret` makes one), or a text of at least "
        f"{MIN_WEBHOOK_SECRET_BYTES} bytes"
    )
    if secret.startswith(WHSEC_PREFIX):
        try:
            key = base64.b64decode(secret[len(WHSEC_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raise InvalidTask(
                "a whsec_ webhook secret is whsec_ followed by standard base64 (A-Z, a-z, "
                "0-9, '+', '/', '=' padding)"
            ) from None
        if len(key) < MIN_WEBHOOK_SECRET_BYTES:
            raise InvalidTask(f"{rule}; this one decodes to {len(key)}")
    elif len(secret.encode()) < MIN_WEBHOOK_SECRET_BYTES:
        raise InvalidTask(f"{rule}; this one has {len(secret.encode())}")


def _split_url(url: object) -> SplitResult | None:
    """``url`` split, or None when it is not a URL text field may hold."""
    if not isinstance(url, str) or CONTROL_RE.search(url):
        return None
    try:
        return urlsplit(url)
    except ValueError:  # e.g. a malformed IPv6 host, or an out-of-range port
        return None


def check_cron_name(name: str) -> None:
    """Raise InvalidTask unless ``name`` is a valid cron entry name (queue-name rules)."""
    if not isinstance(name, str) or not QUEUE_RE.fullmatch(name):
        raise InvalidTask(
            f"invalid cron entry name {name!r}: 1-128 ASCII letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )


def check_cron_entry(spec: CronEntrySpec, *, max_payload: int = MAX_PAYLOAD) -> None:
    """Raise InvalidTask unless ``spec`` is a cron entry a broker may store: a valid name,
    schedule and time zone (:class:`conveyor_broker.cron.CronSchedule`), a misfire policy,
    and a task template that makes valid tasks and sets none of what each slot's task gets
    of its own (id, unique key and TTL, the cron headers) or what makes no sense for a
    recurring task (absolute times, dependencies)."""
    check_cron_name(spec.name)
    cron.CronSchedule.parse(spec.schedule, spec.timezone)
    if not isinstance(spec.misfire, CronMisfire):
        raise InvalidTask(f"unknown misfire policy {spec.misfire!r}: run_once or skip")
    template = spec.task
    if not isinstance(template, NewTask):
        raise InvalidTask("a cron entry needs a task template")
    refused = {
        "an id": template.id is not None,
        "a unique key": template.unique_key is not None,
        "a unique TTL": template.unique_ttl is not None,
        "process_at": template.process_at is not None,
        "a deadline": template.deadline is not None,
        "expires_at": template.expires_at is not None,
        "dependencies": bool(template.depends_on),
    }
    for what, present in refused.items():
        if present:
            raise InvalidTask(
                f"a cron entry's task may not set {what}: each slot's task gets its own id "
                "and unique key, and options relative to when it is created"
            )
    reserved = sorted(cron.RESERVED_HEADERS & set(template.headers))
    if reserved:
        raise InvalidTask(f"header {reserved[0]!r} is set by the server on cron tasks")
    sample = cron.slot_task(spec.name, template, datetime(2000, 1, 1, tzinfo=UTC))
    try:
        check_new_task(sample, max_payload=max_payload)
    except InvalidTask as exc:
        raise InvalidTask(f"cron task: {exc}") from None


#: The most members one group delivery carries (one lease, one frame).
MAX_GROUP_SIZE = 1000
#: The longest a group may be held back.
MAX_GROUP_WAIT = timedelta(days=1)
_PATTERN_RE = re.compile(r"[^\x00-\x1f\x7f]{1,256}")


def check_group_name(group: str) -> None:
    """Raise InvalidTask unless ``group`` is a valid group name (a task's group key)."""
    if not isinstance(group, str) or not 0 < len(group) <= MAX_KEY_LEN:
        raise InvalidTask(f"group must be 1-{MAX_KEY_LEN} characters")
    check_text("group", group)


def check_group_pattern(pattern: str) -> None:
    """Raise InvalidTask unless ``pattern`` is a group name glob (1-256 characters, no
    control characters)."""
    if not isinstance(pattern, str) or not _PATTERN_RE.fullmatch(pattern):
        raise InvalidTask("a group pattern is 1-256 characters, '*' and '?' as wildcards")
    check_text("group pattern", pattern)


def check_key_pattern(pattern: str) -> None:
    """Raise InvalidTask unless ``pattern`` is a concurrency key glob (1-256 characters,
    no control characters)."""
    if not isinstance(pattern, str) or not _PATTERN_RE.fullmatch(pattern):
        raise InvalidTask("a key pattern is 1-256 characters, '*' and '?' as wildcards")
    check_text("key pattern", pattern)


#: The highest per-key limit of a concurrency limit.
MAX_PER_KEY = 1_000_000


def check_concurrency_limit(limit: ConcurrencyLimit) -> None:
    """Raise InvalidTask unless ``limit`` is one a broker may store: a queue, a key
    pattern and a whole per-key limit of 1..MAX_PER_KEY."""
    check_queue(limit.queue)
    check_key_pattern(limit.pattern)
    n = limit.per_key
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PER_KEY:
        raise InvalidTask(f"per_key must be a whole number 1..{MAX_PER_KEY}, got {n!r}")


#: Bounds of a breaker config.
MAX_BREAKER_FAILURES = 10_000
MIN_BREAKER_WINDOW = timedelta(seconds=1)
MAX_BREAKER_WINDOW = timedelta(days=1)
MIN_BREAKER_COOLDOWN = timedelta(milliseconds=100)
MAX_BREAKER_COOLDOWN = timedelta(days=1)


def check_type_pattern(pattern: str) -> None:
    """Raise InvalidTask unless ``pattern`` is a task type glob (1-256 characters, no
    control characters)."""
    if not isinstance(pattern, str) or not _PATTERN_RE.fullmatch(pattern):
        raise InvalidTask("a type pattern is 1-256 characters, '*' and '?' as wildcards")
    check_text("type pattern", pattern)


def check_breaker_config(config: BreakerConfig) -> None:
    """Raise InvalidTask unless ``config`` is one a broker may store."""
    check_queue(config.queue)
    check_type_pattern(config.pattern)
    n = config.failures
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BREAKER_FAILURES:
        raise InvalidTask(f"failures must be a whole number 1..{MAX_BREAKER_FAILURES}, got {n!r}")
    bounds = {
        "window": (MIN_BREAKER_WINDOW, MAX_BREAKER_WINDOW),
        "cooldown": (MIN_BREAKER_COOLDOWN, MAX_BREAKER_COOLDOWN),
    }
    for name, (low, high) in bounds.items():
        value = getattr(config, name)
        if not isinstance(value, timedelta) or not low <= value <= high:
            raise InvalidTask(f"{name} must be {low} .. {high}, got {value}")
    if not isinstance(config.scope, BreakerScope):
        raise InvalidTask(f"scope must be worker or queue, got {config.scope!r}")


def check_group_config(config: GroupConfig) -> None:
    """Raise InvalidTask unless ``config`` is one a broker may store."""
    check_queue(config.queue)
    check_group_pattern(config.pattern)
    if (
        isinstance(config.max_size, bool)
        or not isinstance(config.max_size, int)
        or not 1 <= config.max_size <= MAX_GROUP_SIZE
    ):
        raise InvalidTask(f"max_size must be 1..{MAX_GROUP_SIZE}, got {config.max_size!r}")
    for name in ("max_delay", "grace_period"):
        value = getattr(config, name)
        if not isinstance(value, timedelta) or not _ZERO < value <= MAX_GROUP_WAIT:
            raise InvalidTask(f"{name} must be > 0 and at most {MAX_GROUP_WAIT}, got {value}")


#: The highest rate and burst a queue's rate limit may have.
MAX_RATE = 1_000_000


def check_rate_limit(limit: RateLimit) -> None:
    """Raise InvalidTask unless ``limit`` is one a broker may store: a finite rate
    above 0 and at most :data:`MAX_RATE` a second, a whole burst of 1..MAX_RATE."""
    check_queue(limit.queue)
    rate = limit.per_second
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or not math.isfinite(rate)
        or not 0 < rate <= MAX_RATE
    ):
        raise InvalidTask(f"per_second must be > 0 and at most {MAX_RATE}, got {rate!r}")
    burst = limit.burst
    if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_RATE:
        raise InvalidTask(f"burst must be a whole number 1..{MAX_RATE}, got {burst!r}")
