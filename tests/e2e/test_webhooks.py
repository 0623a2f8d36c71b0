"""Webhook workers through real processes: api, dispatcher, maintenance and webhook service
processes on a real Postgres and a private nats-server; the HTTP endpoint is a real aiohttp
server in the test process (:class:`conveyor_testkit.webhooks.Endpoint`). Registrations go
through the SDK's admin client, tasks through the SDK's client, callbacks through
:mod:`conveyor.webhooks`. Every wait is on a condition with a timeout."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from conveyor import (
    AsyncAdminClient,
    AsyncClient,
    FailedPrecondition,
    InvalidArgument,
    TaskInfo,
    TaskState,
    Unauthenticated,
    WebhookWorkerNotFound,
    spec,
)
from conveyor.webhooks import AsyncCallbacks, ReplayGuard, verify_signature, verify_webhook
from conveyor_broker import TaskState as StoredState
from conveyor_broker.postgres import PostgresBroker
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.ownership import KeyLease, open_lease_bucket
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.webhook_auth import LeaseClaims, mint_lease_token
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import Delivery, Endpoint, rpc
from conveyor_webhook import ROLE
from standardwebhooks.webhooks import Webhook as StandardWebhook

from tests.e2e.harness import POLL_INTERVAL, ROOT, Cluster, Proc, port_open
from tests.e2e.lifecycle import wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

#: The registration's secrets, newest first: the newest signs every delivery.
SECRET = "whsec_" + base64.b64encode(b"e2e-newest-secret-0123456789abcd").decode()
OLD_SECRET = "e2e-older-secret-0123456789abcdef"

#: Short leases and ticks, so that retries, expiry and reconciles happen within seconds.
FAST = {
    "CONVEYOR_LEASE_TTL": "2",
    "CONVEYOR_REAP_TICK": "0.2",
    "CONVEYOR_PROMOTE_TICK": "0.2",
    "CONVEYOR_RECONCILE_TICK": "0.2",
}


@dataclass(frozen=True)
class Stack:
    """The running services: the api's address and the webhook service processes."""

    target: str
    webhooks: list[Proc]


async def start_stack(
    cluster: Cluster, *, webhooks: int = 1, env: Mapping[str, str] | None = None
) -> Stack:
    """An api, a dispatcher, a maintenance and ``webhooks`` webhook service processes
    (instance ids ``webhook-0``, ``webhook-1``...), with ``FAST`` settings plus ``env``.
    The webhook services send the api's address as the callback of every delivery.

    Every process starts at once (the api's port is chosen first), so their start-ups
    overlap; returns once the api accepts connections."""
    cluster.settings_env.update({**FAST, **(env or {})})
    port = free_port()
    target = f"127.0.0.1:{port}"
    api = cluster.spawn(
        "api", ["-m", "conveyor_api"], {"CONVEYOR_HOST": "127.0.0.1", "CONVEYOR_PORT": str(port)}
    )
    api.port = port
    cluster.start_dispatcher()
    cluster.start_maintenance()
    procs = [
        cluster.start_webhook(
            {"CONVEYOR_CALLBACK_ADDRESS": target, "CONVEYOR_INSTANCE_ID": f"webhook-{i}"}
        )
        for i in range(webhooks)
    ]
    await wait_until(
        lambda: port_open(port) or not api.alive(),
        within=60,
        interval=POLL_INTERVAL,
        message="api port",
    )
    if not api.alive():
        raise RuntimeError(f"api exited:\n{api.log()}")
    return Stack(target, procs)


async def register(
    admin: AsyncAdminClient, name: str, url: str, queues: Mapping[str, int], **fields: Any
) -> None:
    """Register webhook worker ``name`` with both secrets (the newest first)."""
    await admin.upsert_webhook_worker(name, url, queues, secrets=[SECRET, OLD_SECRET], **fields)


def header(delivery: Delivery, name: str) -> str | None:
    """A delivery's HTTP header, looked up case-insensitively."""
    wanted = name.lower()
    return next((v for k, v in delivery.headers.items() if k.lower() == wanted), None)


def attempts(endpoint: Endpoint, task_id: str) -> list[int]:
    """The attempt numbers of the deliveries of ``task_id``, in arrival order."""
    return [d.call["params"]["attempt"] for d in endpoint.deliveries if d.task_id == task_id]


def encoded(value: Any) -> bytes:
    """``value`` as the SDK's JSON codec stores it."""
    return json.dumps(value).encode()


