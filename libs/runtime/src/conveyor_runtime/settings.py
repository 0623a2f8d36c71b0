"""Service settings: one object per service, read from flags and ``CONVEYOR_*`` variables.

Precedence: command-line flag, then environment variable, then default. Every field of a
settings class is a flag (``--lease-ttl 30``) and a variable (``CONVEYOR_LEASE_TTL=30``);
durations are seconds.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Annotated, Literal, Self
from urllib.parse import urlsplit

from conveyor_broker.keyring import Keyring
from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from conveyor_runtime.cluster_key import ClusterKeyError, parse_keys, read_key_file
from conveyor_runtime.tls import check_links, check_rest_tls, check_server_tls, is_loopback
from conveyor_runtime.tokens import Token, load_tokens
from conveyor_runtime.webhook_secrets import SecretKeyring
from conveyor_runtime.webhook_urls import AddressPolicy, parse_networks


def default_instance_id() -> str:
    """``<host>-<pid>-<random>``: unique per process, readable in logs."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class CommonSettings(BaseSettings):
    """Settings every service shares."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_",
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        # Settings hold secrets (the cluster key, tokens, passwords): an error names the
        # setting and the problem, never the value.
        hide_input_in_errors=True,
    )

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL(s), comma-separated (a cluster's nodes: the client "
        "fails over between them)",
    )
    nats_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="Copies of the ownership and leaders KV buckets a NATS cluster keeps "
        "(3 on a 3-node JetStream cluster, so a bucket outlives a node; 1 on a single "
        "server); applies when a bucket is created",
    )
    subject_prefix: str = Field(
        "conveyor", description="Prefix of every NATS subject and KV bucket"
    )
    broker: Literal["postgres", "memory"] = Field(
        "postgres", description="Broker driver; memory only makes sense inside `conveyor dev`"
    )
    dsn: str = Field(
        "postgresql://postgres@127.0.0.1:5432/conveyor",
        description="PostgreSQL DSN (postgres broker)",
    )
    db_pool_size: int = Field(10, ge=1, description="Postgres connection pool size")
    db_statement_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds a Postgres statement may run before the server cancels it "
        "(the session's statement_timeout; storage upkeep's VACUUM is exempt; 0: none)",
    )
    db_command_timeout: float = Field(
        60.0,
        ge=0,
        description="Seconds to wait for Postgres to answer a call before the connection "
        "is given up as wedged (canceled, else closed) and the call fails as unavailable; "
        "keep it above db_statement_timeout (0: none)",
    )
    db_acquire_timeout: float = Field(
        10.0,
        ge=0,
        description="Seconds a call waits for a free pool connection before it fails as "
        "unavailable (0: no limit)",
    )
    db_connect_timeout: float = Field(
        10.0, gt=0, description="Seconds to open one Postgres connection"
    )
    auto_migrate: bool = Field(
        True, description="Apply pending database migrations at start (postgres broker)"
    )
    instance_id: str = Field(
        default_factory=default_instance_id, description="This process's name in the cluster"
    )
    stop_grace: float = Field(
        30.0,
        gt=0,
        description="Seconds a service may take to stop after SIGTERM/SIGINT before it is "
        "cut short (exit code 1); start-up waits (for NATS, Postgres) end at once",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level")
    log_format: Literal["text", "json"] = Field("text", description="Log format")
    lease_ttl: float = Field(
        30.0, gt=0, description="Seconds a dispatched task stays leased without a heartbeat"
    )
    otlp_endpoint: str | None = Field(
        None,
        description="Export OpenTelemetry traces over OTLP/gRPC to this endpoint "
        "(e.g. http://jaeger:4317); unset: no tracing",
    )
    trace_sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of the traces that start in this process to record (0 to 1; a "
        "task's trace is sampled once, where it starts, and every later hop follows)",
    )
    health_file: str | None = Field(
        None,
        description="Touch this file every few seconds while the service can do its job: "
        "connected to NATS, its broker answering, and its ownership or leaders bucket not "
        "failing for 3 TTLs (for `conveyor health`)",
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics at http://<metrics_host>:<port>/metrics "
        "(0: no metrics server)",
    )
    metrics_host: str = Field("0.0.0.0", description="Listen address of the metrics server")
    events: Literal["on_demand", "always"] = Field(
        "on_demand",
        description="Publish lifecycle events to NATS only while someone watches them "
        "(WatchEvents announces itself), or always (for your own NATS consumers)",
    )
    allow_plaintext: bool = Field(
        False,
        description="Knowingly allow links without TLS beyond this machine: the api's port "
        "without a certificate, NATS or Postgres on a non-loopback host without TLS (dev "
        "mode sets this)",
    )
    nats_tls_ca: str | None = Field(
        None,
        description="CA bundle (PEM file) that verifies the NATS server; setting any "
        "nats_tls_* (or a tls:// URL) makes TLS mandatory (unset: the system's CAs)",
    )
    nats_tls_cert: str | None = Field(
        None, description="Client certificate (PEM file) for a NATS server that asks for one"
    )
    nats_tls_key: str | None = Field(None, description="Private key (PEM file) of nats_tls_cert")
    nats_user: str | None = Field(None, description="NATS user name (with nats_password)")
    nats_password: str | None = Field(None, description="NATS password of nats_user")
    nats_token: str | None = Field(None, description="NATS authentication token")
    nats_nkey_seed: str | None = Field(
        None, description="File holding this service's NATS nkey seed (nkey authentication)"
    )
    nats_creds: str | None = Field(
        None, description="NATS credentials file (user JWT and nkey seed, decentralized auth)"
    )
    db_sslmode: Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"] | (
        None
    ) = Field(
        None,
        description="Postgres TLS mode, as libpq's sslmode (unset: the DSN's sslmode, "
        "else prefer); verify-full checks the certificate and the host name",
    )
    db_sslrootcert: str | None = Field(
        None,
        description="CA bundle (PEM file) that verifies the Postgres server (unset with "
        "verify-ca/verify-full: the system's CAs)",
    )
    db_sslcert: str | None = Field(
        None, description="Client certificate (PEM file) for Postgres certificate authentication"
    )
    db_sslkey: str | None = Field(None, description="Private key (PEM file) of db_sslcert")
    cluster_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="The key the services seal their NATS messages with (base64, at least "
        "32 bytes; the same on every service; `conveyor cluster-key` makes one); "
        "comma-separated for a rotation: the first signs, every one verifies",
    )
    cluster_key_file: str | None = Field(
        None,
        description="File holding the cluster key(s) instead, one per line (the first "
        "signs); read at start",
    )
    allow_unsigned: bool = Field(
        False,
        description="Knowingly run without a cluster key, or accept unsealed NATS messages "
        "while a cluster key is rolled out (a wrong seal is refused all the same)",
    )
    encryption_keys: SecretStr | None = Field(
        None,
        description="Encrypt task payloads, header values, results, progress and errors at "
        "rest (AES-256-GCM): keys as <id>:<base64 of 32 bytes>, comma-separated, the one "
        "that encrypts marked *<id> (every one decrypts; `conveyor keys new` makes one); "
        "the same on every service (unset: stored in clear)",
    )
    encryption_keys_file: str | None = Field(
        None,
        description="File holding encryption_keys' value instead (one key a line, # "
        "comments); read at start",
    )

    @field_validator("cluster_key", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        # Environment variables carry a comma-separated list, not JSON.
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @model_validator(mode="after")
    def _links_fail_closed(self) -> Self:
        check_links(self)
        return self

    @model_validator(mode="after")
    def _cluster_keys_decode(self) -> Self:
        if self.cluster_key and self.cluster_key_file:
            raise ValueError(
                "CONVEYOR_CLUSTER_KEY and CONVEYOR_CLUSTER_KEY_FILE are both set: set one"
            )
        if self.cluster_key_file:
            parse_keys(read_key_file(self.cluster_key_file), source="CONVEYOR_CLUSTER_KEY_FILE")
        else:
            parse_keys(self.cluster_key)
        return self

    @model_validator(mode="after")
    def _encryption_keys_load(self) -> Self:
        self.encryption_keyring()
        return self

    def encryption_keyring(self) -> Keyring | None:
        """The keys of encryption at rest (None: not configured). Raises KeyringError (a
        ValueError) when the setting is malformed or its file unreadable; the message
        never quotes key material."""
        value = self.encryption_keys.get_secret_value() if self.encryption_keys else None
        return Keyring.load(value, self.encryption_keys_file)

    @property
    def lease_ttl_delta(self) -> timedelta:
        """``lease_ttl`` as a timedelta."""
        return timedelta(seconds=self.lease_ttl)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> Self:
        """Settings from ``argv`` flags (None: no flags) over the environment."""
        if argv is None:
            return cls()
        return cls(_cli_parse_args=list(argv))


class ServiceSettings(CommonSettings):
    """Settings of a service that talks over NATS (every one but ``conveyor migrate``):
    it needs the cluster key."""

    @model_validator(mode="after")
    def _cluster_key_fails_closed(self) -> Self:
        if not self.cluster_key and not self.cluster_key_file and not self.allow_unsigned:
            raise ClusterKeyError(
                "no cluster key: set CONVEYOR_CLUSTER_KEY or CONVEYOR_CLUSTER_KEY_FILE (the "
                "same on every service; `conveyor cluster-key` makes one) or, knowingly, "
                "CONVEYOR_ALLOW_UNSIGNED=true"
            )
        return self


class WebhookAccessSettings(ServiceSettings):
    """What the api (registrations, callbacks) and the webhook service (deliveries) both
    need to know about webhooks: where deliveries may go, and the keys of the secrets."""

    webhook_allow_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Networks webhook URLs may point at beyond public addresses, "
        "comma-separated (e.g. 10.1.0.0/16,127.0.0.1/32); loopback, link-local, private, "
        "reserved and this server's own addresses are refused otherwise (`conveyor dev` "
        "allows loopback)",
    )
    webhook_secret_key: SecretStr | None = Field(
        None,
        description="Keys that encrypt webhook secrets at rest: <id>:<base64 of 32 bytes>, "
        "comma-separated, newest first (the first encrypts, all decrypt); needed by the api "
        "and the webhook service (`conveyor dev` makes one per run)",
    )
    webhook_secret_key_file: str | None = Field(
        None, description="File holding webhook_secret_key's value (one key a line)"
    )

    @field_validator("webhook_allow_networks", mode="before")
    @classmethod
    def _split_networks(cls, value: object) -> object:
        # Environment variables carry a comma-separated list, not JSON.
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("webhook_allow_networks")
    @classmethod
    def _networks_parse(cls, value: list[str]) -> list[str]:
        parse_networks(value)
        return value

    @model_validator(mode="after")
    def _keys_load(self) -> Self:
        self.secret_keyring()
        return self

    def address_policy(self) -> AddressPolicy:
        """Where webhook deliveries may connect (public addresses, plus the allow-list)."""
        return AddressPolicy.from_networks(self.webhook_allow_networks)

    def secret_keyring(self) -> SecretKeyring:
        """The keys of the webhook secrets (empty when none is configured). Raises
        ValueError when the setting is malformed or its file unreadable."""
        key = self.webhook_secret_key.get_secret_value() if self.webhook_secret_key else None
        return SecretKeyring.load(key, self.webhook_secret_key_file)


class ApiSettings(WebhookAccessSettings):
    """services/api: TaskService, WorkerService, AdminService."""

    host: str = Field("0.0.0.0", description="gRPC listen address")
    port: int = Field(50051, ge=0, le=65535, description="gRPC listen port (0: any free port)")
    register_tick: float = Field(
        5.0, gt=0, description="Seconds between a gateway's capacity re-announcements"
    )
    holder_beat: float = Field(
        1.0,
        ge=0,
        description="Seconds between this process's liveness beats (a row in the broker and "
        "a NATS message); once both stop for maintenance's holder_silence, the reaper "
        "releases the tasks its workers held (0: no beats, its tasks come back only at "
        "lease expiry)",
    )
    max_payload: int = Field(1024 * 1024, gt=0, description="Largest task payload in bytes")
    max_result: int = Field(1024 * 1024, gt=0, description="Largest task result in bytes")
    outcome_backlog: int = Field(
        0,
        ge=0,
        description="Outcomes of one worker whose commit failed and are being retried at "
        "which its gateway takes no new work, until half of them have committed (0: the "
        "worker's concurrency)",
    )
    default_max_retry: int = Field(25, ge=0, description="max_retry of a task that does not set it")
    default_retention: float = Field(
        86400.0, ge=0, description="Seconds a completed task is kept when it sets no retention"
    )
    timeout_grace: float = Field(
        5.0,
        ge=0,
        description="Seconds past an attempt's timeout or deadline before the server cancels "
        "it and fails the attempt itself",
    )
    min_sdk_version: str = Field(
        "0.1.0",
        description="Oldest Python SDK (sdk_name conveyor-python) version accepted; other SDKs' "
        "versions are not compared",
    )
    cluster_info_window: float = Field(
        0.25,
        gt=0,
        le=10,
        description="Seconds GetClusterInfo waits for every service process to describe "
        "itself over NATS (a process that answers later is left out of that answer)",
    )
    max_concurrent_rpcs: int = Field(
        10000,
        ge=0,
        description="Most gRPC calls the api serves at once, worker sessions and event "
        "watches included; one more is refused with RESOURCE_EXHAUSTED (0: no limit)",
    )
    session_max_pending_frames: int = Field(
        1000,
        ge=1,
        description="Most frames waiting to be written to one worker session; past it the "
        "worker is taken as not reading: its session ends (RESOURCE_EXHAUSTED) and its "
        "tasks are released",
    )
    session_write_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds one write to a worker session may stay blocked (the worker "
        "not reading) before the session ends and its tasks are released",
    )
    enqueue_batch_window: float = Field(
        0.002,
        ge=0,
        description="Longest an enqueue waits behind a commit in flight before it starts "
        "its own (an enqueue with no commit in flight goes at once)",
    )
    enqueue_batch_max: int = Field(
        500, ge=1, le=1000, description="Most enqueues in one group commit"
    )
    enqueue_backlog_limit: int = Field(
        0,
        ge=0,
        description="Admission control: a queue holding this many due tasks takes no new "
        "task until its backlog falls under it; an enqueue waits up to "
        "CONVEYOR_ENQUEUE_ADMISSION_WAIT, then gets RESOURCE_EXHAUSTED (0: no limit)",
    )
    enqueue_admission_wait: float = Field(
        5.0,
        ge=0,
        description="Seconds an enqueue into a queue at its backlog limit waits for room "
        "before RESOURCE_EXHAUSTED",
    )
    auth_tokens: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Bearer tokens, comma-separated, each name:role:secret; roles admin, "
        "producer, worker, worker=<queue>+<queue>..., read-only (README, Tokens and roles; "
        "empty: see allow_unauthenticated)",
    )
    auth_tokens_file: str | None = Field(
        None,
        description="A file of tokens, one name:role:secret a line (# comments), read at "
        "start, in addition to auth_tokens: keeps secrets out of process lists and "
        "environment dumps",
    )
    allow_unauthenticated: bool = Field(
        False, description="Run without auth tokens (dev mode sets this)"
    )
    read_only: bool = Field(False, description="Reject AdminService mutations, for every token")
    tls_cert: str | None = Field(
        None, description="Certificate chain (PEM file) the gRPC port presents (with tls_key)"
    )
    tls_key: str | None = Field(None, description="Private key (PEM file) of tls_cert")
    tls_client_ca: str | None = Field(
        None,
        description="CA bundle (PEM file): clients must present a certificate it signed "
        "(mutual TLS)",
    )

    _tokens: tuple[Token, ...] = PrivateAttr(default=())

    @field_validator("auth_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        # Environment variables carry a comma-separated list, not JSON.
        if isinstance(value, str):
            return [token.strip() for token in value.split(",") if token.strip()]
        return value

    @model_validator(mode="after")
    def _port_fails_closed(self) -> Self:
        check_server_tls(self)
        return self

    @model_validator(mode="after")
    def _load_tokens_and_fail_closed(self) -> Self:
        entries = [secret.get_secret_value() for secret in self.auth_tokens]
        self._tokens = load_tokens(entries, self.auth_tokens_file)
        if not self._tokens and not self.allow_unauthenticated:
            raise ValueError(
                "no auth tokens configured: set CONVEYOR_AUTH_TOKENS or "
                "CONVEYOR_AUTH_TOKENS_FILE (name:role:secret tokens) or, knowingly, "
                "CONVEYOR_ALLOW_UNAUTHENTICATED=true"
            )
        return self

    @property
    def tokens(self) -> tuple[Token, ...]:
        """Every configured token, parsed (no secrets: their digests)."""
        return self._tokens


class DispatcherSettings(ServiceSettings):
    """services/dispatcher: one dispatch loop per owned queue."""

    batch_max: int = Field(100, ge=1, le=1000, description="Most tasks leased in one round trip")
    owner_ttl: float = Field(
        5.0, gt=0, description="Seconds a queue-ownership key lives without a refresh"
    )
    idle_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a queue no gateway serves (no registration, nothing leased) is "
        "kept before it is given up, however much work waits in it",
    )
    dispatch_timeout: float = Field(
        2.0, gt=0, description="Seconds to wait for a gateway's dispatch reply"
    )
    register_tick: float = Field(
        5.0,
        gt=0,
        description="Gateways' re-registration period; a registration not refreshed "
        "for 3 ticks is forgotten",
    )
    peer_beat: float = Field(
        0.25, gt=0, description="Seconds between this dispatcher's liveness beats on NATS"
    )
    peer_silence: float = Field(
        1.0,
        gt=0,
        description="Seconds without a beat after which another dispatcher is taken as "
        "dead and the queues it owned are taken over at once (instead of when their "
        "ownership keys expire, owner_ttl); keep it at 3 peer_beat or more",
    )
    progress_deadline: float = Field(
        30.0,
        gt=0,
        description="Seconds one round of a queue's lease cycle (lease, dispatch, release) "
        "may take; past it (a wedged database connection, say) this instance gives the "
        "queue up so that another dispatcher takes it over",
    )

    @model_validator(mode="after")
    def _peers_beat_within_their_silence(self) -> Self:
        if self.peer_silence <= 2 * self.peer_beat:
            raise ValueError(
                f"peer_silence ({self.peer_silence}) must be more than twice peer_beat "
                f"({self.peer_beat}): one late beat would make a live dispatcher look dead"
            )
        return self


class MaintenanceSettings(ServiceSettings):
    """services/maintenance: scheduler, reaper, dependency resolver and storage upkeep
    (leader-elected)."""

    promote_tick: float = Field(
        1.0,
        gt=0,
        description="Seconds between scheduler passes (the api's promote hint for a "
        "delayed task that falls due runs one at once)",
    )
    reap_tick: float = Field(1.0, gt=0, description="Seconds between reaper passes")
    group_tick: float = Field(
        0.5,
        gt=0,
        description="Seconds between group sweeper passes (aggregation groups past their "
        "size, max delay or grace period are handed to their queue's dispatcher): a due "
        "group waits at most this long",
    )
    depth_tick: float = Field(
        10.0,
        gt=0,
        description="Seconds between refreshes of the queue depth gauges (the reaper "
        "leader: a count by state per served queue)",
    )
    register_tick: float = Field(
        5.0,
        gt=0,
        description="Gateways' re-registration period (as the api's): the reaper wakes "
        "only queues some gateway registered on within 3 ticks",
    )
    holder_silence: float = Field(
        3.0,
        gt=0,
        description="Seconds an api process may go without a liveness beat (in the broker "
        "and on NATS, see the api's holder_beat) before the reaper takes it as dead and "
        "releases the tasks its workers held, due at once, with no attempt spent; keep it "
        "at 3 holder_beat or more",
    )
    leader_ttl: float = Field(
        5.0, gt=0, description="Seconds a leadership key lives without a refresh"
    )
    archive_retention: float = Field(
        7 * 86400.0, ge=0, description="Seconds archived and canceled tasks are kept"
    )
    default_retention: float = Field(
        86400.0, ge=0, description="Seconds a completed task is kept when it sets no retention"
    )
    sweep_limit: int = Field(1000, ge=1, description="Most rows one sweep touches")
    cron_misfire_grace: float = Field(
        60.0,
        ge=0,
        description="Seconds a cron slot may be late and still fire as usual; a slot the "
        "scheduler comes to later than that was missed (the cluster was down), and its "
        "entry's misfire policy applies",
    )
    resolve_sweep_age: float = Field(
        2.0,
        ge=0,
        description="Seconds the reaper leaves an ended task's dependents to the resolver "
        "before its sweep resolves them itself (a lost Resolve, a resolver that died)",
    )
    storage_upkeep: bool = Field(
        True,
        description="ANALYZE and VACUUM the task table when a burst has left its planner "
        "statistics or its indexes behind, sooner than autovacuum would",
    )
    storage_tick: float = Field(
        2.0, gt=0, description="Seconds between checks of the task table's counters"
    )


class WebhookSettings(WebhookAccessSettings):
    """services/webhook: webhook workers."""

    reconcile_tick: float = Field(5.0, gt=0, description="Seconds between registration reconciles")
    leader_ttl: float = Field(
        5.0, gt=0, description="Seconds the webhook-manager leadership key lives without a refresh"
    )
    register_tick: float = Field(
        5.0, gt=0, description="Seconds between a webhook gateway's capacity re-announcements"
    )
    max_result: int = Field(
        1024 * 1024, gt=0, description="Largest task result in bytes an endpoint may return"
    )
    callback_address: str = Field(
        "",
        description="The api's public gRPC address, sent to endpoints as the callback for "
        "WebhookService: https://host:port when the api speaks TLS (empty: none)",
    )
    breaker_threshold: int = Field(
        5,
        ge=1,
        description="Consecutive transport failures (connect error, timeout, 5xx) of an "
        "endpoint before its circuit breaker opens",
    )
    breaker_cooldown: float = Field(
        30.0,
        gt=0,
        description="Seconds an open circuit breaker announces no capacity before it lets "
        "a single probe delivery through",
    )


class BlobStoreSettings(CommonSettings):
    """Where the build-event CAS sink's blobs live: what the ingest (``bep``) writes to
    and the web UI (``bep-web``) serves downloads from, so both read these settings."""

    bep_blob_root: str | None = Field(
        None,
        description="Directory of the built-in CAS sink's blobs (<root>/<key prefix>/aa/bb/"
        "<sha256>); unset: no CAS sink (its services answer UNIMPLEMENTED), unless "
        "bep_blob_store is s3, where it only stages uploads (unset: the system's temp "
        "directory)",
    )
    bep_blob_store: Literal["disk", "s3"] = Field(
        "disk",
        description="Where the CAS sink keeps blob bytes: disk (bep_blob_root) or s3 (an "
        "S3-compatible bucket, objects <key prefix>/<sha256>: bep_s3_*)",
    )
    bep_s3_endpoint: str | None = Field(
        None,
        description="S3-compatible endpoint URL, e.g. https://s3.eu-west-1.amazonaws.com "
        "or http://127.0.0.1:9000 (path-style requests: <endpoint>/<bucket>/<key>)",
    )
    bep_s3_bucket: str | None = Field(None, description="Bucket of the CAS sink's blobs")
    bep_s3_region: str = Field(
        "us-east-1", description="Region the S3 requests are signed for (SigV4)"
    )
    bep_s3_access_key_id: str | None = Field(None, description="S3 access key id")
    bep_s3_secret_access_key: SecretStr | None = Field(
        None, description="S3 secret access key of bep_s3_access_key_id"
    )

    @model_validator(mode="after")
    def _s3_complete(self) -> Self:
        if self.bep_blob_store != "s3":
            return self
        needed = ("bep_s3_endpoint", "bep_s3_bucket", "bep_s3_access_key_id")
        missing = [name for name in needed if not getattr(self, name)]
        secret = self.bep_s3_secret_access_key
        if secret is None or not secret.get_secret_value():
            missing.append("bep_s3_secret_access_key")
        if missing:
            raise ValueError(f"bep_blob_store=s3 needs {', '.join(missing)}")
        endpoint = urlsplit(self.bep_s3_endpoint or "")
        if endpoint.scheme not in ("http", "https") or not endpoint.hostname:
            raise ValueError("bep_s3_endpoint must be an http(s) URL")
        if (
            endpoint.scheme == "http"
            and not self.allow_plaintext
            and not is_loopback(endpoint.hostname)
        ):
            raise ValueError(
                f"bep_s3_endpoint is plain HTTP to {endpoint.hostname}, beyond this machine: "
                "use https, or, knowingly, CONVEYOR_ALLOW_PLAINTEXT=true"
            )
        return self


class BepSettings(BlobStoreSettings):
    """services/bep: the Bazel Build Event Protocol ingest (``conveyor-bep``). It shares
    Postgres (schema ``bep``) and NATS (key invalidation, live digests) with the task
    queue; it is not part of the task queue's cluster, so it needs no cluster key."""

    host: str = Field("127.0.0.1", description="gRPC listen address of the BES endpoint")
    port: int = Field(
        8985, ge=0, le=65535, description="gRPC listen port of the BES endpoint (0: any free)"
    )
    tls_cert: str | None = Field(
        None, description="Server certificate (PEM file) of the BES endpoint"
    )
    tls_key: str | None = Field(None, description="Private key (PEM file) of tls_cert")
    tls_client_ca: str | None = Field(
        None, description="CA (PEM file) clients must present a certificate of (mutual TLS)"
    )
    bep_writer_shards: int = Field(
        4, ge=1, le=64, description="Writer shards (group-commit loops), by invocation id hash"
    )
    bep_commit_interval: float = Field(
        0.02, ge=0, description="Seconds between a writer shard's group commits"
    )
    bep_batch_window: float = Field(
        0.05, gt=0, description="Seconds after which a stream's open batch closes"
    )
    bep_batch_events: int = Field(500, ge=1, description="Events after which a batch closes")
    bep_batch_bytes: int = Field(
        256 * 1024, ge=1024, description="Bytes after which a batch closes"
    )
    bep_key_cache_ttl: float = Field(
        300.0, ge=0, description="Seconds an API key lookup is cached per node"
    )
    bep_max_message: int = Field(
        64 * 1024 * 1024, ge=1024 * 1024, description="Largest gRPC message accepted (bytes)"
    )
    bep_segment_retention_days: int = Field(
        30, ge=1, description="Days raw event and log segments are kept (partitions dropped)"
    )
    bep_build_retention_days: int = Field(
        90, ge=1, description="Days build rows are kept (deleted in batches)"
    )
    bep_upkeep_interval: float = Field(
        3600.0, gt=0, description="Seconds between retention and partition upkeep passes"
    )
    bep_use_nats: bool = Field(
        True, description="Use NATS for key invalidation and live digests (off: TTL only)"
    )
    bep_upload_ttl_hours: float = Field(
        24.0, gt=0, description="Hours a CAS upload no build references is kept before the prune"
    )
    bep_max_blob_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=1,
        description="Largest blob the CAS sink accepts (bytes; at most 5 GiB with s3: one "
        "PUT per blob)",
    )

    @model_validator(mode="after")
    def _server_tls(self) -> Self:
        check_server_tls(self)
        return self

    @model_validator(mode="after")
    def _one_put_per_blob(self) -> Self:
        if self.bep_blob_store == "s3" and self.bep_max_blob_bytes > 5 * 1024**3:
            raise ValueError("bep_max_blob_bytes is at most 5 GiB with bep_blob_store=s3")
        return self


