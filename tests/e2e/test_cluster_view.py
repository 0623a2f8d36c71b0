"""The cluster view through real processes: two api processes, two dispatchers, two
maintenance instances and a webhook service, each describing itself to GetClusterInfo
over NATS; the SDK's ``cluster_info()`` and ``conveyor cluster`` show the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, ClusterInfo
from conveyor_runtime.embedded_nats import free_port
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster, conveyor_cli

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

#: rich cuts table columns to the terminal width: none is cut short here.
WIDE = {"COLUMNS": "250"}
ROLES = {"reaper", "scheduler", "resolver", "webhook-manager"}


def kinds(info: ClusterInfo) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for node in info.nodes:
        found.setdefault(node.kind, set()).add(node.instance)
    return found


async def test_every_node_session_owner_leader_and_webhook_gateway_is_shown(
    cluster: Cluster, tmp_path: Path
) -> None:
    apis = [
        await cluster.start_api({"CONVEYOR_INSTANCE_ID": f"api-{i}"}, port=free_port())
        for i in range(2)
    ]
    for i in range(2):
        cluster.start_dispatcher({"CONVEYOR_INSTANCE_ID": f"dispatcher-{i}"})
        cluster.start_maintenance({"CONVEYOR_INSTANCE_ID": f"maintenance-{i}"})
    cluster.start_webhook({"CONVEYOR_INSTANCE_ID": "webhook-0"})
    targets = [f"127.0.0.1:{api.port}" for api in apis]
    # One worker on each api, serving a queue of its own.
    for i, target in enumerate(targets):
        cluster.start_worker(
            target, queues={f"view-{i}": 1}, concurrency=3, record=tmp_path / f"w{i}.txt"
        )

    async with AsyncAdminClient(targets[0]) as admin:
        await admin.upsert_webhook_worker(
            "hooks",
            f"http://127.0.0.1:{free_port()}/hook",
            {"view-hooks": 2},
            concurrency=4,
            secrets=["s" * 40],  # a registration without a secret has no gateway
        )
        latest: list[ClusterInfo] = []

        async def complete() -> bool:
            info = await admin.cluster_info()
            latest[:] = [info]
            return (
                kinds(info)
                == {
                    "api": {"api-0", "api-1"},
                    "dispatcher": {"dispatcher-0", "dispatcher-1"},
                    "maintenance": {"maintenance-0", "maintenance-1"},
                    "webhook": {"webhook-0"},
                }
                and {s.node for s in info.sessions} == {"api-0", "api-1"}
                and {"view-0", "view-1", "view-hooks"} <= set(info.queue_owners)
                and set(info.leaders) >= ROLES
                and [g.worker for g in info.webhook_gateways] == ["hooks"]
            )

        try:
            await wait_until(complete, within=60, interval=0.2, message="a complete view")
        finally:
            print(latest)
        [info] = latest
        assert info.answered_by == "api-0"
        assert info.broker == "postgres"
        by_node = {s.node: s for s in info.sessions}
        assert dict(by_node["api-0"].queues) == {"view-0": 1}
        assert dict(by_node["api-1"].queues) == {"view-1": 1}
        assert all(s.concurrency == 3 for s in info.sessions)
        # Each api node lists exactly its own sessions.
        for node in info.of_kind("api"):
            assert [s.node for s in node.sessions] == [node.instance]
            assert node.pid in {api.pid for api in apis}
        # Owners are dispatchers that say they own the queue; leaders hold their roles.
        dispatchers = {n.instance: n for n in info.of_kind("dispatcher")}
        for queue, owner in info.queue_owners.items():
            assert queue in dispatchers[owner].owned_queues
        leaders = {n.instance: n for n in [*info.of_kind("maintenance"), *info.of_kind("webhook")]}
        for role, holder in info.leaders.items():
            assert role in leaders[holder].leader_roles
        [gateway] = info.webhook_gateways
        assert gateway.node == "webhook-0"
        assert dict(gateway.queues) == {"view-hooks": 2}
        assert (gateway.concurrency, gateway.breaker, gateway.paused) == (4, "closed", False)

        # The other api answers with the same cluster.
        async with AsyncAdminClient(targets[1]) as other:
            seen = await other.cluster_info()
        assert seen.answered_by == "api-1"
        assert kinds(seen) == kinds(info)

        # conveyor cluster --json prints the same view.
        code, out, err = await conveyor_cli("cluster", "--json", "--target", targets[1], env=WIDE)
        assert code == 0, err
        printed = json.loads(out)
        assert printed["answered_by"] == "api-1"
        assert {n["instance"] for n in printed["nodes"]} == set().union(*kinds(info).values())
        code, out, err = await conveyor_cli("cluster", "--target", targets[0], env=WIDE)
        assert code == 0, err
        assert "dispatcher-1" in out
        assert "webhook-manager" in out

        # A dead api leaves the view, its sessions with it.
        apis[1].kill9()

        async def gone() -> bool:
            info = await admin.cluster_info()
            return kinds(info)["api"] == {"api-0"} and {s.node for s in info.sessions} == {"api-0"}

        await wait_until(gone, within=30, interval=POLL_INTERVAL, message="api-1 gone")
