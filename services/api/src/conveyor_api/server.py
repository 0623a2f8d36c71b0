"""ApiServer: the api service's gRPC server, runnable in-process (``conveyor dev``, tests)."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import grpc
from conveyor_broker import Broker
from conveyor_broker.clock import Clock, SystemClock
from conveyor_gateway import (
    AckBatcher,
    BreakerConfigs,
    EnqueueCommitter,
    Gateway,
    GatewayConfig,
    HolderBeat,
    ResolvePublisher,
    WakePublisher,
    WorkerSpec,
    holder_name,
)
from conveyor_protos.v1 import cluster_pb2, service_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import ClusterAuth
from conveyor_runtime.cluster_view import NodeCard
from conveyor_runtime.decoding import add_service
from conveyor_runtime.events import EventGate
from conveyor_runtime.settings import ApiSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.tracing import tracing_enabled
from conveyor_runtime.webhook_urls import Resolve, UrlGuard, system_resolve
from conveyor_runtime.wire import DISPATCH_OVERHEAD, TaskDefaults
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from conveyor_api.admin_service import AdminService
from conveyor_api.admission import Admission
from conveyor_api.auth import BearerAuthInterceptor, ReadOnlyInterceptor
from conveyor_api.semver import parse_version
from conveyor_api.session import HELLO_TIMEOUT, FrameWriter, SessionRegistry, WorkerService
from conveyor_api.task_service import TaskService, wake_for
from conveyor_api.tls import server_credentials
from conveyor_api.tracing import TracingInterceptor
from conveyor_api.version import __version__
from conveyor_api.webhook_service import WebhookService

logger = logging.getLogger(__name__)

#: Room above the largest payload/result for the rest of a message (headers, options).
#: A payload a little over the limit gets our own INVALID_ARGUMENT naming the limit; a
#: message past this margin is refused by gRPC itself with RESOURCE_EXHAUSTED.
FRAME_HEADROOM = 256 * 1024
DEFAULT_CANCEL_REASON = "canceled by an operator"


def server_options(settings: ApiSettings) -> list[tuple[str, Any]]:
    """gRPC channel arguments: message size limits and keepalive for long-lived streams."""
    max_message = max(settings.max_payload, settings.max_result) + FRAME_HEADROOM
    return [
        ("grpc.max_receive_message_length", max_message),
        # Server pings an idle connection every 30 s and drops it after 10 s of silence,
        # so a worker that vanished without a FIN is noticed and its tasks released.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Let clients keepalive-ping as often as every 10 s without being kicked off.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        # Two api processes on one port would split sessions silently: fail instead.
        ("grpc.so_reuseport", 0),
    ]


#: The services this server registers, by name (registered with decoding.add_service).
_SERVICES = service_pb2.DESCRIPTOR.services_by_name


class ApiServer:
    """TaskService, WorkerService, AdminService and WebhookService on one gRPC port.

    ``broker`` and ``nc`` belong to the caller (it connects and closes them); the server
    only uses them. ``port`` is the bound port once :meth:`start` returns.
    """

    def __init__(
        self,
        settings: ApiSettings,
        broker: Broker,
        nc: NATS,
        clock: Clock | None = None,
        *,
        hello_timeout: float = HELLO_TIMEOUT,
        event_gate: EventGate | None = None,
        resolve: Resolve = system_resolve,
    ) -> None:
        """``resolve`` looks up webhook URL hosts at registration (tests give their own)."""
        parse_version(settings.min_sdk_version)  # fail at construction, not per session
        self.settings = settings
        self.broker = broker
        self.nc = nc
        self.clock: Clock = clock or SystemClock()
        self.subjects = Subjects(settings.subject_prefix)
        self.bus = Bus(nc, self.subjects, ClusterAuth.from_settings(settings))
        self.port = 0
        self.registry = SessionRegistry()
        #: This api in the cluster view: its worker sessions.
        self.card = NodeCard(
            self.bus, kind="api", instance=settings.instance_id, fill=self._describe
        )
        self.wakes = WakePublisher(self.bus)
        # The broker reports the ends of tasks others wait for (acks, failures, admin
        # cancels, archives and deletes): they go to the resolver.
        self.resolves = ResolvePublisher(self.bus, self.wakes)
        self.acks = AckBatcher(broker)
        self.committer = EnqueueCommitter(
            broker,
            window=settings.enqueue_batch_window,
            max_items=settings.enqueue_batch_max,
            on_commit=lambda results: wake_for(results, self.wakes, self.clock),
        )
        # This process holds the leases of its sessions' gateways: while it beats, they
        # are its own; once it stops (it died), the reaper releases them (see
        # conveyor_gateway.liveness). Without beats it names no holder.
        self.holder_beat: HolderBeat | None = None
        if settings.holder_beat > 0:
            self.holder_beat = HolderBeat(
                holder_name(settings.instance_id),
                broker=broker,
                bus=self.bus,
                tick=settings.holder_beat,
            )
        #: The breaker configs per task type its gateways count failures under.
        self.breaker_configs = BreakerConfigs(broker, bus=self.bus)
        self.gateway_config = GatewayConfig(
            lease_ttl=settings.lease_ttl_delta,
            register_tick=settings.register_tick,
            max_result=settings.max_result,
            timeout_grace=timedelta(seconds=settings.timeout_grace),
            clock=self.clock,
            outcome_backlog=settings.outcome_backlog,
            holder=self.holder_beat.holder if self.holder_beat is not None else "",
        )
        self._hello_timeout = hello_timeout
        self._event_gate = event_gate
        #: Where webhook URLs may point, and the keys of the webhook secrets.
        self.url_guard = UrlGuard(settings.address_policy(), resolve)
        self.keyring = settings.secret_keyring()
        self._server: grpc.aio.Server | None = None
        self._cancel_sub: Subscription | None = None
        self._admin: AdminService | None = None
        #: The bearer-token check (None: auth off); AdminService.WhoAmI asks it who called.
        self._auth: BearerAuthInterceptor | None = None

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if tracing_enabled():
            interceptors.append(TracingInterceptor())
        if self.settings.tokens:
            self._auth = BearerAuthInterceptor(self.settings.tokens)
            interceptors.append(self._auth)
        else:
            # ApiSettings refuses this combination unless allow_unauthenticated is set.
            logger.warning(
                "auth.DISABLED: no auth tokens configured and allow_unauthenticated is set; "
                "ANY client can enqueue, run workers and administer queues. Never do this "
                "outside development."
            )
        if self.settings.read_only:
            interceptors.append(ReadOnlyInterceptor())
        return interceptors

    def _make_gateway(self, session_id: str, spec: WorkerSpec, writer: FrameWriter) -> Gateway:
        return Gateway(
            session_id,
            spec,
            broker=self.broker,
            bus=self.bus,
            config=self.gateway_config,
            acks=self.acks,
            wakes=self.wakes,
            transport=writer,
            connected_at=self.clock.now(),
            breakers=self.breaker_configs,
        )

    async def start(self) -> None:
        """Bind the port, start serving, and listen for cancel broadcasts."""
        settings = self.settings
        server = grpc.aio.server(
            interceptors=self._interceptors(),
            options=server_options(settings),
            # Past it grpc refuses a call with RESOURCE_EXHAUSTED before any handler runs.
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs or None,
        )
        defaults = TaskDefaults(
            max_retry=settings.default_max_retry,
            retention=timedelta(seconds=settings.default_retention),
            max_payload=settings.max_payload,
            max_message=lambda: self.nc.max_payload,
        )
        if self.nc.max_payload and settings.max_payload + DISPATCH_OVERHEAD > self.nc.max_payload:
            logger.warning(
                "api.nats_max_payload_below_max_payload max_payload=%d nats_max_payload=%d: "
                "tasks whose dispatch would not fit in one NATS message are refused; raise "
                "the nats-server max_payload (see deploy/nats.conf)",
                settings.max_payload,
                self.nc.max_payload,
            )
        # Registered from the descriptors rather than with the generated add_*_to_server,
        # so an undecodable request gets INVALID_ARGUMENT (see conveyor_api.decoding).
        add_service(
            server,
            _SERVICES["TaskService"],
            TaskService(
                self.broker,
                self.clock,
                defaults,
                self.committer,
                self.wakes,
                Admission(
                    self.broker,
                    limit=settings.enqueue_backlog_limit,
                    wait=settings.enqueue_admission_wait,
                ),
            ),
        )
        add_service(
            server,
            _SERVICES["WorkerService"],
            WorkerService(
                registry=self.registry,
                clock=self.clock,
                config=self.gateway_config,
                server_version=__version__,
                min_sdk_version=settings.min_sdk_version,
                make_gateway=self._make_gateway,
                hello_timeout=self._hello_timeout,
                max_pending_frames=settings.session_max_pending_frames,
                write_timeout=settings.session_write_timeout,
                broker=self.broker,
            ),
        )
        self._admin = AdminService(
            broker=self.broker,
            bus=self.bus,
            wakes=self.wakes,
            registry=self.registry,
            server_version=__version__,
            clock=self.clock,
            event_gate=self._event_gate,
            url_guard=self.url_guard,
            keyring=self.keyring,
            task_defaults=defaults,
            instance=settings.instance_id,
            card=self.card,
            cluster_info_window=settings.cluster_info_window,
            caller=self._auth.caller if self._auth is not None else None,
            read_only=settings.read_only,
        )
        add_service(server, _SERVICES["AdminService"], self._admin)
        add_service(
            server,
            _SERVICES["WebhookService"],
            WebhookService(
                broker=self.broker,
                bus=self.bus,
                max_result=settings.max_result,
                keyring=self.keyring,
            ),
        )
        address = f"{settings.host}:{settings.port}"
        credentials = server_credentials(settings)
        self.port = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
        if self.port == 0:
            raise OSError(f"could not bind {settings.host}:{settings.port}")
        self._cancel_sub = await self.bus.subscribe(
            cluster_pb2.CancelBroadcast, self._on_cancel_broadcast
        )
        await self.card.start()
        self.resolves.attach(self.broker)
        await self.nc.flush()
        await server.start()
        self._server = server
        if self.holder_beat is not None:
            self.holder_beat.start()
        await self.breaker_configs.start()
        logger.info(
            "api.started host=%s port=%d version=%s tls=%s auth=%s read_only=%s",
            settings.host,
            self.port,
            __version__,
            ("mutual" if settings.tls_client_ca else "on") if credentials else "OFF",
            "on" if settings.tokens else "OFF",
            settings.read_only,
        )

    def _describe(self, node: service_pb2.ClusterNode) -> None:
        for gateway in self.registry.gateways.values():
            node.sessions.append(gateway.session_info())
            node.sessions[-1].node = self.settings.instance_id

    def _on_cancel_broadcast(self, request: cluster_pb2.CancelBroadcast) -> None:
        # One subscription per process, routed here, rather than one per session.
        if request.task_id:
            self.registry.cancel_task(request.task_id, request.reason or DEFAULT_CANCEL_REASON)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop gracefully: end every session (releasing its tasks at once), let unary
        calls finish for up to ``grace`` seconds, commit what is queued, flush NATS."""
        server, self._server = self._server, None
        if server is None:
            return
        await self.card.stop()
        stopping = asyncio.get_running_loop().create_task(server.stop(grace))
        if self._admin is not None:
            self._admin.end_watches()
        await self.registry.shutdown()
        await stopping
        # A session that finished its Hello while we were stopping.
        await self.registry.shutdown()
        await self.committer.aclose()
        await self.acks.aclose()
        self.resolves.detach(self.broker)
        await self.resolves.aclose()
        await self.wakes.aclose()
        # Only now: every session released what it held (what it could not release, the
        # reaper will, once this holder is silent).
        if self.holder_beat is not None:
            await self.holder_beat.stop()
        await self.breaker_configs.aclose()
        if self._cancel_sub is not None:
            try:
                await self._cancel_sub.unsubscribe()
            except Exception as exc:
                logger.debug("api.unsubscribe_failed error=%r", exc)
        try:
            await self.nc.flush(timeout=2)
        except Exception as exc:
            logger.warning("api.nats_flush_failed error=%r", exc)
        logger.info("api.stopped port=%d", self.port)
