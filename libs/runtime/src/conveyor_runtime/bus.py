"""The services' NATS messages, typed: publish and subscribe by message type.

A :class:`Bus` wraps a NATS connection and the :class:`~conveyor_runtime.subjects.Subjects`
of a prefix. Call sites hand it ``cluster_pb2`` messages and get decoded ones back; the
subject (and queue group) of each message type, its serialization and what to do with
bytes that do not decode live here, once:

- ``Wake``, ``Register``, ``Done``, ``Control``, ``GroupsDue`` go on their queue's subjects
  (the message's
  ``queue`` field names the queue); ``CancelBroadcast`` on ``cancel``, ``Resolve`` on
  ``resolve`` (queue group ``resolvers``), ``HolderBeat`` on ``holder.beat`` and
  ``DispatcherBeat`` on ``dispatcher.beat``: :meth:`Bus.publish`, :meth:`Bus.subscribe`.
- Request/reply: ``DispatchRequest`` -> ``DispatchReply`` per gateway
  (:meth:`Bus.dispatch`, :meth:`Bus.serve_dispatch`) and ``WebhookCallback`` ->
  ``WebhookCallbackReply`` per webhook worker, queue group ``webhook``
  (:meth:`Bus.webhook_callback`, :meth:`Bus.serve_webhook_callbacks`).
- Request/many replies: ``NodesRequest`` -> a ``ClusterNode`` from every service process
  (:meth:`Bus.gather_nodes`, :meth:`Bus.serve_nodes`).
- Hints with an empty body: promote, watch, roll call and owner changed, each a pair of
  methods.
- Lifecycle events, several to a message (:meth:`Bus.publish_events`,
  :meth:`Bus.subscribe_events`; the format is :func:`conveyor_runtime.wire.encode_events`).

Every message is a hint (see :mod:`conveyor_runtime.subjects`), so a subscription logs and
drops a payload that does not decode, and keeps going.

Every message the bus sends is sealed with the cluster key, and every one it receives is
checked before anything decodes it (:mod:`conveyor_runtime.cluster_key`): a MAC over the
subject, the body and the time it was sent, in a NATS header. What cannot be verified
(no seal, a wrong MAC, an unknown key, older than 30 s, a request past its deadline) is
dropped and logged, never acted on: a subscription's handler never sees it, a request is
not answered, and a reply that does not verify is ignored while the request waits on for
the real one. Requests carry a deadline (``within``): a dispatch that reaches its gateway
after the dispatcher gave up on it is refused there, and the dispatcher waits
:data:`REPLY_GRACE` longer than the deadline for the reply of one accepted just in time.

Publishing and subscribing are on every service's hot path, so the bus adds nothing per
message but a dict lookup by type (to find the subject), one HMAC each way (one per
message, however many tasks it carries) and the decode the handler needed anyway:
:meth:`Bus.publish` returns the connection's publish for the caller to await (no
coroutine of its own), and a handler may be a plain function, called inline by the
subscription's callback, or a coroutine function, awaited there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeAlias, TypeVar

from conveyor_broker.types import TaskEvent
from conveyor_protos.v1 import cluster_pb2, service_pb2
from google.protobuf.message import DecodeError
from nats import errors as nats_errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from conveyor_runtime.cluster_key import ClusterAuth
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.wire.events import (
    decode_events,
    encode_event_protos,
    encode_events,
    event_state_token,
)

logger = logging.getLogger(__name__)

_Wake = cluster_pb2.Wake
_Register = cluster_pb2.Register
_Done = cluster_pb2.Done
_Control = cluster_pb2.Control
_GroupsDue = cluster_pb2.GroupsDue
_CancelBroadcast = cluster_pb2.CancelBroadcast
_Resolve = cluster_pb2.Resolve
_HolderBeat = cluster_pb2.HolderBeat
_DispatcherBeat = cluster_pb2.DispatcherBeat

#: The messages :meth:`Bus.publish` takes.
Published: TypeAlias = (
    _Wake
    | _Register
    | _Done
    | _Control
    | _GroupsDue
    | _CancelBroadcast
    | _Resolve
    | _HolderBeat
    | _DispatcherBeat
)
#: A message type :meth:`Bus.subscribe` takes, and what its handler gets.
M = TypeVar(
    "M",
    _Wake,
    _Register,
    _Done,
    _Control,
    _GroupsDue,
    _CancelBroadcast,
    _Resolve,
    _HolderBeat,
    _DispatcherBeat,
)

#: The queue group of the resolvers: one of them handles each ``Resolve``.
RESOLVE_GROUP = "resolvers"
#: The queue group of the webhook managers: one of them answers each callback.
WEBHOOK_GROUP = "webhook"
#: The reply to a webhook callback that does not decode.
MALFORMED_CALLBACK = cluster_pb2.WebhookCallbackReply(
    status=cluster_pb2.WebhookCallbackReply.STATUS_INVALID, message="malformed callback"
)
#: Seconds a requester waits for a reply past the deadline its request carries: a reply
#: the receiver sent just before the deadline still arrives in time to count.
REPLY_GRACE = 0.5
#: Seconds between two log lines about refused messages of one kind (the count of those
#: in between is in the next line): a flood of forgeries must not flood the logs too.
REFUSAL_LOG_PERIOD = 5.0


class Refusals:
    """What a bus refused, by message kind (for the logs, the tests and a curious
    operator). Logged at most once per :data:`REFUSAL_LOG_PERIOD` per kind and reason
    code (the count of those in between is in the next line)."""

    __slots__ = ("_logged_at", "_since_log", "counts")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logged_at: dict[tuple[str, str], float] = {}
        self._since_log: dict[tuple[str, str], int] = {}

    def refuse(self, kind: str, subject: str, reason: str) -> None:
        """Count a refused ``kind`` message on ``subject``; log it unless one of its kind
        was refused for the same reason lately."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        code, _, detail = reason.partition(":")
        key = (kind, code)
        self._since_log[key] = self._since_log.get(key, 0) + 1
        now = time.monotonic()
        last = self._logged_at.get(key)
        if last is not None and now - last < REFUSAL_LOG_PERIOD:
            return
        self._logged_at[key] = now
        count, self._since_log[key] = self._since_log[key], 0
        logger.warning(
            "bus.refused kind=%s subject=%s reason=%s count=%d%s: not acted on (no valid "
            "seal of the cluster key: forged, replayed, late, or from a service with "
            "another CONVEYOR_CLUSTER_KEY)",
            kind,
            subject,
            code,
            count,
            f" detail={detail.strip()!r}" if detail else "",
        )


