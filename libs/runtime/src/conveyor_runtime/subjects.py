"""The NATS subjects services coordinate over.

Every message on them is a hint: losing one may delay work, never lose or duplicate it.
Payloads are the protobuf messages of ``conveyor_protos.v1.cluster_pb2`` (the messages of
``protos/conveyor/v1/cluster.proto``), and ``service_pb2.TaskEvent`` for events, several
to a message (see :func:`conveyor_runtime.wire.encode_events`). Services send and
receive them through :class:`conveyor_runtime.bus.Bus`, which knows which message goes on
which subject; this module only spells the subjects.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject names under a configurable prefix (default ``conveyor``)."""

    prefix: str = "conveyor"

    # ---- per queue: api/maintenance/gateways -> dispatcher
    def wake(self, queue: str) -> str:
        """``Wake``: due work may exist on ``queue``."""
        return f"{self.prefix}.q.{queue}.wake"

    def register(self, queue: str) -> str:
        """``Register``: a gateway's capacity for ``queue``."""
        return f"{self.prefix}.q.{queue}.register"

    def done(self, queue: str) -> str:
        """``Done``: credit refill after completions."""
        return f"{self.prefix}.q.{queue}.done"

    def groups(self, queue: str) -> str:
        """``GroupsDue``: aggregation groups of ``queue`` the sweeper found due."""
        return f"{self.prefix}.q.{queue}.groups"

    def control(self, queue: str) -> str:
        """``Control``: pause/resume or limits changed; reload from the broker."""
        return f"{self.prefix}.q.{queue}.control"

    def owner_changed(self, queue: str) -> str:
        """Dispatcher -> gateways (empty body): a new owner claimed ``queue``; re-register now."""
        return f"{self.prefix}.q.{queue}.owner"

    def queue_wildcard(self, kind: str) -> str:
        """Subscribe to ``kind`` (wake, register, done, control, owner) for every queue."""
        return f"{self.prefix}.q.*.{kind}"

    @staticmethod
    def queue_of(subject: str) -> str:
        """The queue token of a ``<prefix>.q.<queue>.<kind>`` subject."""
        return subject.rsplit(".", 2)[-2]

    # ---- dispatcher -> gateways
    def roll_call(self) -> str:
        """Roll call (empty body): a dispatcher started; every gateway re-registers on
        every queue it serves now, so that the dispatcher learns at once which queues
        have workers (and claims those) instead of at the next register tick."""
        return f"{self.prefix}.rollcall"

    # ---- api -> maintenance
    def promote(self) -> str:
        """Promote hint (empty body): scheduled tasks fall due now; the scheduler leader
        runs a pass at once instead of at its next tick."""
        return f"{self.prefix}.promote"

    # ---- per gateway: dispatcher/api -> gateway
    def dispatch(self, gateway: str) -> str:
        """Request/reply ``DispatchRequest`` -> ``DispatchReply``."""
        return f"{self.prefix}.gw.{gateway}.dispatch"

    def cancel(self) -> str:
        """``CancelBroadcast`` to every gateway: abort a running task if you hold it."""
        return f"{self.prefix}.cancel"

    # ---- webhook workers: api -> webhook gateway
    def webhook_callback(self, worker: str) -> str:
        """Request/reply ``WebhookCallback`` -> ``WebhookCallbackReply`` (queue group
        ``webhook``): an endpoint's callback for a delivery of webhook worker ``worker``."""
        return f"{self.prefix}.webhook.{worker}.callback"

    # ---- events and dependency resolution
    def events(self, queue: str, state: str) -> str:
        """``TaskEvent`` batch: tasks of ``queue`` entered ``state``."""
        return f"{self.prefix}.events.{queue}.{state}"

    def events_wildcard(self) -> str:
        """Every lifecycle event."""
        return f"{self.prefix}.events.>"

    def watch(self) -> str:
        """``Watch`` announcements (empty body): someone watches lifecycle events, so every
        process publishes them for a while (see :class:`conveyor_runtime.events.EventGate`).
        Outside ``events.>`` on purpose: watchers of every event never see it."""
        return f"{self.prefix}.watch"

    def resolve(self) -> str:
        """``Resolve`` (queue group ``resolvers``): a task reached a terminal state."""
        return f"{self.prefix}.resolve"

    # ---- liveness
    def holder_beat(self) -> str:
        """``HolderBeat``: an api process, a holder of leases, is alive (maintenance's
        reaper spares the holders it hears from)."""
        return f"{self.prefix}.holder.beat"

    def dispatcher_beat(self) -> str:
        """``DispatcherBeat``: a dispatcher is alive, or (``leaving``) stopping; the
        others take the queues of one gone silent over at once."""
        return f"{self.prefix}.dispatcher.beat"

    # ---- the cluster view
    def cluster_nodes(self) -> str:
        """``NodesRequest`` (request, many replies): every service process answers with a
        ``ClusterNode`` describing itself."""
        return f"{self.prefix}.cluster.nodes"

    # ---- JetStream key-value buckets
    @property
    def owners_bucket(self) -> str:
        """KV bucket: queue -> dispatcher instance that owns it."""
        return f"{self.prefix}_owners"

    @property
    def leaders_bucket(self) -> str:
        """KV bucket: singleton role (reaper, scheduler, ...) -> instance that leads it."""
        return f"{self.prefix}_leaders"
