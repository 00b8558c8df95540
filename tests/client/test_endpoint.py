"""The REST devices' polling loop (`client.endpoint.poll_rounds`): a coordinator that stops
answering is waited for with one warning per outage; a refusal other than 409 is raised."""

from __future__ import annotations

import logging

import pytest
from seedfed.client.endpoint import poll_rounds
from seedfed.shared.protocol.coordinator_client import (
    CoordinatorHttpError,
    CoordinatorUnreachableError,
)
from seedfed.shared.protocol.wire import RoundPlan


def _plan(number: int) -> RoundPlan:
    return RoundPlan(task_id="t", round=number, version=number - 1, seeds=[[1, 2]], lr=0.1,
                     eps=1e-3, batch_size=4)


def test_an_outage_while_polling_is_waited_for_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    # Arrange: three polls find no coordinator, then a round is open
    answers: list[object] = [CoordinatorUnreachableError("http://c:1", "refused")] * 3 + \
        [_plan(1)]

    def current_plan() -> RoundPlan | None:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    # Act
    with caplog.at_level(logging.WARNING, logger="seedfed.client.endpoint"):
        done = poll_rounds(current_plan=current_plan, meta={}, train=lambda p: p.round,
                           poll_s=0.001, rounds=1)

    # Assert
    assert done == [1]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # the outage once, and its end
    assert "cannot reach the coordinator at http://c:1" in warnings[0]
    assert "answers again" in warnings[1]


def test_a_refusal_other_than_a_conflict_is_raised() -> None:
    def current_plan() -> RoundPlan | None:
        raise CoordinatorHttpError(401, "GET", "/x", "device revoked", "AuthenticationError")

    with pytest.raises(CoordinatorHttpError, match="revoked"):
        poll_rounds(current_plan=current_plan, meta={}, train=lambda p: p, poll_s=0.001,
                    rounds=1)
