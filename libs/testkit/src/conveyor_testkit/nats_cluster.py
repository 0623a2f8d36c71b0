"""A JetStream cluster of private nats-servers for tests: every node on loopback, on free
ports, with its own store, routed to every other."""

from __future__ import annotations

import contextlib
from types import TracebackType

import nats.errors
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_runtime.nats_connect import close_nats, connect_nats
from nats.js.api import StorageType

from conveyor_testkit.polling import wait_until

__all__ = ["NatsCluster"]


class NatsCluster:
    """``size`` nats-servers forming one cluster (named ``conveyor``); node ``i`` is
    ``n<i>``. Start it with ``with``, then :meth:`ready` before using JetStream."""

    def __init__(self, size: int = 3) -> None:
        route_ports = [free_port() for _ in range(size)]
        routes = ", ".join(f"nats-route://127.0.0.1:{port}" for port in route_ports)
        self.nodes = [
            EmbeddedNats(
                config=(
                    f"server_name: n{i}\n"
                    f"cluster {{\n  name: conveyor\n  listen: 127.0.0.1:{port}\n"
                    f"  routes: [{routes}]\n}}\n"
                )
            )
            for i, port in enumerate(route_ports)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (``CONVEYOR_NATS_URL``)."""
        return ",".join(node.url for node in self.nodes)

    def node(self, port: int) -> EmbeddedNats:
        """The node whose client port is ``port``."""
        (found,) = [node for node in self.nodes if node.port == port]
        return found

    def start(self) -> None:
        """Start every node (each returns once it listens)."""
        for node in self.nodes:
            node.start()

    def stop(self) -> None:
        """Stop every node and remove their stores."""
        for node in self.nodes:
            node.stop()

    async def ready(self, within: float = 60.0) -> None:
        """Return once the cluster's JetStream can hold a bucket with a replica on every
        node (it elects its leaders some seconds after the nodes start)."""
        nc = await connect_nats(self.url, name="cluster-ready")
        try:
            js = nc.jetstream(timeout=2.0)

            async def holds_a_bucket() -> bool:
                try:
                    await js.create_key_value(
                        bucket="cluster_ready",
                        history=1,
                        storage=StorageType.MEMORY,
                        replicas=len(self.nodes),
                    )
                except (nats.errors.Error, TimeoutError):
                    return False
                return True

            await wait_until(
                holds_a_bucket, within=within, interval=0.2, message="the NATS cluster ready"
            )
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await js.delete_key_value("cluster_ready")
        finally:
            await close_nats(nc, drain=False)

    def __enter__(self) -> NatsCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