def logged(proc: Proc, line: str) -> int:
    """How many times ``line`` appears in the process's log."""
    return proc.log().count(line)


async def count_state(store: PostgresBroker, state: StoredState) -> int:
    return sum(stats.count(state) for stats in await store.queue_stats())


async def wait_tasks(
    admin: AsyncAdminClient, ids: list[str], state: TaskState, *, within: float = 30.0
) -> list[TaskInfo]:
    """Wait until every task of ``ids`` is in ``state``; return them as read then."""
    return [await wait_state(admin, task_id, state, within=within) for task_id in ids]


class LateEndpoint(Endpoint):
    """An :class:`Endpoint` whose port is reserved at once but that answers only after
    :meth:`open`: until then its socket is bound and not listening, so every connection
    to it is refused (an endpoint that is down)."""

    _sock: socket.socket | None = None

    async def __aenter__(self) -> LateEndpoint:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
        return self

    async def open(self) -> None:
        """Start answering on the reserved port."""
        assert self._sock is not None
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    async def __aexit__(self, *exc: object) -> None:
        await super().__aexit__(*exc)
        if self._sock is not None:
            self._sock.close()


# ---------------------------------------------------------------------- sync mode


async def test_sync_deliveries_complete_exactly_once_signed_with_results(
    cluster: Cluster, store: PostgresBroker
) -> None:
    stack = await start_stack(cluster)

    async def answer(delivery: Delivery) -> web.StreamResponse:
        return await rpc("success", result=encoded({"echo": delivery.task_id}))(delivery)

    async with (
        Endpoint(answer=answer) as endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await register(admin, "sync-hook", endpoint.url, {"invoices": 1}, concurrency=16)
        ids: list[str] = []
        for start in (0, 100):
            batch = [
                spec("invoice.charge", {"i": i}, queue="invoices")
                for i in range(start, start + 100)
            ]
            for result in await client.enqueue_batch(batch):
                assert result.task is not None, result.error
                ids.append(result.task.id)

        async def all_done() -> bool:
            return await count_state(store, StoredState.COMPLETED) == len(ids)

        await wait_until(
            all_done, within=60, interval=POLL_INTERVAL, message="200 webhook tasks completed"
        )

        delivered = Counter(d.task_id for d in endpoint.deliveries)
        assert set(delivered) == set(ids)
        assert max(delivered.values()) == 1, "a task was delivered twice"
        replays = ReplayGuard()
        reference = StandardWebhook(SECRET)
        for delivery in endpoint.deliveries:
            # Standard Webhooks: the reference library and the SDK accept it; the newest
            # secret signs, the older one alone does not verify.
            reference.verify(delivery.body, delivery.headers, json_parse=False)
            assert verify_webhook(delivery.headers, delivery.body, [OLD_SECRET, SECRET])
            assert not verify_webhook(delivery.headers, delivery.body, OLD_SECRET)
            # Every delivery has an id of its own (the lease id).
            assert header(delivery, "webhook-id") == delivery.lease_id
            assert replays.first_time(delivery.lease_id)
            assert not replays.first_time(delivery.lease_id)
            # The deprecated header, still sent for one release.
            signature = header(delivery, "Conveyor-Signature")
            with pytest.warns(DeprecationWarning, match="verify_webhook"):
                assert verify_signature(signature, delivery.body, SECRET), signature
            assert header(delivery, "Conveyor-Delivery") == delivery.task_id
            assert (header(delivery, "User-Agent") or "").startswith("conveyor-webhook/")
            assert delivery.call["method"] == "conveyor.task"
            params = delivery.call["params"]
            assert params["queue"] == "invoices"
            assert params["attempt"] == 1
            assert json.loads(base64.b64decode(params["payload"]))["i"] in range(200)
        for task_id in ids:
            task = await client.get_task(task_id)
            assert task.state is TaskState.COMPLETED
            assert task.result == {"echo": task_id}


async def check_failure_answers(stack: Stack) -> None:
    """An endpoint answering failure (with retry_after) then success, skip_retry, and a
    failure with a long retry_after."""

    async def answer(delivery: Delivery) -> web.StreamResponse:
        params = delivery.call["params"]
        if params["type"] == "e2e.flaky" and params["attempt"] == 1:
            return await rpc("failure", error="not yet", retry_after=0.1)(delivery)
        if params["type"] == "e2e.flaky":
            return await rpc("success", result=encoded({"attempt": params["attempt"]}))(delivery)
        if params["type"] == "e2e.later":
            return await rpc("failure", error="come back later", retry_after=3600)(delivery)
        return await rpc("skip_retry", error="bad invoice")(delivery)

    async with (
        Endpoint(answer=answer) as endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await register(admin, "retry-hook", endpoint.url, {"retries": 1})
        flaky = await client.enqueue("e2e.flaky", {"x": 1}, queue="retries")
        doomed = await client.enqueue("e2e.doomed", {"x": 2}, queue="retries")
        later = await client.enqueue("e2e.later", {"x": 3}, queue="retries")

        done = await wait_state(admin, flaky.id, TaskState.COMPLETED)
        assert attempts(endpoint, flaky.id) == [1, 2]
        assert done.retried == 1
        assert done.result == {"attempt": 2}

        archived = await wait_state(admin, doomed.id, TaskState.ARCHIVED)
        assert archived.last_error == "bad invoice"
        assert archived.retried == 0
        assert attempts(endpoint, doomed.id) == [1]

        # The endpoint's retry_after, not the server's backoff, sets the next attempt.
        waiting = await wait_state(admin, later.id, TaskState.RETRY)
        assert waiting.last_error == "come back later"
        assert waiting.next_process_at is not None
        assert waiting.next_process_at > datetime.now(UTC) + timedelta(minutes=50)
        assert attempts(endpoint, later.id) == [1]


async def check_unreachable_endpoint(stack: Stack) -> None:
    """An endpoint that refuses connections: attempts fail and retry (opening its
    breaker), and complete once it listens."""
    [webhook] = stack.webhooks
    async with (
        LateEndpoint() as endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await register(admin, "down-hook", endpoint.url, {"down": 1}, concurrency=3)
        ids = [(await client.enqueue("e2e.down", {"i": i}, queue="down")).id for i in range(3)]

        async def retried_twice() -> bool:
            tasks = [await admin.get_task(task_id) for task_id in ids]
            return all(t.retried >= 2 for t in tasks)

        await wait_until(
            retried_twice, within=30, interval=POLL_INTERVAL, message="every task failed twice"
        )
        for task_id in ids:
            task = await admin.get_task(task_id)
            assert task.last_error is not None
            assert "could not reach the endpoint" in task.last_error, task.last_error
        assert endpoint.deliveries == []
        # Six refused connections in a row opened the endpoint's circuit breaker.
        assert re.search(
            r"concurrency_capped gateway=wh-down-hook-\S+ concurrency=0\n", webhook.log()
        )

        await endpoint.open()
        done = await wait_tasks(admin, ids, TaskState.COMPLETED, within=30)
        for task in done:
            # Only the attempts made once it listened reached it: the first, once.
            [attempt] = attempts(endpoint, task.id)
            assert attempt == task.retried + 1 >= 3
        # A successful probe closed the breaker: full concurrency again.
        capped = re.findall(
            r"concurrency_capped gateway=wh-down-hook-\S+ concurrency=(\d+)", webhook.log()
        )
        assert capped[-1] == "3", capped


async def test_failed_deliveries_retry_or_archive_and_an_unreachable_endpoint_recovers(
    cluster: Cluster,
) -> None:
    # Both cases on one stack, to pay for one start-up. A short breaker cooldown: the
    # refused connections open the unreachable endpoint's breaker.
    stack = await start_stack(cluster, env={"CONVEYOR_BREAKER_COOLDOWN": "0.5"})
    await check_failure_answers(stack)
    await check_unreachable_endpoint(stack)


# --------------------------------------------------------------------- async mode


async def test_async_delivery_heartbeats_and_reports_through_the_api(
    cluster: Cluster,
) -> None:
    # A longer lease: between the accept and the test's callbacks nothing may lapse.
    stack = await start_stack(cluster, env={"CONVEYOR_LEASE_TTL": "10"})
    [webhook] = stack.webhooks
    async with (
        Endpoint(answer=rpc("accepted")) as endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await register(admin, "async-hook", endpoint.url, {"reports": 1})
        task = await client.enqueue("report.build", {"month": 7}, queue="reports")
        await wait_until(
            lambda: f"webhook.delivery_accepted worker=async-hook task={task.id}" in webhook.log(),
            within=30,
            interval=POLL_INTERVAL,
            message="delivery accepted",
        )
        [delivery] = endpoint.deliveries
        params = delivery.call["params"]
        assert params["callback"] == stack.target
        token = params["lease_token"]
        before = await admin.get_task(task.id)
        assert before.state is TaskState.ACTIVE
        assert before.lease_expires_at is not None

        async with AsyncCallbacks(params["callback"]) as callbacks:
            expires = await callbacks.heartbeat(token, progress={"pct": 50})
            assert expires is not None
            assert expires > before.lease_expires_at
            beaten = await admin.get_task(task.id)
            assert beaten.state is TaskState.ACTIVE
            assert beaten.progress == {"pct": 50}
            assert beaten.lease_expires_at is not None
            assert abs((beaten.lease_expires_at - expires).total_seconds()) < 0.01

            await callbacks.report_result(token, "success", result={"rows": 12})
            done = await admin.get_task(task.id)
            assert done.state is TaskState.COMPLETED
            assert done.result == {"rows": 12}

            # The lease is gone: a second report for the same token is refused.
            with pytest.raises(FailedPrecondition, match="lease lost"):
                await callbacks.report_result(token, "failure", error="again")
            assert (await admin.get_task(task.id)).state is TaskState.COMPLETED

            # A token for a live delivery, signed with a secret the registration does
            # not have: refused, and the task is untouched.
            other = await client.enqueue("report.build", {"month": 8}, queue="reports")
            await wait_until(
                lambda: len(endpoint.deliveries) == 2,
                within=30,
                interval=POLL_INTERVAL,
                message="second delivery",
            )
            real = endpoint.deliveries[1].call["params"]["lease_token"]
            lease_id = endpoint.deliveries[1].lease_id
            claims = LeaseClaims(
                worker="async-hook", task_id=other.id, lease_id=lease_id, queue="reports"
            )
            forged = mint_lease_token("not-the-secret", claims)
            with pytest.raises(Unauthenticated, match="invalid lease token"):
                await callbacks.report_result(forged, "success", result={"rows": 0})
            # The real token with one character of its signature changed: refused too.
            head, _, mac = real.rpartition(".")
            tampered = f"{head}.{'B' if mac[0] == 'A' else 'A'}{mac[1:]}"
            with pytest.raises(Unauthenticated, match="invalid lease token"):
                await callbacks.heartbeat(tampered)
            assert (await admin.get_task(other.id)).state is TaskState.ACTIVE

            # The real token finishes it: a failure with the endpoint's retry_after.
            await callbacks.report_result(real, "failure", error="upstream down", retry_after=3600)
            failed = await admin.get_task(other.id)
            assert failed.state is TaskState.RETRY
            assert failed.last_error == "upstream down"
            assert failed.next_process_at is not None
            assert failed.next_process_at > datetime.now(UTC) + timedelta(minutes=50)


# ------------------------------------------------------- a dead process, a pause


async def leader_of(nats_url: str) -> str | None:
    """The instance id holding the webhook-manager role, read from the leaders bucket."""
    nc = await connect_nats(nats_url, name="e2e-webhook-leader")
    try:
        kv = await open_lease_bucket(nc, Subjects().leaders_bucket, ttl=2)
        return await KeyLease(kv, ROLE, "e2e-reader").holder()
    finally:
        await close_nats(nc)


async def test_killed_webhook_service_task_is_redelivered_by_the_survivor(
    cluster: Cluster, store: PostgresBroker, nats_server: EmbeddedNats
) -> None:
    stack = await start_stack(
        cluster,
        webhooks=2,
        env={"CONVEYOR_LEADER_TTL": "2", "CONVEYOR_REGISTER_TICK": "1"},
    )
    killed = asyncio.Event()
    endpoint = Endpoint()

    async def answer(delivery: Delivery) -> web.StreamResponse:
        # Before the kill every delivery is held open; the kill cuts its connection.
        if not killed.is_set():
            await endpoint.release.wait()
        return await rpc("success")(delivery)

    endpoint.answer = answer
    async with (
        endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await register(admin, "ha-hook", endpoint.url, {"ha": 1}, concurrency=2, timeout=60)
        ids = [(await client.enqueue("e2e.ha", {"i": i}, queue="ha")).id for i in range(6)]
        # Two slots: both held open by the leader, which can take nothing more.
        await wait_until(
            lambda: len(endpoint.deliveries) == 2,
            within=30,
            interval=POLL_INTERVAL,
            message="two deliveries open",
        )
        held = {d.task_id for d in endpoint.deliveries}
        leader = await leader_of(nats_server.url)
        by_id = {f"webhook-{i}": proc for i, proc in enumerate(stack.webhooks)}
        assert leader in by_id, leader
        victim = by_id.pop(leader)
        [survivor] = by_id.values()
        assert "webhook.gateway_started worker=ha-hook" in victim.log()
        killed.set()
        victim.kill9()

        await wait_tasks(admin, ids, TaskState.COMPLETED, within=40)
        assert await count_state(store, StoredState.COMPLETED) == len(ids)
        assert "webhook.gateway_started worker=ha-hook" in survivor.log()
        for task_id in ids:
            task = await admin.get_task(task_id)
            if task_id in held:
                # Its lease lapsed with the dead process; the reaper gave it back.
                assert attempts(endpoint, task_id) == [1, 2]
                assert task.retried == 1
                assert task.last_error == "lease expired"
            else:
                assert attempts(endpoint, task_id) == [1]
                assert task.retried == 0


async def test_paused_registration_gets_no_deliveries_until_resumed(
    cluster: Cluster,
) -> None:
    stack = await start_stack(cluster)
    [webhook] = stack.webhooks
    async with (
        Endpoint() as endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await register(admin, "paused-hook", endpoint.url, {"held": 1})
        await register(admin, "control-hook", endpoint.url, {"control": 1}, concurrency=1)
        probe = await client.enqueue("e2e.probe", {}, queue="held")
        await wait_state(admin, probe.id, TaskState.COMPLETED)

        await admin.pause_webhook_worker("paused-hook")
        assert (await admin.get_webhook_worker("paused-hook")).paused
        await wait_until(
            lambda: "webhook.gateway_drained worker=paused-hook" in webhook.log(),
            within=30,
            interval=POLL_INTERVAL,
            message="the paused registration's gateway drained",
        )
        task = await client.enqueue("e2e.wait", {}, queue="held")

        # The cluster keeps working meanwhile: a task enqueued after it on another
        # registration's queue is delivered and completes...
        control = await client.enqueue("e2e.control", {}, queue="control")
        await wait_state(admin, control.id, TaskState.COMPLETED)
        # ...and the webhook manager reconciles the registrations again, twice (each
        # concurrency change of the control registration restarts its gateway).
        started = "webhook.gateway_started worker=control-hook "
        for concurrency in (2, 3):
            seen = logged(webhook, started)
            await register(
                admin, "control-hook", endpoint.url, {"control": 1}, concurrency=concurrency
            )
            await wait_until(
                lambda seen=seen: logged(webhook, started) > seen,  # type: ignore[misc]
                within=30,
                interval=POLL_INTERVAL,
                message=f"control gateway restarted with concurrency {concurrency}",
            )
        assert (await admin.get_task(task.id)).state is TaskState.PENDING
        assert attempts(endpoint, task.id) == []
        assert (await admin.get_webhook_worker("paused-hook")).paused

        await admin.resume_webhook_worker("paused-hook")
        assert not (await admin.get_webhook_worker("paused-hook")).paused
        await wait_state(admin, task.id, TaskState.COMPLETED)
        assert attempts(endpoint, task.id) == [1]


# ------------------------------------------------------------------ CLI and input


async def conveyor_cli(*args: str) -> tuple[int | None, str, str]:
    """Run the ``conveyor`` command with ``args``: its exit code, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("conveyor")),
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode, out.decode(), err.decode()


async def test_cli_help_and_bad_registrations_get_clear_errors(
    cluster: Cluster, store: PostgresBroker
) -> None:
    # The CLI runs while the api starts.
    (help_rc, help_out, help_err), (bad_rc, _, bad_err), api = await asyncio.gather(
        conveyor_cli("serve", "webhook", "--help"),
        conveyor_cli("serve", "webhook", "--reconcile-tick", "-1"),
        cluster.start_api(),
    )
    assert help_rc == 0, help_err
    for flag in ("--reconcile-tick", "--callback-address", "--breaker-threshold", "--dsn"):
        assert flag in help_out, flag
    assert bad_rc == 2
    assert "invalid settings" in bad_err
    assert "reconcile_tick" in bad_err

    target = f"127.0.0.1:{api.port}"
    async with AsyncAdminClient(target) as admin:
        await register(admin, "kept", "http://127.0.0.1:9/hook", {"kept": 1})
        stored = await store.list_webhook_workers()
        listed = await admin.list_webhook_workers()

        bad: list[tuple[dict[str, Any], str]] = [
            ({"url": "ftp://example.com/hook"}, "invalid webhook url"),
            ({"url": "not a url"}, "invalid webhook url"),
            ({"queues": {}}, "at least one queue"),
            ({"queues": {"bad queue!": 1}}, "bad queue!"),
            ({"queues": {"kept": 0}}, "weight of queue"),
            ({"concurrency": 0}, "concurrency"),
            ({"concurrency": 1_000_000}, "concurrency must be 1.."),
            ({"timeout": 7200}, "timeout"),
            ({"timeout": 0}, "timeout"),
            ({"secrets": ["x" * 600]}, "secret"),
            ({"secrets": [f"s{i}" for i in range(11)]}, "secrets"),
            ({"secrets": ["one-character-would-do"]}, "at least 32 bytes"),
            ({"url": "http://169.254.169.254/latest/meta-data/"}, "link-local address"),
            ({"url": "http://127.0.0.2:5432/"}, "loopback address"),
            ({"url": "http://[::ffff:169.254.169.254]/"}, "in an IPv6 form"),
            ({"url": "http://10.0.0.1/"}, "private address"),
        ]
        for name in ("kept", "fresh"):
            for change, message in bad:
                fields: dict[str, Any] = {
                    "url": "http://127.0.0.1:9/other",
                    "queues": {"other": 1},
                    **change,
                }
                with pytest.raises(InvalidArgument, match=message):
                    await admin.upsert_webhook_worker(name, **fields)
        with pytest.raises(InvalidArgument, match="invalid webhook worker name"):
            await register(admin, "bad name!", "http://127.0.0.1:9/hook", {"kept": 1})
        with pytest.raises(WebhookWorkerNotFound):
            await admin.pause_webhook_worker("fresh")

        # Nothing stored changed: not the kept registration (secrets included), and no
        # new one.
        assert await store.list_webhook_workers() == stored
        assert await admin.list_webhook_workers() == listed
        with pytest.raises(WebhookWorkerNotFound):
            await admin.get_webhook_worker("fresh")


async def test_a_task_types_breaker_stops_failing_deliveries_and_a_probe_closes_it(
    cluster: Cluster, store: PostgresBroker
) -> None:
    """A webhook worker's breaker per task type: after 3 failed deliveries of one type
    that type goes to the endpoint no more (its tasks wait, PENDING) while the other type
    of the queue is still delivered; once the endpoint is fixed, the probe after the
    cool-down closes the breaker and the waiting tasks are delivered."""
    stack = await start_stack(cluster)
    broken = True

    async def answer(delivery: Delivery) -> web.StreamResponse:
        if delivery.call["params"]["type"] == "report.build" and broken:
            return await rpc("failure", error="reports are down")(delivery)
        return await rpc("success")(delivery)

    async with (
        Endpoint(answer=answer) as endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await admin.set_breaker_config(
            "reports", 3, window=60, cooldown=1.0, pattern="report.*", scope="worker"
        )
        await register(admin, "brk-hook", endpoint.url, {"reports": 1}, concurrency=2)
        reports = await client.enqueue_batch(
            [spec("report.build", {"i": i}, queue="reports", max_retry=0) for i in range(20)]
        )
        report_ids = {r.task.id for r in reports if r.task is not None}

        def report_deliveries() -> int:
            return sum(1 for d in endpoint.deliveries if d.task_id in report_ids)

        async def opened() -> bool:
            return any(b.state == "open" for b in await admin.list_breakers("reports"))

        await wait_until(opened, within=30, interval=POLL_INTERVAL, message="breaker opened")
        (breaker,) = await admin.list_breakers("reports")
        assert breaker.type == "report.build"
        assert breaker.worker_id == "webhook:brk-hook"
        failed = report_deliveries()
        # The three that opened it, and at most one more per slot that was already out.
        assert 3 <= failed <= 5
        invoices = await client.enqueue_batch(
            [spec("invoice.charge", {"i": i}, queue="reports") for i in range(50)]
        )
        invoice_ids = [r.task.id for r in invoices if r.task is not None]
        await wait_tasks(admin, invoice_ids, TaskState.COMPLETED)
        # Meanwhile at most the probes of the cool-downs went (each failed, reopening it).
        pending = [
            t
            for t in [await store.get_task(i) for i in report_ids]
            if t.state is StoredState.PENDING
        ]
        assert len(pending) >= 20 - report_deliveries()
        assert len(pending) >= 20 - failed - 4

        broken = False

        async def reports_done() -> bool:
            tasks = [await store.get_task(i) for i in report_ids]
            return all(t.state in (StoredState.COMPLETED, StoredState.ARCHIVED) for t in tasks)

        await wait_until(reports_done, within=60, interval=POLL_INTERVAL, message="reports done")

        async def closed() -> bool:
            return not await admin.list_breakers("reports")

        await wait_until(closed, within=30, interval=POLL_INTERVAL, message="breaker closed")
        delivered = Counter(d.task_id for d in endpoint.deliveries if d.task_id in report_ids)
        assert max(delivered.values()) == 1  # a task waiting behind it was never delivered


# ---------------------------------------------------------- aggregation groups


async def test_webhook_groups_are_one_call_per_group_and_every_member_completes(
    cluster: Cluster, store: PostgresBroker
) -> None:
    """A registration with batch types gets each due group of those types as one signed
    ``conveyor.batch`` call carrying every member; the answer's per-member results finish
    the members (a ``retry: false`` error archives its member); tasks of its other types
    still come one call each."""
    stack = await start_stack(cluster, env={"CONVEYOR_GROUP_TICK": "0.2"})

    async def answer(delivery: Delivery) -> web.StreamResponse:
        call = delivery.call
        if call["method"] == "conveyor.task":
            return await rpc("success")(delivery)
        results: list[dict[str, Any]] = []
        for task in call["params"]["tasks"]:
            value = json.loads(base64.b64decode(task["payload"]))
            if value["n"] == 2:
                results.append({"task_id": task["task_id"], "error": "bounced", "retry": False})
            else:
                echo = base64.b64encode(encoded({"sent": value["n"]})).decode()
                results.append({"task_id": task["task_id"], "result": echo})
        reply = {"outcome": "success", "results": results}
        return web.json_response({"jsonrpc": "2.0", "id": delivery.lease_id, "result": reply})

    async with (
        Endpoint(answer=answer) as endpoint,
        AsyncAdminClient(stack.target) as admin,
        AsyncClient(stack.target) as client,
    ):
        await register(
            admin,
            "batch-hook",
            endpoint.url,
            {"digests": 1},
            batch_types=["digest.send", "digest.send"],
        )
        worker = await admin.get_webhook_worker("batch-hook")
        assert worker.batch_types == ("digest.send",)
        # Due at 3 members (or 30 s after the first joined: never, in this test).
        await admin.set_group_config("digests", max_size=3, max_delay=30, grace_period=30)
        groups: dict[str, list[str]] = {}
        for user in ("user-1", "user-2"):
            for n in range(3):
                task = await client.enqueue(
                    "digest.send", {"n": n, "user": user}, queue="digests", group=user
                )
                groups.setdefault(user, []).append(task.id)
        single = await client.enqueue("invoice.charge", {"i": 1}, queue="digests")

        await wait_state(admin, single.id, TaskState.COMPLETED)
        for ids in groups.values():
            await wait_tasks(admin, ids[:2], TaskState.COMPLETED)
            [refused] = await wait_tasks(admin, ids[2:], TaskState.ARCHIVED)
            assert refused.last_error == "bounced"
            for n, task_id in enumerate(ids[:2]):
                assert (await client.get_task(task_id)).result == {"sent": n}

        batches = [d for d in endpoint.deliveries if d.call["method"] == "conveyor.batch"]
        assert len(batches) == 2, [d.call["params"].get("group") for d in batches]
        reference = StandardWebhook(SECRET)
        for delivery in batches:
            reference.verify(delivery.body, delivery.headers, json_parse=False)
            assert header(delivery, "webhook-id") == delivery.lease_id
            assert header(delivery, "Conveyor-Delivery") is None
            params = delivery.call["params"]
            assert (params["queue"], params["type"]) == ("digests", "digest.send")
            assert sorted(t["task_id"] for t in params["tasks"]) == sorted(groups[params["group"]])
            assert {t["attempt"] for t in params["tasks"]} == {1}
        assert [d.task_id for d in endpoint.deliveries if d.call["method"] == "conveyor.task"] == [
            single.id
        ]
