"""Rate and concurrency limits between the broker and the wire."""

from __future__ import annotations

from conveyor_broker import ConcurrencyLimit, RateLimit
from conveyor_broker.rates import default_burst
from conveyor_protos.v1 import service_pb2


def rate_limit_from_proto(limit: service_pb2.RateLimit) -> RateLimit:
    """A limit from the wire: burst 0 takes the default (one second of tokens)."""
    burst = limit.burst if limit.burst else default_burst(limit.per_second)
    return RateLimit(queue=limit.queue, per_second=limit.per_second, burst=burst)


def rate_limit_to_proto(limit: RateLimit) -> service_pb2.RateLimit:
    """A stored limit on the wire."""
    return service_pb2.RateLimit(queue=limit.queue, per_second=limit.per_second, burst=limit.burst)


def concurrency_limit_from_proto(limit: service_pb2.ConcurrencyLimit) -> ConcurrencyLimit:
    """A limit from the wire: an empty pattern is ``*`` (every key)."""
    return ConcurrencyLimit(queue=limit.queue, per_key=limit.per_key, pattern=limit.pattern or "*")


def concurrency_limit_to_proto(limit: ConcurrencyLimit) -> service_pb2.ConcurrencyLimit:
    """A stored limit on the wire."""
    return service_pb2.ConcurrencyLimit(
        queue=limit.queue, per_key=limit.per_key, pattern=limit.pattern
    )
