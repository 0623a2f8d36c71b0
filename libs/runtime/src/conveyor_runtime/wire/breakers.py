"""Circuit breakers per task type between the broker and the wire: their configs, and the
breakers that are not closed."""

from __future__ import annotations

from datetime import timedelta

from conveyor_broker import Breaker, BreakerConfig, BreakerScope
from conveyor_broker.errors import InvalidTask
from conveyor_protos.v1 import service_pb2
from google.protobuf.duration_pb2 import Duration

from conveyor_runtime.wire.time import duration, from_duration, set_timestamp

_SCOPE_TO_PROTO = {
    BreakerScope.WORKER: service_pb2.BREAKER_SCOPE_WORKER,
    BreakerScope.QUEUE: service_pb2.BREAKER_SCOPE_QUEUE,
}
_SCOPE_FROM_PROTO: dict[int, BreakerScope] = {
    int(value): key for key, value in _SCOPE_TO_PROTO.items()
}


def breaker_scope_from_proto(scope: int) -> BreakerScope:
    """A request's scope: UNSPECIFIED is WORKER; InvalidTask for a value no scope has."""
    if scope == service_pb2.BREAKER_SCOPE_UNSPECIFIED:
        return BreakerScope.WORKER
    try:
        return _SCOPE_FROM_PROTO[scope]
    except KeyError:
        raise InvalidTask(f"scope must be worker or queue, got {scope!r}") from None


def breaker_scope_to_proto(scope: BreakerScope) -> service_pb2.BreakerScope:
    """A stored scope on the wire."""
    return _SCOPE_TO_PROTO[scope]


def _required_duration(config: service_pb2.BreakerConfig, name: str) -> timedelta:
    if not config.HasField(name):
        raise InvalidTask(f"{name} is required")
    value: Duration = getattr(config, name)
    try:
        return from_duration(value)
    except (ValueError, OverflowError) as exc:
        raise InvalidTask(f"{name} is not a valid Duration: {exc}") from None


def breaker_config_from_proto(config: service_pb2.BreakerConfig) -> BreakerConfig:
    """A config from the wire: an empty pattern is ``*``, scope UNSPECIFIED is WORKER;
    ``window`` and ``cooldown`` are required. InvalidTask for a missing window or
    cooldown, an invalid Duration or an unknown scope (the broker checks the values)."""
    return BreakerConfig(
        queue=config.queue,
        pattern=config.pattern or "*",
        failures=config.failures,
        window=_required_duration(config, "window"),
        cooldown=_required_duration(config, "cooldown"),
        scope=breaker_scope_from_proto(config.scope),
    )


def breaker_config_to_proto(config: BreakerConfig) -> service_pb2.BreakerConfig:
    """A stored config on the wire."""
    return service_pb2.BreakerConfig(
        queue=config.queue,
        pattern=config.pattern,
        failures=config.failures,
        window=duration(config.window),
        cooldown=duration(config.cooldown),
        scope=breaker_scope_to_proto(config.scope),
    )


def breaker_to_proto(breaker: Breaker) -> service_pb2.Breaker:
    """A breaker that is not closed on the wire: state ``open`` or ``half_open``, scope
    QUEUE when it belongs to no gateway (queue-wide), else WORKER."""
    out = service_pb2.Breaker(
        queue=breaker.queue,
        type=breaker.type,
        scope=breaker_scope_to_proto(breaker.scope),
        gateway=breaker.gateway,
        worker_id=breaker.worker_id,
        state=breaker.status.value,
        failures=breaker.failures,
    )
    set_timestamp(out.opened_at, breaker.opened_at)
    set_timestamp(out.until, breaker.until)
    return out
