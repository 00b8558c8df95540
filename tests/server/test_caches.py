"""The runtime's caches: each owns its state, and the quorum rule is written once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from seedfed.server.caches import (
    CloseFailure,
    CloseFailures,
    OpenRounds,
    TokenCache,
    at_quorum,
)
from seedfed.server.errors import PermissionDeniedError
from seedfed.shared.protocol.wire import RoundPlan


def _plan(quorum: int) -> RoundPlan:
    return RoundPlan(task_id="t", round=1, version=0, seeds=[[1, 2]], lr=1e-3, eps=1e-3,
                     batch_size=4, clip=None, one_sided=False, scope="full",
                     deadline=datetime.now(UTC) + timedelta(minutes=1), quorum=quorum)


def test_a_token_of_another_task_is_refused_from_the_cache() -> None:
    # Arrange
    tokens = TokenCache()
    tokens.remember("h", "dev", "task-a")

    # Act / Assert
    assert tokens.authorize("h", "task-a") == "dev"
    assert tokens.authorize("unknown", "task-a") is None
    with pytest.raises(PermissionDeniedError):
        tokens.authorize("h", "task-b")
    tokens.forget("h")
    assert tokens.authorize("h", "task-a") is None


def test_a_round_is_due_at_its_quorum_only_while_it_is_the_open_one() -> None:
    # Arrange
    rounds = OpenRounds()
    rounds.opened("t", 7, _plan(quorum=2), cap=None)

    # Act
    rounds.set_count(7, 1)
    before = rounds.is_due("t", 7)
    rounds.set_count(7, 2)
    at = rounds.is_due("t", 7)
    other_round = rounds.is_due("t", 8)
    rounds.stopped("t")

    # Assert
    assert (before, at, other_round, rounds.is_due("t", 7)) == (False, True, False, False)
    assert at_quorum(2, 2) and not at_quorum(1, 2)


def test_invalidate_forgets_plans_but_a_finished_round_also_drops_its_counts() -> None:
    # Arrange
    rounds = OpenRounds()
    rounds.opened("t", 7, _plan(quorum=1), cap=3)

    # Act
    rounds.invalidate()
    known_after_invalidate = rounds.known("t")
    rounds.finished(7)

    # Assert
    assert not known_after_invalidate
    assert rounds.uncounted([7]) == {7} and rounds.uncapped([7]) == {7}


def test_close_failures_are_due_after_their_backoff() -> None:
    # Arrange
    now = datetime.now(UTC)
    failures = CloseFailures()
    failures.record("a", CloseFailure(round_id=1, round=1, attempts=1, error="E: x",
                                      failed_at=now, retry_at=now + timedelta(seconds=5)))
    failures.record("b", CloseFailure(round_id=2, round=1, attempts=3, error="E: y",
                                      failed_at=now, retry_at=now - timedelta(seconds=1)))

    # Act
    due = failures.due(now)
    failures.clear("b")

    # Assert
    assert due == [("b", 2)]
    assert list(failures) == ["a"] and "b" not in failures and len(failures) == 1
