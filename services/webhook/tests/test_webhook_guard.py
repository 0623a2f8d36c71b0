"""Where deliveries may go, and the secrets they are signed with, through a real webhook
gateway: a real dispatcher, a real aiohttp endpoint on 127.0.0.1, names resolved by a
:class:`~conveyor_testkit.webhooks.FakeDns` (no DNS, and nothing ever leaves this
machine: a refused address is refused before any connection).

- A delivery to a forbidden address (loopback here, since the allow-list is emptied)
  fails with one fixed text, whether something listens there or not.
- A name that resolved to a public address at registration and resolves to loopback at
  delivery (DNS rebinding) is refused at connect time.
- Secrets are opened with the manager's keyring; ones it cannot open get no gateway;
  plaintext ones from before and ones under an older key are sealed again.
- The Standard Webhooks reference library accepts what the gateway sends.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
from conveyor_broker import Broker, TaskState
from conveyor_runtime.webhook_auth import standard_secret
from conveyor_runtime.webhook_secrets import SecretKeyring, generate_key, key_id_of
from conveyor_runtime.webhook_urls import FORBIDDEN_ADDRESS, AddressPolicy, UrlGuard
from conveyor_testkit.fixtures import (  # noqa: F401  (pytest fixtures)
    dispatcher_fixture,
    endpoint_fixture,
    managers_fixture,
    rig_fixture,
)
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import (
    KEYRING,
    OLD_SECRET,
    SECRET,
    WEBHOOK_KEY,
    FakeDns,
    Managers,
    Rig,
    register,
    running_gateway,
)
from standardwebhooks.webhooks import Webhook as StandardWebhook

NAME = "billing"
memory_only = pytest.mark.parametrize("broker_dsn", ["memory"], indirect=True)
#: Manager settings that allow nothing beyond public addresses.
NOTHING_ALLOWED: dict[str, Any] = {"webhook_allow_networks": ""}


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


async def failed_with(rig: Rig, task_id: str) -> str:
    """The task's last error once its attempt failed."""
    await rig.wait_state(task_id, TaskState.RETRY)
    return (await rig.broker.get_task(task_id)).last_error or ""


@memory_only
async def test_a_forbidden_address_fails_with_one_text_whatever_listens_there(rig: Rig) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: a connection would be refused
    try:
        await rig.register()  # the endpoint, which listens
        closed_url = f"http://127.0.0.1:{closed.getsockname()[1]}/hook"
        await register(rig.broker, closed_url, "closed", queues={"other": 1})
        manager = await rig.managers(**NOTHING_ALLOWED)
        await rig.running(manager)
        await running_gateway(manager, rig.dispatcher, "closed", "other")
        errors = [
            await failed_with(rig, await rig.submit()),
            await failed_with(rig, await rig.submit("other")),
        ]
    finally:
        closed.close()
    # No "HTTP 404" against "connection refused" to tell apart: one text, and nothing
    # reached the endpoint.
    assert errors == [FORBIDDEN_ADDRESS, FORBIDDEN_ADDRESS]
    assert rig.endpoint.deliveries == []


@memory_only
async def test_a_name_rebound_to_loopback_after_registration_is_refused_at_delivery(
    rig: Rig,
) -> None:
    # The registration check sees a public address; every look-up after it, loopback.
    dns = FakeDns({"hooks.test": [["93.184.216.34"], ["127.0.0.1"]]})
    url = f"http://hooks.test:{port_of(rig.endpoint.url)}/hook"
    await UrlGuard(AddressPolicy.from_networks([]), dns.lookup).check(url)
    await register(rig.broker, url, NAME)
    manager = await rig.managers(**NOTHING_ALLOWED, resolver=dns)
    await rig.running(manager)

    assert await failed_with(rig, await rig.submit()) == FORBIDDEN_ADDRESS
    assert rig.endpoint.deliveries == []
    assert dns.lookups["hooks.test"] >= 2


@memory_only
async def test_the_allow_list_lets_a_listed_address_through_by_name(rig: Rig) -> None:
    dns = FakeDns({"hooks.test": [["127.0.0.1"]]})
    await register(rig.broker, f"http://hooks.test:{port_of(rig.endpoint.url)}/hook", NAME)
    manager = await rig.managers(webhook_allow_networks="127.0.0.1/32", resolver=dns)
    await rig.running(manager)
    task_id = await rig.submit()
    await rig.wait_state(task_id, TaskState.COMPLETED)
    assert [d.task_id for d in rig.endpoint.deliveries] == [task_id]
    assert dns.lookups["hooks.test"] >= 1


async def test_the_reference_verifier_accepts_a_real_delivery(rig: Rig) -> None:
    await rig.start_gateway()
    task_id = await rig.submit()
    await rig.wait_state(task_id, TaskState.COMPLETED)
    (delivery,) = rig.endpoint.deliveries
    # The newest secret signs; its Standard Webhooks form verifies with the reference.
    StandardWebhook(standard_secret(SECRET)).verify(delivery.body, delivery.headers)
    assert delivery.headers["webhook-id"] == delivery.lease_id
    with pytest.raises(Exception, match="No matching signature"):
        StandardWebhook(standard_secret(OLD_SECRET)).verify(delivery.body, delivery.headers)