class Bus:
    """Typed publish, subscribe and request/reply over ``nc`` under ``subjects``, every
    message sealed and checked with ``auth`` (the cluster key).

    ``nc`` stays the caller's (the bus never closes it). Subscriptions are plain NATS
    subscriptions: unsubscribe them to stop. ``refusals`` counts what was refused.
    """

    __slots__ = (
        "_auth",
        "_fixed",
        "_per_queue",
        "_replies",
        "_route",
        "nc",
        "refusals",
        "subjects",
    )

    def __init__(self, nc: NatsClient, subjects: Subjects, auth: ClusterAuth) -> None:
        self.nc = nc
        self.subjects = subjects
        self._auth = auth
        self.refusals = Refusals()
        self._replies = _Replies(nc, auth, self.refusals)
        wake, register, done, control = (
            subjects.wake,
            subjects.register,
            subjects.done,
            subjects.control,
        )
        cancel, resolve = subjects.cancel(), subjects.resolve()
        holder_beat, dispatcher_beat = subjects.holder_beat(), subjects.dispatcher_beat()
        # Per type, where publish puts a message: a fixed subject (tail None), or the
        # subject ``head + message.queue + tail``, cut once out of the Subjects spelling
        # so that a publish costs a concatenation rather than two calls.
        self._route: dict[type[Published], tuple[str, str | None]] = {
            _Wake: _around_queue(wake),
            _Register: _around_queue(register),
            _Done: _around_queue(done),
            _Control: _around_queue(control),
            _GroupsDue: _around_queue(subjects.groups),
            _CancelBroadcast: (cancel, None),
            _Resolve: (resolve, None),
            _HolderBeat: (holder_beat, None),
            _DispatcherBeat: (dispatcher_beat, None),
        }
        # Per type, what subscribe subscribes to.
        self._per_queue: dict[type[Published], Callable[[str], str]] = {
            _Wake: wake,
            _Register: register,
            _Done: done,
            _Control: control,
            _GroupsDue: subjects.groups,
        }
        self._fixed: dict[type[Published], tuple[str, str]] = {
            _CancelBroadcast: (cancel, ""),
            _Resolve: (resolve, RESOLVE_GROUP),
            _HolderBeat: (holder_beat, ""),
            _DispatcherBeat: (dispatcher_beat, ""),
        }

    @property
    def auth(self) -> ClusterAuth:
        """What seals and checks this bus's messages."""
        return self._auth

    @property
    def max_payload(self) -> int:
        """The most bytes one message carries on the server connected now (0: unknown)."""
        return self.nc.max_payload

    def _send(self, subject: str, body: bytes) -> Awaitable[None]:
        return self.nc.publish(subject, body, headers=self._auth.seal(subject, body))

    def _verified(self, kind: str, msg: Msg) -> bool:
        """True when ``msg`` may be acted on; else it is counted and logged."""
        reason = self._auth.check(msg.subject, msg.data, msg.headers)
        if reason is None:
            return True
        self.refusals.refuse(kind, msg.subject, reason)
        return False

    # ------------------------------------------------------------ typed messages

    def publish(self, message: Published) -> Awaitable[None]:
        """Publish ``message`` on its type's subject, sealed (await the result).

        Raises TypeError for a message type the bus does not publish.
        """
        try:
            head, tail = self._route[type(message)]
        except KeyError:
            raise TypeError(f"the bus does not publish {type(message).__name__}") from None
        if tail is not None:
            per_queue: Any = message  # every type with a tail has a queue field
            # One f-string: two + would build (and copy) an intermediate string.
            head = f"{head}{per_queue.queue}{tail}"
        return self._send(head, message.SerializeToString())

    async def subscribe(
        self, kind: type[M], handler: Callable[[M], Awaitable[None] | None], *, queue: str = "*"
    ) -> Subscription:
        """Deliver every verified ``kind`` message, decoded, to ``handler``.

        For the per-queue types (Wake, Register, Done, Control), ``queue`` picks one queue;
        the default ``*`` takes every queue's. Resolve is subscribed in its queue group.
        A message that does not verify, or whose payload does not decode, is logged and
        dropped.
        """
        per_queue = self._per_queue.get(kind)
        if per_queue is not None:
            subject, group = per_queue(queue), ""
        elif kind in self._fixed:
            if queue != "*":
                raise ValueError(f"{kind.__name__} is not a per-queue message")
            subject, group = self._fixed[kind]
        else:
            raise TypeError(f"the bus does not subscribe to {kind.__name__}")
        return await self.nc.subscribe(subject, queue=group, cb=self._decoding(kind, handler))

    def _decoding(
        self, kind: type[M], handler: Callable[[M], Awaitable[None] | None]
    ) -> Callable[[Msg], Awaitable[None]]:
        """The subscription callback that checks and decodes a ``kind`` and hands it to
        ``handler``."""
        from_string = kind.FromString
        name = kind.__name__
        check = self._auth.check
        refuse = self.refusals.refuse

        async def on_msg(msg: Msg) -> None:
            reason = check(msg.subject, msg.data, msg.headers)
            if reason is not None:
                refuse(name, msg.subject, reason)
                return
            try:
                message = from_string(msg.data)
            except DecodeError:
                logger.warning("bus.undecodable kind=%s subject=%s", name, msg.subject)
                return
            result = handler(message)
            if result is not None:
                await result

        return on_msg

    # ----------------------------------------------------------- request/reply

    async def dispatch(
        self, gateway: str, request: cluster_pb2.DispatchRequest, *, within: float
    ) -> cluster_pb2.DispatchReply:
        """Offer ``request`` to ``gateway``: refused there unless it arrives within
        ``within`` seconds; its reply, awaited :data:`REPLY_GRACE` longer.

        Raises NoRespondersError, nats' TimeoutError (no verified reply in time) or what
        the NATS publish raises, and DecodeError for a reply that does not decode.
        """
        msg = await self._replies.request(
            "DispatchReply",
            self.subjects.dispatch(gateway),
            request.SerializeToString(),
            within=within,
        )
        return cluster_pb2.DispatchReply.FromString(msg.data)

    async def _respond(self, msg: Msg, reply: bytes) -> None:
        """Send ``reply`` (sealed for the requester's inbox) to ``msg``'s requester."""
        if not msg.reply:
            return
        try:
            await self._send(msg.reply, reply)
        except Exception as exc:
            # The requester times out and treats the request as unanswered (the
            # dispatcher releases what it offered; the broker's lease keeps a task this
            # gateway took meanwhile from going wrong).
            logger.warning("bus.reply_failed subject=%s error=%r", msg.subject, exc)

    async def serve_dispatch(
        self,
        gateway: str,
        handler: Callable[[cluster_pb2.DispatchRequest], cluster_pb2.DispatchReply],
    ) -> Subscription:
        """Answer the dispatch requests sent to ``gateway`` with ``handler``'s replies.

        ``handler`` is a plain function: it runs inline in the subscription's callback.
        A request that does not verify (forged, replayed, or past its deadline: the
        dispatcher gave up on it and releases its tasks) is dropped unanswered; one that
        does not decode is answered as an empty one would be, so the dispatcher hears at
        once instead of waiting for its timeout.
        """

        async def on_request(msg: Msg) -> None:
            if not self._verified("DispatchRequest", msg):
                return
            try:
                request = cluster_pb2.DispatchRequest.FromString(msg.data)
            except DecodeError:
                logger.warning("bus.undecodable kind=DispatchRequest subject=%s", msg.subject)
                request = cluster_pb2.DispatchRequest()
            await self._respond(msg, handler(request).SerializeToString())

        return await self.nc.subscribe(self.subjects.dispatch(gateway), cb=on_request)

    async def webhook_callback(
        self, callback: cluster_pb2.WebhookCallback, *, within: float
    ) -> cluster_pb2.WebhookCallbackReply:
        """Route ``callback`` to the gateway of its webhook worker (``callback.worker``):
        refused there unless it arrives within ``within`` seconds; the gateway's reply,
        awaited :data:`REPLY_GRACE` longer.

        Raises NoRespondersError, nats' TimeoutError (no verified reply in time),
        MaxPayloadError or what else the NATS publish raises, and DecodeError for a reply
        that does not decode.
        """
        msg = await self._replies.request(
            "WebhookCallbackReply",
            self.subjects.webhook_callback(callback.worker),
            callback.SerializeToString(),
            within=within,
        )
        return cluster_pb2.WebhookCallbackReply.FromString(msg.data)

    async def serve_webhook_callbacks(
        self,
        worker: str,
        handler: Callable[
            [cluster_pb2.WebhookCallback], Awaitable[cluster_pb2.WebhookCallbackReply]
        ],
        *,
        spawn: Callable[[Coroutine[Any, Any, None]], object] | None = None,
    ) -> Subscription:
        """Answer the callbacks of webhook worker ``worker`` (in queue group ``webhook``:
        one subscriber of the group gets each) with ``handler``'s replies.

        With ``spawn``, each callback's answer is a coroutine handed to it (to run in a
        task of its own, say, so a slow one does not hold up the others); without, the
        callbacks are answered one after another. One that does not verify is dropped
        unanswered; one that does not decode is answered :data:`MALFORMED_CALLBACK`.
        """

        async def answer(msg: Msg) -> None:
            try:
                callback = cluster_pb2.WebhookCallback.FromString(msg.data)
            except DecodeError:
                logger.warning("bus.undecodable kind=WebhookCallback subject=%s", msg.subject)
                reply = MALFORMED_CALLBACK
            else:
                reply = await handler(callback)
            await self._respond(msg, reply.SerializeToString())

        async def cb(msg: Msg) -> None:
            # Checked here, before a task is spawned for it: a flood of forgeries costs
            # an HMAC each, nothing more.
            if not self._verified("WebhookCallback", msg):
                return
            if spawn is None:
                await answer(msg)
            else:
                spawn(answer(msg))

        return await self.nc.subscribe(
            self.subjects.webhook_callback(worker), queue=WEBHOOK_GROUP, cb=cb
        )

    async def gather_nodes(self, *, within: float) -> list[service_pb2.ClusterNode]:
        """Ask every service process to describe itself; the verified answers that arrive
        within ``within`` seconds (one that does not decode is logged and skipped)."""
        nodes = []
        for msg in await self._replies.gather(
            "ClusterNode",
            self.subjects.cluster_nodes(),
            cluster_pb2.NodesRequest().SerializeToString(),
            within=within,
        ):
            try:
                nodes.append(service_pb2.ClusterNode.FromString(msg.data))
            except DecodeError:
                logger.warning("bus.undecodable kind=ClusterNode subject=%s", msg.subject)
        return nodes

    async def serve_nodes(self, describe: Callable[[], service_pb2.ClusterNode]) -> Subscription:
        """Answer every verified ``NodesRequest`` with ``describe()`` (a plain function,
        run inline). Every subscriber answers: this is not a queue group."""

        async def on_request(msg: Msg) -> None:
            if not self._verified("NodesRequest", msg):
                return
            await self._respond(msg, describe().SerializeToString())

        return await self.nc.subscribe(self.subjects.cluster_nodes(), cb=on_request)

    # ------------------------------------------------------ empty-body hints

    def publish_promote(self) -> Awaitable[None]:
        """Ask the scheduler leader for a pass now: scheduled tasks fall due."""
        return self._send(self.subjects.promote(), b"")

    async def subscribe_promote(
        self, handler: Callable[[], Awaitable[None] | None]
    ) -> Subscription:
        """Call ``handler`` on each verified promote hint."""
        return await self.nc.subscribe(self.subjects.promote(), cb=self._hint("promote", handler))

    def publish_watch(self) -> Awaitable[None]:
        """Announce that someone watches lifecycle events (see
        :class:`conveyor_runtime.events.EventGate`)."""
        return self._send(self.subjects.watch(), b"")

    async def subscribe_watch(self, handler: Callable[[], Awaitable[None] | None]) -> Subscription:
        """Call ``handler`` on each verified watch announcement."""
        return await self.nc.subscribe(self.subjects.watch(), cb=self._hint("watch", handler))

    def publish_roll_call(self) -> Awaitable[None]:
        """Ask every gateway to re-register on every queue it serves, now."""
        return self._send(self.subjects.roll_call(), b"")

    async def subscribe_roll_call(
        self, handler: Callable[[], Awaitable[None] | None]
    ) -> Subscription:
        """Call ``handler`` on each verified roll call."""
        return await self.nc.subscribe(
            self.subjects.roll_call(), cb=self._hint("roll_call", handler)
        )

    def publish_owner_changed(self, queue: str) -> Awaitable[None]:
        """Tell ``queue``'s gateways that its dispatcher changed: re-register now."""
        return self._send(self.subjects.owner_changed(queue), b"")

    async def subscribe_owner_changed(
        self, handler: Callable[[str], Awaitable[None] | None], *, queue: str = "*"
    ) -> Subscription:
        """Call ``handler(queue)`` when ``queue``'s owner changes (default ``*``: any
        queue's), on each verified hint."""

        async def on_msg(msg: Msg) -> None:
            if not self._verified("owner", msg):
                return
            result = handler(Subjects.queue_of(msg.subject))
            if result is not None:
                await result

        return await self.nc.subscribe(self.subjects.owner_changed(queue), cb=on_msg)

    def _hint(
        self, kind: str, handler: Callable[[], Awaitable[None] | None]
    ) -> Callable[[Msg], Awaitable[None]]:
        """The subscription callback of an empty-body hint."""

        async def on_msg(msg: Msg) -> None:
            if not self._verified(kind, msg):
                return
            result = handler()
            if result is not None:
                await result

        return on_msg

    # ------------------------------------------------------------------ events

    def publish_events(self, events: Sequence[TaskEvent]) -> Awaitable[None]:
        """Publish a run of events in one message (await the result). They share one
        queue and state, which name the subject: ``<prefix>.events.<queue>.<state>``."""
        first = events[0]
        subject = self.subjects.events(first.queue, event_state_token(first.state))
        return self._send(subject, encode_events(events))

    def publish_breaker_event(self, breaker: service_pb2.Breaker) -> Awaitable[None]:
        """Publish that a circuit breaker opened, went half-open or closed (its
        ``state``), as an event of its queue and type on
        ``<prefix>.events.<queue>.breaker``: watchers of the queue's events get it."""
        event = service_pb2.TaskEvent(queue=breaker.queue, type=breaker.type, breaker=breaker)
        event.at.GetCurrentTime()
        subject = self.subjects.events(breaker.queue, "breaker")
        return self._send(subject, encode_event_protos([event]))

    async def subscribe_events(
        self,
        handler: Callable[[list[service_pb2.TaskEvent]], Awaitable[None] | None],
        *,
        queue: str | None = None,
    ) -> Subscription:
        """Deliver each verified message's events to ``handler``: ``queue``'s, or every
        queue's. A payload that does not decode is logged and dropped."""
        subject = (
            self.subjects.events_wildcard() if queue is None else self.subjects.events(queue, "*")
        )

        async def on_msg(msg: Msg) -> None:
            if not self._verified("TaskEvent", msg):
                return
            try:
                events = decode_events(msg.data)
            except DecodeError:
                logger.warning("bus.undecodable kind=TaskEvent subject=%s", msg.subject)
                return
            result = handler(events)
            if result is not None:
                await result

        return await self.nc.subscribe(subject, cb=on_msg)


