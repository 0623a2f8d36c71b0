"""Leases and limit changes of a queue with concurrency limits, for Postgres.

The plain lease statements skip a queue that has a limit; such a queue is leased here, in
one transaction under the queue's advisory lock (so two dispatchers owning it for a moment
count the same ACTIVE tasks): take the keys the triggers noted as freed and make their
oldest HELD tasks PENDING as far as there is room, pick the due tasks in lease order, and
lease or park each as :func:`conveyor_broker.concurrency.plan_lease` says. Parked tasks
leave the due index, so a round that parked some picks again, until the lease has what
it wants or the due set is empty (at most :data:`MAX_ROUNDS` rounds).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import asyncpg

from conveyor_broker import concurrency
from conveyor_broker.ids import new_ids
from conveyor_broker.postgres.queries import concurrency as queries
from conveyor_broker.postgres.rows import task_from_row
from conveyor_broker.types import ConcurrencyLimit, Task, TaskState

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Connection = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

#: Due tasks a round picks beyond what the lease still wants, so that a hot key's tasks
#: in front are parked in few rounds.
PICK_SLACK = 200
#: Rounds of one lease at most (each parks what it cannot lease).
MAX_ROUNDS = 50
#: The room of a key no limit applies to any more: all its HELD tasks.
_ALL = 2**31 - 1


@dataclass
class KeyedLease:
    """What a keyed lease did: the leased tasks (lease order) and the changes of state
    (task, previous state) to report, promotions and parkings included."""

    leased: list[Task] = field(default_factory=list)
    changes: list[tuple[Task, TaskState]] = field(default_factory=list)


def limit_from_row(row: asyncpg.Record) -> ConcurrencyLimit:
    """A ConcurrencyLimit from a row of conveyor_concurrency_limits."""
    return ConcurrencyLimit(row["queue"], row["per_key"], row["pattern"])


async def _active(conn: Connection, queue: str, keys: Iterable[str]) -> dict[str, int]:
    wanted = sorted(set(keys))
    if not wanted:
        return {}
    counts = dict.fromkeys(wanted, 0)
    for row in await conn.fetch(queries.ACTIVE_PER_KEY, queue, wanted):
        counts[row["key"]] = row["n"]
    return counts


async def promote(
    conn: Connection,
    queue: str,
    keys: Iterable[str],
    limits: Sequence[ConcurrencyLimit],
    now: datetime,
) -> list[tuple[Task, TaskState]]:
    """Make the oldest HELD tasks of ``keys`` PENDING as far as each key has room (all of
    them for a key no limit applies to); the caller holds the queue's lock."""
    wanted = sorted(set(keys))
    if not wanted:
        return []
    limited = [key for key in wanted if concurrency.limit_for(key, limits) is not None]
    rooms = concurrency.room(limited, limits, await _active(conn, queue, limited))
    rooms.update((key, _ALL) for key in wanted if key not in rooms)
    open_keys = [key for key in wanted if rooms[key] > 0]
    if not open_keys:
        return []
    rows = await conn.fetch(
        queries.PROMOTE_HELD, queue, open_keys, [rooms[key] for key in open_keys], now
    )
    return [(task_from_row(row), TaskState.HELD) for row in rows]


