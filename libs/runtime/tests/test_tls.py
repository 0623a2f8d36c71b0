"""TLS on the NATS and Postgres links: the fail-closed settings checks, the contexts the
settings build, a real nats-server with TLS and per-service credentials (in-process and a
service process), and a real PostgreSQL: the local one (no SSL configured: sslmode=require
gets a clear error) and, where this machine can run one, a private one serving TLS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conveyor_runtime.broker_factory import PostgresConnectError, open_broker
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_runtime.nats_connect import NatsConnectError, NatsSecurity, close_nats, connect_nats
from conveyor_runtime.service import open_runtime
from conveyor_runtime.settings import ApiSettings, CommonSettings, DispatcherSettings
from conveyor_runtime.tls import dsn_hosts, is_loopback, postgres_ssl
from conveyor_testkit.certs import CertAuthority, nkey_pair
from conveyor_testkit.polling import wait_until
from pydantic import ValidationError

ADMIN_DSN = os.environ.get("CONVEYOR_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


@dataclass(frozen=True)
class Files:
    folder: Path
    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str
    other_ca: str
    seed: str
    public_nkey: str


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    folder = tmp_path_factory.mktemp("tls")
    ca = CertAuthority()
    server = ca.issue("server", hosts=["localhost", "127.0.0.1"])
    client = ca.issue("postgres", server=False, client=True)
    seed, public = nkey_pair()
    contents = {
        "ca.pem": ca.cert_pem,
        "server.pem": server.cert,
        "server.key": server.key,
        "client.pem": client.cert,
        "client.key": client.key,
        "other.pem": CertAuthority("other").cert_pem,
        "service.nk": seed,
    }
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    return Files(
        folder=folder,
        ca=str(folder / "ca.pem"),
        cert=str(folder / "server.pem"),
        key=str(folder / "server.key"),
        client_cert=str(folder / "client.pem"),
        client_key=str(folder / "client.key"),
        other_ca=str(folder / "other.pem"),
        seed=str(folder / "service.nk"),
        public_nkey=public,
    )


# --------------------------------------------------------------- the settings checks


def test_loopback_hosts() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "a.localhost", ""):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "nats", "db.example.com"):
        assert not is_loopback(host), host
    assert dsn_hosts("postgresql://u:p@db1:5432,db2/x?sslmode=require") == ["db1", "db2"]
    assert dsn_hosts("postgresql://u@[::1]:5432/x") == ["::1"]
    assert dsn_hosts("postgresql:///x?host=/var/run/postgresql") == ["/var/run/postgresql"]


def test_the_api_port_fails_closed_beyond_loopback(files: Files) -> None:
    base: dict[str, Any] = {"allow_unauthenticated": True}
    with pytest.raises(ValidationError, match=r"no TLS certificate for the gRPC port on 0.0.0.0"):
        ApiSettings(**base)
    assert ApiSettings(**base, host="127.0.0.1").tls_cert is None
    assert ApiSettings(**base, allow_plaintext=True).allow_plaintext
    tls = ApiSettings(**base, tls_cert=files.cert, tls_key=files.key, tls_client_ca=files.ca)
    assert tls.tls_client_ca == files.ca
    with pytest.raises(ValidationError, match="CONVEYOR_TLS_CERT and CONVEYOR_TLS_KEY go together"):
        ApiSettings(**base, host="127.0.0.1", tls_cert=files.cert)
    with pytest.raises(ValidationError, match=r"CONVEYOR_TLS_CLIENT_CA .mutual TLS. needs"):
        ApiSettings(**base, host="127.0.0.1", tls_client_ca=files.ca)
    with pytest.raises(ValidationError, match=r"CONVEYOR_TLS_KEY: cannot read /nowhere/key.pem"):
        ApiSettings(**base, tls_cert=files.cert, tls_key="/nowhere/key.pem")


def test_nats_and_postgres_links_fail_closed_beyond_loopback(files: Files) -> None:
    with pytest.raises(ValidationError, match="NATS at nats without TLS") as refused:
        CommonSettings(nats_url="nats://nats:4222", dsn="postgresql://u@db/x")
    assert "Postgres at db with sslmode=prefer" in str(refused.value)
    assert "CONVEYOR_ALLOW_PLAINTEXT=true" in str(refused.value)
    # Every way to ask for TLS is accepted; loopback and the memory broker need none.
    CommonSettings(nats_url="tls://nats:4222", dsn="postgresql://u@db/x?sslmode=verify-full")
    CommonSettings(nats_url="nats://nats:4222", nats_tls_ca=files.ca, db_sslmode="require")
    CommonSettings(nats_url="nats://127.0.0.1:4222,localhost:4223", dsn="postgresql://u@[::1]/x")
    CommonSettings(nats_url="tls://nats:4222", broker="memory", dsn="postgresql://u@db/x")
    CommonSettings(nats_url="nats://nats:4222", dsn="postgresql://u@db/x", allow_plaintext=True)


def test_tls_and_credential_settings_are_checked(files: Files) -> None:
    with pytest.raises(ValidationError, match="CONVEYOR_NATS_TLS_CERT and CONVEYOR_NATS_TLS_KEY"):
        CommonSettings(nats_tls_cert=files.client_cert)
    with pytest.raises(ValidationError, match="CONVEYOR_DB_SSLCERT and CONVEYOR_DB_SSLKEY"):
        CommonSettings(db_sslkey=files.client_key)
    with pytest.raises(ValidationError, match="CONVEYOR_NATS_USER and CONVEYOR_NATS_PASSWORD"):
        CommonSettings(nats_user="api")
    with pytest.raises(ValidationError, match="one NATS authentication at a time"):
        CommonSettings(nats_token="t", nats_nkey_seed=files.seed)
    with pytest.raises(ValidationError, match="CONVEYOR_NATS_CREDS: cannot read /no/creds"):
        CommonSettings(nats_creds="/no/creds")
    with pytest.raises(ValidationError, match="unknown Postgres sslmode 'sometimes'"):
        CommonSettings(dsn="postgresql://u@127.0.0.1/x?sslmode=sometimes")


def test_postgres_settings_build_the_context_libpq_would(files: Files) -> None:
    dsn = "postgresql://u@db.example.com/x"
    assert postgres_ssl(CommonSettings(dsn=dsn + "?sslmode=verify-full")) is None  # asyncpg's
    assert postgres_ssl(CommonSettings(dsn=dsn, db_sslmode="prefer", allow_plaintext=True)) == (
        "prefer"
    )
    full = postgres_ssl(CommonSettings(dsn=dsn, db_sslmode="verify-full", db_sslrootcert=files.ca))
    assert isinstance(full, ssl.SSLContext)
    assert full.verify_mode is ssl.CERT_REQUIRED
    assert full.check_hostname
    assert [c["subject"] for c in full.get_ca_certs()] == [
        ((("commonName", "Conveyor development CA"),),)
    ]
    assert full.minimum_version >= ssl.TLSVersion.TLSv1_2
    verify_ca = postgres_ssl(
        CommonSettings(dsn=dsn, db_sslmode="verify-ca", db_sslrootcert=files.ca)
    )
    assert isinstance(verify_ca, ssl.SSLContext)
    assert verify_ca.verify_mode is ssl.CERT_REQUIRED
    assert not verify_ca.check_hostname
    require = postgres_ssl(CommonSettings(dsn=dsn, db_sslmode="require"))
    assert isinstance(require, ssl.SSLContext)
    assert require.verify_mode is ssl.CERT_NONE
    # libpq: require with a root certificate verifies the chain, as verify-ca does.
    require_ca = postgres_ssl(
        CommonSettings(dsn=dsn, db_sslmode="require", db_sslrootcert=files.ca)
    )
    assert isinstance(require_ca, ssl.SSLContext)
    assert require_ca.verify_mode is ssl.CERT_REQUIRED
    # The DSN's sslmode applies when only the files come from settings.
    from_dsn = postgres_ssl(
        CommonSettings(dsn=dsn + "?sslmode=verify-full", db_sslrootcert=files.ca)
    )
    assert isinstance(from_dsn, ssl.SSLContext)
    assert from_dsn.check_hostname
    # verify-full without a root certificate: the system's CAs.
    system = postgres_ssl(CommonSettings(dsn=dsn, db_sslmode="verify-full"))
    assert isinstance(system, ssl.SSLContext)
    assert system.verify_mode is ssl.CERT_REQUIRED


@pytest.mark.postgres
async def test_sslmode_require_against_a_server_without_ssl_is_a_clear_error() -> None:
    """The local PostgreSQL has no SSL configured (if it had, there is nothing to refuse)."""
    settings = CommonSettings(dsn=ADMIN_DSN, db_sslmode="require", auto_migrate=False)
    try:
        broker = await open_broker(settings)
    except PostgresConnectError as exc:
        message = str(exc)
        assert "sslmode=require" in message
        assert "the server does not accept TLS" in message
        assert "@" not in message.split("(sslmode")[0], "the DSN (and its password) stays out"
    else:
        await broker.close()
        pytest.skip("the local PostgreSQL accepts TLS")


# ------------------------------------------------------------------------- NATS


def _nats_config(files: Files, *, verify_clients: bool = False) -> str:
    verify = f'\n  ca_file: "{files.ca}"\n  verify: true' if verify_clients else ""
    return (
        f'SERVICE_NKEY = "{files.public_nkey}"\n'
        f'tls {{\n  cert_file: "{files.cert}"\n  key_file: "{files.key}"{verify}\n}}\n'
        "authorization {\n  users = [\n    { nkey: $SERVICE_NKEY }\n"
        "    { user: dispatcher, password: s3cret }\n  ]\n}\n"
    )


@pytest.mark.nats
async def test_services_connect_to_nats_over_tls_with_their_credentials(files: Files) -> None:
    with EmbeddedNats(config=_nats_config(files)) as server:
        choices: list[dict[str, Any]] = [
            {"nats_nkey_seed": files.seed},
            {"nats_user": "dispatcher", "nats_password": "s3cret"},
        ]
        for credentials in choices:
            settings = DispatcherSettings(
                nats_url=server.url, nats_tls_ca=files.ca, broker="memory", **credentials
            )
            async with open_runtime(settings, name="dispatcher", publish_events=False) as rt:
                assert rt.nc.is_connected
                writer = getattr(rt.nc._transport, "_io_writer", None)
                assert writer is not None
                assert writer.get_extra_info("ssl_object") is not None, "not over TLS"
                await rt.nc.publish("conveyor.check", b"x")
                await rt.nc.flush()

        for security, error in (
            (NatsSecurity.from_settings(CommonSettings(nats_tls_ca=files.ca)), "Authorization"),
            (
                NatsSecurity.from_settings(
                    CommonSettings(nats_tls_ca=files.ca, nats_user="dispatcher", nats_password="x")
                ),
                "Authorization Violation",
            ),
            (
                NatsSecurity.from_settings(
                    CommonSettings(nats_tls_ca=files.other_ca, nats_nkey_seed=files.seed)
                ),
                "certificate is not trusted",
            ),
        ):
            with pytest.raises(NatsConnectError, match=error):
                await connect_nats(server.url, name="refused", security=security)


@pytest.mark.nats
async def test_nats_with_client_certificates(files: Files) -> None:
    with EmbeddedNats(config=_nats_config(files, verify_clients=True)) as server:
        settings = CommonSettings(
            nats_tls_ca=files.ca,
            nats_tls_cert=files.client_cert,
            nats_tls_key=files.client_key,
            nats_nkey_seed=files.seed,
        )
        nc = await connect_nats(
            server.url, name="mtls", security=NatsSecurity.from_settings(settings)
        )
        assert nc.is_connected
        await close_nats(nc)
        without = CommonSettings(nats_tls_ca=files.ca, nats_nkey_seed=files.seed)
        with pytest.raises(NatsConnectError):
            await connect_nats(
                server.url, name="no-cert", security=NatsSecurity.from_settings(without)
            )


@pytest.mark.nats
async def test_tls_asked_for_is_never_downgraded_to_plaintext(files: Files) -> None:
    """A server that does not offer TLS (misconfigured, or someone in between) is refused
    before the CONNECT that would carry the credentials."""
    with EmbeddedNats() as plain:
        security = NatsSecurity.from_settings(
            CommonSettings(nats_tls_ca=files.ca, nats_user="u", nats_password="secret")
        )
        with pytest.raises(NatsConnectError, match="does not offer it"):
            await connect_nats(plain.url, name="downgrade", security=security)


@pytest.mark.nats
async def test_a_service_process_without_credentials_is_refused(
    files: Files, tmp_path: Path
) -> None:
    with EmbeddedNats(config=_nats_config(files)) as server:
        env = {
            **os.environ,
            "CONVEYOR_NATS_URL": server.url,
            "CONVEYOR_NATS_TLS_CA": files.ca,
            "CONVEYOR_BROKER": "memory",
            "CONVEYOR_HEALTH_FILE": str(tmp_path / "health"),
        }
        refused = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "conveyor_dispatcher",
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(refused.communicate(), 60)
        assert refused.returncode == 1
        text = stderr.decode()
        assert "service.failed name=dispatcher" in text
        assert "Authorization Violation" in text
        assert "Traceback" not in text

        log_path = tmp_path / "admitted.log"
        with log_path.open("wb") as log:
            admitted = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "conveyor_dispatcher",
                env={**env, "CONVEYOR_NATS_NKEY_SEED": files.seed},
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )
        try:
            await wait_until(
                lambda: (tmp_path / "health").exists() or admitted.returncode is not None,
                within=60,
                message="the dispatcher's health file",
            )
            assert admitted.returncode is None, log_path.read_text()
            assert "tls=on auth=nkey" in log_path.read_text()
        finally:
            admitted.send_signal(signal.SIGTERM)
            await asyncio.wait_for(admitted.wait(), 30)


# ------------------------------------------------------------- a TLS PostgreSQL


def _can_run_postgres() -> str | None:
    """Why this machine cannot run a private PostgreSQL, or None."""
    if shutil.which("initdb") is None or shutil.which("postgres") is None:
        return "no initdb/postgres binaries"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a postgres user"
        if shutil.which("runuser") is None:
            return "no runuser"
    return None


def _as_postgres(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextlib.contextmanager
def tls_postgres(files: Files) -> Iterator[int]:
    """A private PostgreSQL serving TLS only (plaintext connections rejected), with the
    test CA's server certificate; yields its port."""
    folder = Path(tempfile.mkdtemp(prefix="conveyor-pg-tls-"))
    data = folder / "data"
    try:
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(folder, user.pw_uid, user.pw_gid)
        subprocess.run(
            _as_postgres(["initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"]),
            check=True,
            capture_output=True,
        )
        for name, source in (("server.crt", files.cert), ("server.key", files.key)):
            shutil.copy(source, data / name)
            (data / name).chmod(0o600)
            if os.geteuid() == 0:
                os.chown(data / name, user.pw_uid, user.pw_gid)
        (data / "pg_hba.conf").write_text(
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n"
            "hostnossl all all 0.0.0.0/0 reject\n"
        )
        port = free_port()
        proc = subprocess.Popen(
            _as_postgres(
                [
                    "postgres",
                    "-D",
                    str(data),
                    "-p",
                    str(port),
                    "-k",
                    str(folder),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "ssl=on",
                    "-c",
                    "fsync=off",
                ]
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            import time

            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                time.sleep(0.05)  # polling a socket for readiness, not waiting for time
            assert proc.poll() is None, "postgres exited"
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.postgres
async def test_postgres_over_tls_verify_full(files: Files) -> None:
    reason = _can_run_postgres()
    if reason is not None:
        pytest.skip(reason)
    with tls_postgres(files) as port:
        for host in ("localhost", "127.0.0.1"):
            dsn = f"postgresql://postgres@{host}:{port}/postgres"
            settings = CommonSettings(
                dsn=dsn, db_sslmode="verify-full", db_sslrootcert=files.ca, auto_migrate=True
            )
            broker = await open_broker(settings)
            try:
                assert await broker.queue_stats() == []
            finally:
                await broker.close()
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        # `conveyor migrate` with the same settings, as flags.
        migrate = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "conveyor_cli",
            "migrate",
            "--json",
            "--dsn",
            dsn,
            "--db-sslmode",
            "verify-full",
            "--db-sslrootcert",
            files.ca,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(migrate.communicate(), 60)
        assert migrate.returncode == 0, err.decode()
        assert json.loads(out) == {"applied": []}  # open_broker above applied them
        untrusted = CommonSettings(
            dsn=dsn, db_sslmode="verify-full", db_sslrootcert=files.other_ca, auto_migrate=False
        )
        with pytest.raises(PostgresConnectError, match="not trusted"):
            await open_broker(untrusted)
        plaintext = CommonSettings(dsn=dsn, db_sslmode="disable", auto_migrate=False)
        with pytest.raises(PostgresConnectError, match=r"no encryption|SSL off|rejects"):
            await open_broker(plaintext)