# ---------------------------------------------------------------- secrets


@memory_only
async def test_secrets_under_a_key_the_manager_lacks_get_no_gateway_and_a_clear_error(
    broker: Broker, managers: Managers, caplog: pytest.LogCaptureFixture, rig: Rig
) -> None:
    elsewhere = SecretKeyring.parse(generate_key("gone"))
    await register(
        rig.broker,
        rig.endpoint.url,
        "rekeyed",
        sealed=False,
        secrets=elsewhere.seal_all("rekeyed", (SECRET,)),
    )
    await register(rig.broker, rig.endpoint.url, NAME)
    manager = await managers()
    await wait_until(lambda: manager.leading)
    with caplog.at_level(logging.ERROR):
        await manager.reconcile()
        await manager.reconcile()
    assert set(manager.gateways) == {NAME}
    problems = [r.getMessage() for r in caplog.records if "secrets_unusable" in r.getMessage()]
    # Logged once, naming the key id, and no key material.
    assert len(problems) == 1
    assert "encrypted with key 'gone', which is not configured" in problems[0]
    assert WEBHOOK_KEY.partition(":")[2] not in caplog.text
    # The callbacks of such a registration are still answered (its leases are scoped).
    assert "rekeyed" in manager.answering


async def stored_key_ids(rig: Rig) -> list[str | None]:
    return [key_id_of(value) for value in (await rig.broker.get_webhook_worker(NAME)).secrets]


@memory_only
async def test_plaintext_secrets_are_sealed_by_the_leader_and_keep_signing(rig: Rig) -> None:
    await register(rig.broker, rig.endpoint.url, NAME, sealed=False)
    assert (await rig.broker.get_webhook_worker(NAME)).secrets == (SECRET, OLD_SECRET)
    manager = await rig.managers()
    await rig.running(manager)

    # The leader's loop reseals after its first reconcile.
    async def sealed() -> bool:
        return await stored_key_ids(rig) == ["test", "test"]

    await wait_until(sealed)
    stored = (await rig.broker.get_webhook_worker(NAME)).secrets
    assert KEYRING.open_all(NAME, stored) == (SECRET, OLD_SECRET)
    assert await manager.reseal() == 0  # nothing stale is left
    await manager.reconcile()
    task_id = await rig.submit()
    await rig.wait_state(task_id, TaskState.COMPLETED)
    (delivery,) = rig.endpoint.deliveries
    StandardWebhook(standard_secret(SECRET)).verify(delivery.body, delivery.headers)


@memory_only
async def test_a_new_key_first_reseals_everything_under_it(rig: Rig) -> None:
    await register(rig.broker, rig.endpoint.url, NAME)
    new_key = generate_key("k2")
    manager = await rig.managers(webhook_secret_key=f"{new_key},{WEBHOOK_KEY}")
    await rig.running(manager)

    async def resealed() -> bool:
        return await stored_key_ids(rig) == ["k2", "k2"]

    await wait_until(resealed)
    stored = (await rig.broker.get_webhook_worker(NAME)).secrets
    assert SecretKeyring.parse(new_key).open_all(NAME, stored) == (SECRET, OLD_SECRET)
    # The old key can go now: the new one alone opens everything.
    alone = await rig.managers(webhook_secret_key=new_key)
    assert alone.keyring.open_all(NAME, stored) == (SECRET, OLD_SECRET)


@memory_only
async def test_an_operators_edit_during_a_reseal_wins(rig: Rig) -> None:
    await register(rig.broker, rig.endpoint.url, NAME, sealed=False)
    # The operator's new secrets land between the leader's read and its write.
    real = rig.broker.replace_webhook_secrets
    attempts: list[str] = []
    operator = "operator-" + "x" * 32

    async def edited_first(name: str, expected: Any, secrets: Any) -> bool:
        attempts.append(name)
        await register(rig.broker, rig.endpoint.url, NAME, secrets=(operator,))
        return await real(name, expected, secrets)

    rig.broker.replace_webhook_secrets = edited_first  # type: ignore[method-assign]
    manager = await rig.managers()
    await wait_until(lambda: attempts == [NAME])
    assert await manager.reseal() == 0  # nothing stale: the operator's are sealed
    stored = (await rig.broker.get_webhook_worker(NAME)).secrets
    assert KEYRING.open_all(NAME, stored) == (operator,)


@memory_only
async def test_without_a_key_plaintext_secrets_keep_working_with_a_warning(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    await register(rig.broker, rig.endpoint.url, NAME, sealed=False)
    manager = await rig.managers(webhook_secret_key=None)
    with caplog.at_level(logging.WARNING):
        await rig.running(manager)
        await manager.reconcile()
    warnings = [r.getMessage() for r in caplog.records if "secrets_plaintext" in r.getMessage()]
    assert len(warnings) == 1
    assert "set CONVEYOR_WEBHOOK_SECRET_KEY" in warnings[0]
    assert await manager.reseal() == 0  # nothing to seal with
    task_id = await rig.submit()
    await rig.wait_state(task_id, TaskState.COMPLETED)
    assert (await rig.broker.get_webhook_worker(NAME)).secrets == (SECRET, OLD_SECRET)
