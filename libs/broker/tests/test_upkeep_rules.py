"""When storage upkeep asks Postgres for an ANALYZE or a VACUUM (pure rules)."""

from __future__ import annotations

import pytest
from conveyor_broker.postgres import upkeep
from conveyor_broker.postgres.upkeep import TableStats, needs_analyze, needs_vacuum


def stats(
    planned: float = 10_000, live: int = 10_000, dead: int = 0, changed: int = 0, **kw: bool
) -> TableStats:
    return TableStats(planned, live, dead, changed, **kw)


@pytest.mark.parametrize(
    ("planned", "changed", "expected"),
    [
        (-1, 999, False),  # never analyzed, too few changes to bother
        (-1, 1000, True),  # never analyzed: the first thousand changes are enough
        (0, 1000, True),
        (10_000, 4_999, False),  # under half of what the planner believes
        (10_000, 5_000, True),  # grew (or turned over) by half
        (1_000_000, 400_000, False),
        (1_000_000, 500_000, True),
    ],
)
def test_analyze_once_changes_reach_half_the_planned_rows(
    planned: float, changed: int, expected: bool
) -> None:
    assert needs_analyze(stats(planned=planned, changed=changed)) is expected


@pytest.mark.parametrize(
    ("live", "dead", "floor", "expected"),
    [
        (100, 999, 0, False),  # small table: a thousand dead rows at least
        (100, 1000, 0, True),
        (100_000, 19_999, 0, False),  # under a fifth of the live rows
        (100_000, 20_000, 0, True),
        (100_000, 25_000, 10_000, False),  # 10k of them could not be removed last time
        (100_000, 30_000, 10_000, True),
    ],
)
def test_vacuum_once_dead_rows_beyond_the_floor_reach_a_fifth_of_the_live(
    live: int, dead: int, floor: int, expected: bool
) -> None:
    assert needs_vacuum(stats(live=live, dead=dead), floor) is expected


def test_the_statement_combines_what_is_needed() -> None:
    assert upkeep.upkeep_statement(stats(), 0) is None
    assert upkeep.upkeep_statement(stats(changed=6_000), 0) == upkeep.ANALYZE
    assert upkeep.upkeep_statement(stats(dead=3_000), 0) == upkeep.VACUUM
    assert upkeep.upkeep_statement(stats(dead=3_000, changed=6_000), 0) == upkeep.VACUUM_ANALYZE


def test_nothing_is_asked_of_a_table_the_role_may_not_maintain() -> None:
    drifted = stats(dead=50_000, changed=50_000, maintainable=False)
    assert upkeep.upkeep_statement(drifted, 0) is None


def test_statements_skip_a_table_that_is_already_being_vacuumed() -> None:
    for statement in (upkeep.ANALYZE, upkeep.VACUUM, upkeep.VACUUM_ANALYZE):
        assert "SKIP_LOCKED" in statement
        assert statement.endswith(upkeep.TABLE)