class BepWebSettings(BlobStoreSettings):
    """services/bep-web: the build-event web UI and its JSON API (``conveyor-bep-web``),
    over the ingest's Postgres schema ``bep``, with live updates from the ingest's digests
    on NATS. Open mode (no OpenID Connect issuer set): anyone reaching it reads every
    project and the admin token manages projects and keys."""

    host: str = Field("127.0.0.1", description="HTTP listen address of the web UI")
    port: int = Field(
        8986, ge=0, le=65535, description="HTTP listen port of the web UI (0: any free)"
    )
    tls_cert: str | None = Field(
        None, description="Server certificate (PEM file) of the web UI: it serves HTTPS"
    )
    tls_key: str | None = Field(None, description="Private key (PEM file) of tls_cert")
    bep_web_admin_token: str | None = Field(
        None,
        description="Bearer token of the admin (projects, API keys, members, audit log); "
        "unset: no admin in open mode",
    )
    bep_web_digest_interval: float = Field(
        0.25, gt=0, description="Shortest seconds between two live updates of one page"
    )
    bep_web_public_url: str | None = Field(
        None,
        description="Public base URL of the web UI, e.g. https://builds.example.com (the "
        "OpenID Connect redirect URI is <url>/auth/callback; https makes cookies Secure)",
    )
    bep_web_oidc_issuer: str | None = Field(
        None,
        description="OpenID Connect issuer URL (its /.well-known/openid-configuration is "
        "read); set: people sign in and see the projects their groups allow; unset: open mode",
    )
    bep_web_oidc_client_id: str | None = Field(
        None, description="OpenID Connect client id of the web UI (the ID token's audience)"
    )
    bep_web_oidc_client_secret: SecretStr | None = Field(
        None, description="OpenID Connect client secret (unset: a public client, PKCE only)"
    )
    bep_web_oidc_scopes: str = Field(
        "openid email profile", description="Scopes asked for at sign-in (space-separated)"
    )
    bep_web_oidc_groups_claim: str = Field(
        "groups",
        description="ID token claim holding the user's groups (dotted for a nested claim, "
        "e.g. realm_access.roles)",
    )
    bep_web_admin_groups: str = Field(
        "", description="Groups whose members are global admins (comma-separated)"
    )
    bep_web_session_secret: SecretStr | None = Field(
        None,
        description="Key (32 characters or more) signing the session cookies; required "
        "with an OpenID Connect issuer",
    )
    bep_web_session_ttl: float = Field(
        43200.0, gt=0, description="Seconds a sign-in lasts before the user signs in again"
    )

    @model_validator(mode="after")
    def _oidc_complete(self) -> Self:
        if self.bep_web_oidc_issuer:
            for name in ("bep_web_oidc_client_id", "bep_web_public_url"):
                if not getattr(self, name):
                    raise ValueError(f"{name} is required with bep_web_oidc_issuer")
            secret = self.bep_web_session_secret
            if secret is None or len(secret.get_secret_value()) < 32:
                raise ValueError(
                    "bep_web_session_secret of 32 characters or more is required with "
                    "bep_web_oidc_issuer"
                )
        for name in ("bep_web_oidc_issuer", "bep_web_public_url"):
            url = getattr(self, name)
            if url and not url.startswith(("https://", "http://")):
                raise ValueError(f"{name} must be an http(s) URL")
        return self

    bep_web_use_nats: bool = Field(
        True,
        description="Live updates from the ingest's digests on NATS (off: pages poll "
        "Postgres every second)",
    )

    @model_validator(mode="after")
    def _server_tls(self) -> Self:
        check_server_tls(self, port="HTTP")
        return self