async def lease(
    conn: Connection,
    queue: str,
    want: int,
    ttl: timedelta,
    holders: Sequence[str],
    now: datetime,
    exclude_types: Sequence[str] = (),
    only_types: Sequence[str] | None = None,
) -> KeyedLease | None:
    """Lease up to ``want`` due tasks of ``queue`` under its concurrency limits (see the
    module); None when the queue has no limit (any more): the plain lease applies.

    With type filters (``exclude_types``, ``only_types``: see
    :meth:`conveyor_broker.interface.Broker.lease`) only the tasks they let through are
    candidates: the others are neither leased nor parked."""
    filtered = bool(exclude_types) or only_types is not None
    exclude = list(exclude_types)
    only = None if only_types is None else list(only_types)
    out = KeyedLease()
    async with conn.transaction():
        await conn.execute(queries.LOCK_KEYED_QUEUE, queue)
        limits = [limit_from_row(row) for row in await conn.fetch(queries.QUEUE_LIMITS, queue)]
        if not limits:
            return None
        freed = [row["key"] for row in await conn.fetch(queries.TAKE_FREED, queue)]
        out.changes += await promote(conn, queue, freed, limits, now)
        active: dict[str, int] = {}
        for _ in range(MAX_ROUNDS):
            remaining = want - len(out.leased)
            if remaining <= 0:
                break
            ask = remaining + PICK_SLACK
            if filtered:
                rows = await conn.fetch(
                    queries.KEYED_CANDIDATES_FILTERED, queue, now, ask, exclude, only
                )
            else:
                rows = await conn.fetch(queries.KEYED_CANDIDATES, queue, now, ask)
            if not rows:
                break
            keys: list[str | None] = [row["concurrency_key"] for row in rows]
            unknown = {
                key
                for key in keys
                if key is not None
                and key not in active
                and concurrency.limit_for(key, limits) is not None
            }
            active.update(await _active(conn, queue, unknown))
            plan = concurrency.plan_lease(keys, limits, active, remaining)
            for index in plan.lease:
                key = keys[index]
                if key is not None and key in active:
                    active[key] += 1
            previous = {row["id"]: TaskState(row["state"]) for row in rows}
            if plan.lease:
                ids = [rows[index]["id"] for index in plan.lease]
                start = len(out.leased)
                named = [
                    holders[start + n] if start + n < len(holders) else "" for n in range(len(ids))
                ]
                leased = await conn.fetch(
                    queries.LEASE_IDS, ids, new_ids(now, len(ids)), named, now + ttl, now
                )
                by_id = {task.id: task for task in map(task_from_row, leased)}
                for task_id in ids:
                    task = by_id[task_id]
                    out.leased.append(task)
                    out.changes.append((task, previous[task_id]))
            if plan.park:
                parked = await conn.fetch(
                    queries.PARK, [rows[index]["id"] for index in plan.park], now
                )
                out.changes += [(task, previous[task.id]) for task in map(task_from_row, parked)]
            if len(rows) < ask or not plan.park:
                break
    return out


async def set_limit(
    conn: Connection, limit: ConcurrencyLimit, now: datetime
) -> list[tuple[Task, TaskState]]:
    """Store ``limit``; the HELD tasks of its queue that now have room are PENDING."""
    async with conn.transaction():
        await conn.execute(queries.LOCK_KEYED_QUEUE, limit.queue)
        await conn.execute(queries.SET_CONCURRENCY_LIMIT, limit.queue, limit.pattern, limit.per_key)
        return await _promote_all(conn, limit.queue, now)


async def delete_limit(
    conn: Connection, queue: str, pattern: str, now: datetime
) -> list[tuple[Task, TaskState]] | None:
    """Delete the limit of ``queue`` and ``pattern`` (None: there was none); the HELD
    tasks of the queue that now have room are PENDING."""
    async with conn.transaction():
        await conn.execute(queries.LOCK_KEYED_QUEUE, queue)
        if await conn.fetchval(queries.DELETE_CONCURRENCY_LIMIT, queue, pattern) is None:
            return None
        changes = await _promote_all(conn, queue, now)
        if not await conn.fetch(queries.QUEUE_LIMITS, queue):
            await conn.execute(queries.FORGET_FREED, queue)
        return changes


async def _promote_all(conn: Connection, queue: str, now: datetime) -> list[tuple[Task, TaskState]]:
    limits = [limit_from_row(row) for row in await conn.fetch(queries.QUEUE_LIMITS, queue)]
    held = [row["key"] for row in await conn.fetch(queries.HELD_KEYS, queue)]
    return await promote(conn, queue, held, limits, now)
