"""The services' NATS messages, typed: publish and subscribe by message type.

A :class:`Bus` wraps a NATS connection and the :class:`~conveyor_runtime.subjects.Subjects`
of a prefix. Call sites hand it ``cluster_pb2`` messages and get decoded ones back; the
subject (and queue group) of each message type, its serialization and what to do with
bytes that do not decode live here, once:

- ``Wake``, ``Register``, ``Done``, ``Control`` go on their queue's subjects (the message's
  ``queue`` field names the queue); ``CancelBroadcast`` on ``cancel``, ``Resolve`` on
  ``resolve`` (queue group ``resolvers``): :meth:`Bus.publish`, :meth:`Bus.subscribe`.
- Request/reply: ``DispatchRequest`` -> ``DispatchReply`` per gateway
  (:meth:`Bus.dispatch`, :meth:`Bus.serve_dispatch`) and ``WebhookCallback`` ->
  ``WebhookCallbackReply`` per webhook worker, queue group ``webhook``
  (:meth:`Bus.webhook_callback`, :meth:`Bus.serve_webhook_callbacks`).
- Hints with an empty body: promote, watch and owner changed, each a pair of methods.
- Lifecycle events, several to a message (:meth:`Bus.publish_events`,
  :meth:`Bus.subscribe_events`; the format is :func:`conveyor_runtime.wire.encode_events`).

Every message is a hint (see :mod:`conveyor_runtime.subjects`), so a subscription logs and
drops a payload that does not decode, and keeps going. What NATS sees is exactly what the
call sites used to send by hand: same subjects, payloads and queue groups.

Publishing and subscribing are on every service's hot path, so the bus adds nothing per
message but a dict lookup by type (to find the subject) and the decode the handler needed
anyway: :meth:`Bus.publish` returns the connection's publish for the caller to await (no
coroutine of its own), and a handler may be a plain function, called inline by the
subscription's callback, or a coroutine function, awaited there.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeAlias, TypeVar

from conveyor_broker.types import TaskEvent
from conveyor_protos.v1 import cluster_pb2, service_pb2
from google.protobuf.message import DecodeError
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from conveyor_runtime.subjects import Subjects
from conveyor_runtime.wire.events import decode_events, encode_events, event_state_token

logger = logging.getLogger(__name__)

_Wake = cluster_pb2.Wake
_Register = cluster_pb2.Register
_Done = cluster_pb2.Done
_Control = cluster_pb2.Control
_CancelBroadcast = cluster_pb2.CancelBroadcast
_Resolve = cluster_pb2.Resolve

#: The messages :meth:`Bus.publish` takes.
Published: TypeAlias = _Wake | _Register | _Done | _Control | _CancelBroadcast | _Resolve
#: A message type :meth:`Bus.subscribe` takes, and what its handler gets.
M = TypeVar("M", _Wake, _Register, _Done, _Control, _CancelBroadcast, _Resolve)

#: The queue group of the resolvers: one of them handles each ``Resolve``.
RESOLVE_GROUP = "resolvers"
#: The queue group of the webhook managers: one of them answers each callback.
WEBHOOK_GROUP = "webhook"
#: The reply to a webhook callback that does not decode.
MALFORMED_CALLBACK = cluster_pb2.WebhookCallbackReply(
    status=cluster_pb2.WebhookCallbackReply.STATUS_INVALID, message="malformed callback"
)


class Bus:
    """Typed publish, subscribe and request/reply over ``nc`` under ``subjects``.

    ``nc`` stays the caller's (the bus never closes it). Subscriptions are plain NATS
    subscriptions: unsubscribe them to stop.
    """

    __slots__ = ("_fixed", "_per_queue", "_route", "nc", "subjects")

    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        wake, register, done, control = (
            subjects.wake,
            subjects.register,
            subjects.done,
            subjects.control,
        )
        cancel, resolve = subjects.cancel(), subjects.resolve()
        # Per type, where publish puts a message: a fixed subject (tail None), or the
        # subject ``head + message.queue + tail``, cut once out of the Subjects spelling
        # so that a publish costs a concatenation rather than two calls.
        self._route: dict[type[Published], tuple[str, str | None]] = {
            _Wake: _around_queue(wake),
            _Register: _around_queue(register),
            _Done: _around_queue(done),
            _Control: _around_queue(control),
            _CancelBroadcast: (cancel, None),
            _Resolve: (resolve, None),
        }
        # Per type, what subscribe subscribes to.
        self._per_queue: dict[type[Published], Callable[[str], str]] = {
            _Wake: wake,
            _Register: register,
            _Done: done,
            _Control: control,
        }
        self._fixed: dict[type[Published], tuple[str, str]] = {
            _CancelBroadcast: (cancel, ""),
            _Resolve: (resolve, RESOLVE_GROUP),
        }

    @property
    def max_payload(self) -> int:
        """The most bytes one message carries on the server connected now (0: unknown)."""
        return self.nc.max_payload

    # ------------------------------------------------------------ typed messages

    def publish(self, message: Published) -> Awaitable[None]:
        """Publish ``message`` on its type's subject (await the result).

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
        return self.nc.publish(head, message.SerializeToString())

    async def subscribe(
        self, kind: type[M], handler: Callable[[M], Awaitable[None] | None], *, queue: str = "*"
    ) -> Subscription:
        """Deliver every ``kind`` message, decoded, to ``handler``.

        For the per-queue types (Wake, Register, Done, Control), ``queue`` picks one queue;
        the default ``*`` takes every queue's. Resolve is subscribed in its queue group.
        A payload that does not decode is logged and dropped.
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
        return await self.nc.subscribe(subject, queue=group, cb=_decoding(kind, handler))

    # ----------------------------------------------------------- request/reply

    async def dispatch(
        self, gateway: str, request: cluster_pb2.DispatchRequest, *, within: float
    ) -> cluster_pb2.DispatchReply:
        """Offer ``request`` to ``gateway``; its reply, awaited for ``within`` seconds.

        Raises what the NATS request raises (NoRespondersError, nats' TimeoutError, ...),
        and DecodeError for a reply that does not decode.
        """
        msg = await self.nc.request(
            self.subjects.dispatch(gateway), request.SerializeToString(), timeout=within
        )
        return cluster_pb2.DispatchReply.FromString(msg.data)

    async def serve_dispatch(
        self,
        gateway: str,
        handler: Callable[[cluster_pb2.DispatchRequest], cluster_pb2.DispatchReply],
    ) -> Subscription:
        """Answer the dispatch requests sent to ``gateway`` with ``handler``'s replies.

        ``handler`` is a plain function: it runs inline in the subscription's callback.
        A request that does not decode is logged and answered as an empty one would be,
        so the dispatcher hears at once instead of waiting for its timeout.
        """

        async def on_request(msg: Msg) -> None:
            try:
                request = cluster_pb2.DispatchRequest.FromString(msg.data)
            except DecodeError:
                logger.warning("bus.undecodable kind=DispatchRequest subject=%s", msg.subject)
                request = cluster_pb2.DispatchRequest()
            reply = handler(request)
            if msg.reply:
                try:
                    await msg.respond(reply.SerializeToString())
                except Exception as exc:
                    # The dispatcher times out and releases what it offered; the broker's
                    # lease keeps a task this gateway took meanwhile from going wrong.
                    logger.warning("bus.reply_failed subject=%s error=%r", msg.subject, exc)

        return await self.nc.subscribe(self.subjects.dispatch(gateway), cb=on_request)

    async def webhook_callback(
        self, callback: cluster_pb2.WebhookCallback, *, within: float
    ) -> cluster_pb2.WebhookCallbackReply:
        """Route ``callback`` to the gateway of its webhook worker (``callback.worker``);
        the gateway's reply, awaited for ``within`` seconds.

        Raises what the NATS request raises (NoRespondersError, nats' TimeoutError,
        MaxPayloadError, ...), and DecodeError for a reply that does not decode.
        """
        msg = await self.nc.request(
            self.subjects.webhook_callback(callback.worker),
            callback.SerializeToString(),
            timeout=within,
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
        callbacks are answered one after another. One that does not decode is answered
        :data:`MALFORMED_CALLBACK`.
        """

        async def answer(msg: Msg) -> None:
            try:
                callback = cluster_pb2.WebhookCallback.FromString(msg.data)
            except DecodeError:
                logger.warning("bus.undecodable kind=WebhookCallback subject=%s", msg.subject)
                reply = MALFORMED_CALLBACK
            else:
                reply = await handler(callback)
            if msg.reply:
                try:
                    await msg.respond(reply.SerializeToString())
                except Exception as exc:
                    logger.warning("bus.reply_failed subject=%s error=%r", msg.subject, exc)

        if spawn is None:
            cb = answer
        else:

            async def cb(msg: Msg) -> None:
                spawn(answer(msg))

        return await self.nc.subscribe(
            self.subjects.webhook_callback(worker), queue=WEBHOOK_GROUP, cb=cb
        )

    # ------------------------------------------------------ empty-body hints

    def publish_promote(self) -> Awaitable[None]:
        """Ask the scheduler leader for a pass now: scheduled tasks fall due."""
        return self.nc.publish(self.subjects.promote(), b"")

    async def subscribe_promote(
        self, handler: Callable[[], Awaitable[None] | None]
    ) -> Subscription:
        """Call ``handler`` on each promote hint."""
        return await self.nc.subscribe(self.subjects.promote(), cb=_hint(handler))

    def publish_watch(self) -> Awaitable[None]:
        """Announce that someone watches lifecycle events (see
        :class:`conveyor_runtime.events.EventGate`)."""
        return self.nc.publish(self.subjects.watch(), b"")

    async def subscribe_watch(self, handler: Callable[[], Awaitable[None] | None]) -> Subscription:
        """Call ``handler`` on each watch announcement."""
        return await self.nc.subscribe(self.subjects.watch(), cb=_hint(handler))

    def publish_owner_changed(self, queue: str) -> Awaitable[None]:
        """Tell ``queue``'s gateways that its dispatcher changed: re-register now."""
        return self.nc.publish(self.subjects.owner_changed(queue), b"")

    async def subscribe_owner_changed(
        self, handler: Callable[[str], Awaitable[None] | None], *, queue: str = "*"
    ) -> Subscription:
        """Call ``handler(queue)`` when ``queue``'s owner changes (default ``*``: any
        queue's)."""

        async def on_msg(msg: Msg) -> None:
            result = handler(Subjects.queue_of(msg.subject))
            if result is not None:
                await result

        return await self.nc.subscribe(self.subjects.owner_changed(queue), cb=on_msg)

    # ------------------------------------------------------------------ events

    def publish_events(self, events: Sequence[TaskEvent]) -> Awaitable[None]:
        """Publish a run of events in one message (await the result). They share one
        queue and state, which name the subject: ``<prefix>.events.<queue>.<state>``."""
        first = events[0]
        subject = self.subjects.events(first.queue, event_state_token(first.state))
        return self.nc.publish(subject, encode_events(events))

    async def subscribe_events(
        self,
        handler: Callable[[list[service_pb2.TaskEvent]], Awaitable[None] | None],
        *,
        queue: str | None = None,
    ) -> Subscription:
        """Deliver each message's events to ``handler``: ``queue``'s, or every queue's.
        A payload that does not decode is logged and dropped."""
        subject = (
            self.subjects.events_wildcard() if queue is None else self.subjects.events(queue, "*")
        )

        async def on_msg(msg: Msg) -> None:
            try:
                events = decode_events(msg.data)
            except DecodeError:
                logger.warning("bus.undecodable kind=TaskEvent subject=%s", msg.subject)
                return
            result = handler(events)
            if result is not None:
                await result

        return await self.nc.subscribe(subject, cb=on_msg)


def _around_queue(subject_of: Callable[[str], str]) -> tuple[str, str]:
    """The text before and after the queue in ``subject_of(queue)``."""
    head, marker, tail = subject_of("\0").partition("\0")
    assert marker, "the subject must contain the queue"
    return head, tail


def _decoding(
    kind: type[M], handler: Callable[[M], Awaitable[None] | None]
) -> Callable[[Msg], Awaitable[None]]:
    """The subscription callback that decodes a ``kind`` and hands it to ``handler``."""
    from_string = kind.FromString
    name = kind.__name__

    async def on_msg(msg: Msg) -> None:
        try:
            message = from_string(msg.data)
        except DecodeError:
            logger.warning("bus.undecodable kind=%s subject=%s", name, msg.subject)
            return
        result = handler(message)
        if result is not None:
            await result

    return on_msg


def _hint(handler: Callable[[], Awaitable[None] | None]) -> Callable[[Msg], Awaitable[None]]:
    """The subscription callback of an empty-body hint."""

    async def on_msg(msg: Msg) -> None:
        result = handler()
        if result is not None:
            await result

    return on_msg