class RestSettings(BaseSettings):
    """services/rest: the REST admin API and the ``/ui`` dashboard, a gRPC client of an
    api. It is on neither NATS nor Postgres, so it has these settings only (none of
    :class:`CommonSettings`), read like every service's: flags, then ``CONVEYOR_*``
    variables, then defaults."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_",
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        hide_input_in_errors=True,
    )

    target: str = Field(
        "127.0.0.1:50051",
        description="The api's gRPC address: host:port, or https://host:port when it "
        "speaks TLS (as the CLI's --target)",
    )
    tls_ca: str | None = Field(
        None,
        description="CA bundle (PEM file) that verifies the api's certificate; setting "
        "any tls_* file makes the link TLS (unset: the system's CAs)",
    )
    tls_client_cert: str | None = Field(
        None,
        description="Client certificate (PEM file) for an api that asks for one (its "
        "CONVEYOR_TLS_CLIENT_CA: mutual TLS)",
    )
    tls_client_key: str | None = Field(
        None, description="Private key (PEM file) of tls_client_cert"
    )
    token: SecretStr | None = Field(
        None,
        description="The bearer secret of this process's own calls to the api (the "
        "dashboard's sampler, the health probe; a read-only token suffices); each REST "
        "request passes its caller's own token",
    )
    rest_host: str = Field("127.0.0.1", description="HTTP listen address")
    rest_port: int = Field(8080, ge=0, le=65535, description="HTTP listen port (0: any free port)")
    rest_tls_cert: str | None = Field(
        None, description="Certificate (PEM file) to serve HTTPS with (unset: plain HTTP)"
    )
    rest_tls_key: str | None = Field(None, description="Private key (PEM file) of rest_tls_cert")
    sample_interval: float = Field(
        10.0,
        ge=0,
        description="Seconds between the dashboard's samples of every queue's counts and "
        "latency, kept in memory for an hour for its charts (0: no sampling, no charts)",
    )
    allow_plaintext: bool = Field(
        False,
        description="Knowingly allow tokens to cross the network in clear: a plaintext "
        "target beyond this machine, or plain HTTP on an address beyond loopback",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level")
    log_format: Literal["text", "json"] = Field("text", description="Log format")
    health_file: str | None = Field(
        None,
        description="Touch this file every few seconds while the api answers this "
        "process (for `conveyor health`)",
    )

    @model_validator(mode="after")
    def _links_fail_closed(self) -> Self:
        check_rest_tls(self)
        return self

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> Self:
        """Settings from ``argv`` flags (None: no flags) over the environment."""
        if argv is None:
            return cls()
        return cls(_cli_parse_args=list(argv))


#: Every service's settings class, by service name (the order of the reference). Each is
#: a CommonSettings but ``rest``'s (on neither NATS nor Postgres: only its own).
SERVICE_SETTINGS: dict[str, type[CommonSettings] | type[RestSettings]] = {
    "common": CommonSettings,
    "api": ApiSettings,
    "dispatcher": DispatcherSettings,
    "maintenance": MaintenanceSettings,
    "webhook": WebhookSettings,
    "rest": RestSettings,
    "bep": BepSettings,
    "bep-web": BepWebSettings,
}


def reference_markdown() -> str:
    """The configuration reference as Markdown tables (the README embeds it)."""
    lines: list[str] = []
    common = set(CommonSettings.model_fields)
    for service, cls in SERVICE_SETTINGS.items():
        alone = not issubclass(cls, CommonSettings)
        own = [
            name for name in cls.model_fields if service == "common" or alone or name not in common
        ]
        if not own:
            continue
        title = "Every service" if service == "common" else f"`{service}`"
        if alone:
            title += " (these only: it is on neither NATS nor Postgres)"
        lines += [
            f"#### {title}",
            "",
            "| variable | flag | default | meaning |",
            "|---|---|---|---|",
        ]
        for name in own:
            field = cls.model_fields[name]
            if field.default_factory is not None:
                default = "(per process)" if name == "instance_id" else "(empty)"
            else:
                default = f"`{field.default}`"
            flag = f"`--{name.replace('_', '-')}`"
            lines.append(
                f"| `CONVEYOR_{name.upper()}` | {flag} | {default} | {field.description} |"
            )
        lines.append("")
    return "\n".join(lines)
