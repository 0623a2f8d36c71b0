"""A private certificate authority for development and tests, and the NATS keys and the
cluster key of ``compose.yaml``: what ``scripts/dev-certs`` writes.

:class:`CertAuthority` makes a CA and issues server and client certificates (ECDSA P-256,
SHA-256); :func:`write_dev_certs` writes every file the compose stack mounts. None of this
is for production: use your own PKI there (see docs/operations.md, "TLS").
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nkeys
from conveyor_broker.keyring import generate_key as generate_encryption_key
from conveyor_runtime.cluster_key import generate_key
from conveyor_runtime.webhook_secrets import generate_key as generate_secret_key
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "BEP_NATS_USERS",
    "COMPOSE_HOSTS",
    "NATS_CLUSTER_NODES",
    "NATS_USERS",
    "CertAuthority",
    "Issued",
    "nkey_pair",
    "nkey_variable",
    "write_dev_certs",
]

#: The compose services that present a server certificate, and the names they answer to.
COMPOSE_HOSTS: Mapping[str, tuple[str, ...]] = {
    "api": ("api", "localhost", "127.0.0.1", "::1"),
    "nats": ("nats", "nats-1", "nats-2", "nats-3", "localhost", "127.0.0.1", "::1"),
    "postgres": ("postgres", "localhost", "127.0.0.1", "::1"),
    # The REST admin API's HTTPS port (browsers and curl reach it as localhost).
    "rest": ("rest", "localhost", "127.0.0.1", "::1"),
    # The build-event ingest's gRPC port (Bazel's --bes_backend) and its web UI's HTTPS.
    "bep": ("bep", "localhost", "127.0.0.1", "::1"),
    "bep-web": ("bep-web", "localhost", "127.0.0.1", "::1"),
}
#: The nodes of compose.yaml's nats-cluster profile: they route to each other with
#: ``nats-route.pem`` (server and client certificate for these names).
NATS_CLUSTER_NODES: tuple[str, ...] = ("nats-1", "nats-2", "nats-3")
#: The NATS users of compose.yaml, one per Conveyor service (deploy/nats.conf names them).
NATS_USERS: tuple[str, ...] = ("api", "dispatcher", "maintenance", "webhook")
#: The NATS users of the build-event services (the ingest, its web UI): not of the task
#: queue's cluster, they speak only the ``<prefix>.bep.`` subjects.
BEP_NATS_USERS: tuple[str, ...] = ("bep", "bep-web")


def nkey_variable(user: str) -> str:
    """The nats.conf variable holding ``user``'s public nkey (``BEP_WEB_NKEY``)."""
    return f"{user.upper().replace('-', '_')}_NKEY"


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its private key, both PEM."""

    cert: bytes
    key: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class CertAuthority:
    """A self-signed CA that issues certificates valid for ``days`` days.

    ``not_before`` and ``days`` let a test make a certificate that is not yet valid or
    already expired.
    """

    def __init__(self, name: str = "Conveyor development CA", *, days: int = 825) -> None:
        self.name = name
        self.days = days
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC) - timedelta(minutes=5)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate (the bundle clients and servers trust)."""
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        *,
        hosts: Sequence[str] = (),
        server: bool = True,
        client: bool = False,
        not_before: datetime | None = None,
        days: int | None = None,
    ) -> Issued:
        """A certificate for ``common_name``, valid for ``hosts`` (DNS names or IP
        addresses) as a server and/or as a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        start = not_before or datetime.now(UTC) - timedelta(minutes=5)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + timedelta(days=days if days is not None else self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def nkey_pair() -> tuple[bytes, str]:
    """A new NATS user nkey: its seed (the secret, as a seed file holds it) and its public
    key (what nats-server's configuration names)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    return seed, public


def _write(path: Path, data: bytes, mode: int) -> None:
    path.write_bytes(data)
    path.chmod(mode)


def write_dev_certs(
    folder: Path, *, users: Sequence[str] = (*NATS_USERS, *BEP_NATS_USERS)
) -> list[Path]:
    """Write a new development CA and everything compose.yaml mounts into ``folder``:

    - ``ca.pem``: the CA every client and server trusts;
    - ``<host>.pem`` / ``<host>.key`` for ``api``, ``nats``, ``postgres``, ``rest``,
      ``bep`` and ``bep-web``:
      server certificates for their compose names, ``localhost`` and the loopback
      addresses;
    - ``nats-route.pem`` / ``nats-route.key``: what the nodes of the nats-cluster profile
      present to each other on their routes (mutual TLS), for their names;
    - ``client.pem`` / ``client.key``: a client certificate (the CLI, the SDK, a webhook
      endpoint's callbacks) for an api that asks for one (mutual TLS);
    - ``nats-users.conf``: one variable per NATS user holding its public nkey
      (``API_NKEY = "U..."``), included by deploy/nats.conf;
    - ``<user>.nk``: each NATS user's nkey seed (``CONVEYOR_NATS_NKEY_SEED``);
    - ``webhook-secret.key``: the key that encrypts webhook secrets at rest
      (``CONVEYOR_WEBHOOK_SECRET_KEY_FILE`` of the api and the webhook service).
    - ``encryption.key``: the key that encrypts task payloads, header values, results,
      progress and errors at rest (``CONVEYOR_ENCRYPTION_KEYS_FILE`` of every service).
    - ``cluster.key``: the cluster key every service seals its NATS messages with
      (``CONVEYOR_CLUSTER_KEY_FILE``).

    Keys are readable by everyone (mode 0644): the containers run as users of their own,
    and these are throwaway development keys. Returns the paths written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    ca = CertAuthority()
    written: list[Path] = []

    def put(name: str, data: bytes) -> None:
        path = folder / name
        _write(path, data, 0o644)
        written.append(path)

    put("ca.pem", ca.cert_pem)
    for host, names in COMPOSE_HOSTS.items():
        issued = ca.issue(host, hosts=names)
        put(f"{host}.pem", issued.cert)
        put(f"{host}.key", issued.key)
    route = ca.issue(
        "nats-route", hosts=(*NATS_CLUSTER_NODES, "localhost", "127.0.0.1", "::1"), client=True
    )
    put("nats-route.pem", route.cert)
    put("nats-route.key", route.key)
    client = ca.issue("conveyor-client", server=False, client=True)
    put("client.pem", client.cert)
    put("client.key", client.key)
    lines = ["# Generated by scripts/dev-certs: the public nkey of each NATS user."]
    for user in users:
        seed, public = nkey_pair()
        put(f"{user}.nk", seed + b"\n")
        lines.append(f'{nkey_variable(user)} = "{public}"')
    put("nats-users.conf", ("\n".join(lines) + "\n").encode())
    put("webhook-secret.key", (generate_secret_key("dev") + "\n").encode())
    put(
        "encryption.key",
        (
            "# Encryption at rest (CONVEYOR_ENCRYPTION_KEYS_FILE): <id>:<base64>, one a line,\n"
            "# the one that encrypts marked *<id>. Rotating: docs/operations.md.\n"
            f"*{generate_encryption_key('dev')}\n"
        ).encode(),
    )
    put("cluster.key", (generate_key() + "\n").encode())
    return written
