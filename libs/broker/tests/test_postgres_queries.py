"""The Postgres broker's SQL as text: no statement reads the database's clock, and the state
lists written into the statements are the broker's state sets."""

from __future__ import annotations

import importlib
import pkgutil
import re
from types import ModuleType

import pytest
from conveyor_broker.postgres import queries
from conveyor_broker.postgres.migrations import declared_schema, load_migrations
from conveyor_broker.postgres.queries import (
    admin,
    concurrency,
    dependencies,
    enqueue,
    lease,
    sweeps,
)
from conveyor_broker.types import (
    INCOMPLETE_STATES,
    LEASABLE_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    TaskState,
)


def _statement_modules() -> list[ModuleType]:
    return [
        importlib.import_module(f"{queries.__name__}.{info.name}")
        for info in pkgutil.iter_modules(queries.__path__)
    ]


def _statements(module: ModuleType) -> list[str]:
    return [
        value for name, value in vars(module).items() if name.isupper() and isinstance(value, str)
    ]


def test_no_sql_reads_the_database_clock() -> None:
    modules = _statement_modules()
    assert {m.__name__.rpartition(".")[2] for m in modules} >= {
        "admin",
        "concurrency",
        "dependencies",
        "enqueue",
        "lease",
        "outcomes",
        "sweeps",
        "webhooks",
    }
    texts = [m.sql for m in load_migrations()] + [declared_schema()]
    for module in modules:
        statements = _statements(module)
        assert statements, module.__name__
        texts += statements
    clock_reads = re.compile(
        r"\b(now\s*\(|current_timestamp|current_date|localtimestamp|clock_timestamp|"
        r"statement_timestamp|transaction_timestamp)",
        re.IGNORECASE,
    )
    offenders = [text for text in texts if clock_reads.search(text)]
    assert not offenders


def _sql_list(states: frozenset[TaskState]) -> str:
    return "(" + ", ".join(f"'{state.value}'" for state in TaskState if state in states) + ")"


_RESCHEDULABLE = frozenset({TaskState.PENDING, TaskState.SCHEDULED, TaskState.RETRY})
_RUNNABLE_NOW = _RESCHEDULABLE | {TaskState.BLOCKED, TaskState.HELD}


#: Statement -> (its text, the states each of its state lists must hold).
_STATE_LISTS = {
    "lease.LEASE": (lease.LEASE, LEASABLE_STATES),
    "lease.LEASE_MANY": (lease.LEASE_MANY, LEASABLE_STATES),
    "lease.LEASE_SELECT": (lease.LEASE_SELECT, LEASABLE_STATES),
    "concurrency.KEYED_CANDIDATES": (concurrency.KEYED_CANDIDATES, LEASABLE_STATES),
    "sweeps.PENDING_COUNT": (sweeps.PENDING_COUNT, LEASABLE_STATES),
    "sweeps.PENDING_COUNT_QUEUE": (sweeps.PENDING_COUNT_QUEUE, LEASABLE_STATES),
    "sweeps.DUE_QUEUES": (sweeps.DUE_QUEUES, LEASABLE_STATES),
    "sweeps.ARCHIVE_EXPIRED": (sweeps.ARCHIVE_EXPIRED, WAITING_STATES),
    "admin.ARCHIVE_TASK": (admin.ARCHIVE_TASK, WAITING_STATES),
    "admin.CANCEL_TASK": (admin.CANCEL_TASK, WAITING_STATES | {TaskState.ACTIVE}),
    "admin.RUN_TASK_NOW": (admin.RUN_TASK_NOW, _RUNNABLE_NOW),
    "admin.RESCHEDULE_TASK": (admin.RESCHEDULE_TASK, _RESCHEDULABLE),
    "admin.REVIVE_TASK": (admin.REVIVE_TASK, frozenset({TaskState.ARCHIVED})),
    "enqueue.FREE_LAPSED_CLAIMS": (enqueue.FREE_LAPSED_CLAIMS, INCOMPLETE_STATES),
    "enqueue.FREE_LAPSED_CLAIMS_AND_READ_HOLDERS": (
        enqueue.FREE_LAPSED_CLAIMS_AND_READ_HOLDERS,
        INCOMPLETE_STATES,
    ),
    "enqueue.UNIQUE_HOLDER": (enqueue.UNIQUE_HOLDER, INCOMPLETE_STATES),
    "dependencies.RESOLVE_DEPENDENTS": (dependencies.RESOLVE_DEPENDENTS, TERMINAL_STATES),
    "dependencies.READY_TO_RESOLVE": (dependencies.READY_TO_RESOLVE, TERMINAL_STATES),
    "dependencies.LOCK_DEPENDENCIES": (dependencies.LOCK_DEPENDENCIES, TERMINAL_STATES),
}


@pytest.mark.parametrize("name", list(_STATE_LISTS))
def test_state_lists_are_the_state_sets(name: str) -> None:
    """Every ``state IN (...)`` of the statement lists its states, in TaskState order."""
    statement, states = _STATE_LISTS[name]
    lists = re.findall(r"state (?:NOT )?IN (\([^)]*\))", statement)
    assert lists, "no state list"
    assert set(lists) == {_sql_list(states)}
