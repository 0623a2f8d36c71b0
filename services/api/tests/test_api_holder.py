"""The api process is the holder of its sessions' leases: it beats in the broker and on
NATS, and its gateways name it in their registrations, so a dispatcher leases each task
in its name (and the reaper releases them if the process dies)."""

from __future__ import annotations

import grpc
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.nats_connect import NatsClient
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi, WorkerStream


async def test_the_api_beats_as_the_holder_its_gateways_name(
    make_api: MakeApi, nc: NatsClient, subjects: Subjects
) -> None:
    bus = Bus(nc, subjects, cluster_auth())
    beats: list[str] = []
    registers: list[cluster_pb2.Register] = []
    await bus.subscribe(cluster_pb2.HolderBeat, lambda b: beats.append(b.holder))
    await bus.subscribe(cluster_pb2.Register, registers.append)
    await nc.flush()
    api = await make_api(holder_beat=0.05, instance_id="api-x")
    assert api.holder_beat is not None
    holder = api.holder_beat.holder
    assert holder.startswith("api-x~")
    await wait_until(lambda: beats.count(holder) >= 2, within=10)
    await wait_until(lambda: api.holder_beat is not None and api.holder_beat.stored >= 1)

    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stream = WorkerStream(channel)
        await stream.hello({"jobs": 1}, concurrency=2)
        await wait_until(lambda: any(r.queue == "jobs" for r in registers), within=10)
        await stream.close()
    assert {r.holder for r in registers if r.queue == "jobs"} == {holder}


async def test_without_beats_the_api_names_no_holder(make_api: MakeApi) -> None:
    api = await make_api(holder_beat=0)
    assert api.holder_beat is None
    assert api.gateway_config.holder == ""