class _Replies:
    """Request/reply whose replies are checked: one inbox subscription per bus, and the
    first reply to a request that verifies answers it (one that does not is dropped, and
    the request waits on for the real one, so a forged reply can neither answer a request
    nor make its sender give up on the real answer)."""

    __slots__ = (
        "_auth",
        "_gathering",
        "_lock",
        "_nc",
        "_prefix",
        "_refusals",
        "_sub",
        "_tokens",
        "_waiting",
    )

    def __init__(self, nc: NatsClient, auth: ClusterAuth, refusals: Refusals) -> None:
        self._nc = nc
        self._auth = auth
        self._refusals = refusals
        self._prefix = ""
        self._sub: Subscription | None = None
        self._lock = asyncio.Lock()
        self._tokens = itertools.count(1)
        self._waiting: dict[str, tuple[str, asyncio.Future[Msg]]] = {}
        self._gathering: dict[str, tuple[str, list[Msg]]] = {}

    async def _subscribed(self) -> str:
        if self._sub is None:
            async with self._lock:
                if self._sub is None:
                    prefix = self._nc.new_inbox()
                    self._sub = await self._nc.subscribe(f"{prefix}.*", cb=self._on_reply)
                    self._prefix = prefix
        return self._prefix

    async def _send_request(
        self, token: str, subject: str, body: bytes, *, within: float
    ) -> Awaitable[None]:
        """Publish the sealed request ``token`` (its replies come to our inbox)."""
        prefix = await self._subscribed()
        return self._nc.publish(
            subject,
            body,
            reply=f"{prefix}.{token}",
            headers=self._auth.seal(subject, body, within=within),
        )

    async def request(self, kind: str, subject: str, body: bytes, *, within: float) -> Msg:
        """Send ``body`` to ``subject`` (deadline ``within`` seconds) and wait for its
        first verified reply, ``within`` + :data:`REPLY_GRACE` seconds at most."""
        token = str(next(self._tokens))
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (kind, future)
        try:
            await (await self._send_request(token, subject, body, within=within))
            try:
                async with asyncio.timeout(within + REPLY_GRACE):
                    return await future
            except TimeoutError:
                raise nats_errors.TimeoutError from None
        finally:
            del self._waiting[token]

    async def gather(self, kind: str, subject: str, body: bytes, *, within: float) -> list[Msg]:
        """Send ``body`` to ``subject`` (deadline ``within`` seconds) and collect every
        verified reply that arrives within ``within`` seconds."""
        token = str(next(self._tokens))
        replies: list[Msg] = []
        self._gathering[token] = (kind, replies)
        try:
            await (await self._send_request(token, subject, body, within=within))
            # The window is the deadline itself: how many answers to expect is unknown
            # (a process that died is simply absent).
            await asyncio.sleep(within)
            return list(replies)
        finally:
            del self._gathering[token]

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix) + 1 :]
        waiting = self._waiting.get(token)
        if waiting is None:
            gathering = self._gathering.get(token)
            if gathering is not None and msg.data:
                kind, replies = gathering
                reason = self._auth.check(msg.subject, msg.data, msg.headers)
                if reason is None:
                    replies.append(msg)
                else:
                    self._refusals.refuse(kind, msg.subject, reason)
            return  # else late: its request gave up already
        kind, future = waiting
        if future.done():
            return
        headers = msg.headers
        if not msg.data and headers and headers.get("Status") == "503":
            # nats-server's own answer (no subscriber): it carries no seal.
            future.set_exception(nats_errors.NoRespondersError())
            return
        reason = self._auth.check(msg.subject, msg.data, headers)
        if reason is not None:
            self._refusals.refuse(kind, msg.subject, reason)
            return
        future.set_result(msg)


def _around_queue(subject_of: Callable[[str], str]) -> tuple[str, str]:
    """The text before and after the queue in ``subject_of(queue)``."""
    head, marker, tail = subject_of("\0").partition("\0")
    assert marker, "the subject must contain the queue"
    return head, tail
