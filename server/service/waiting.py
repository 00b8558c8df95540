"""What a task waits for: one keyword (`messages.Waiting`) and one line for people, shown by
`TaskStatus.waiting_for` / `waiting`, `seedfed task show` and the dashboard."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from seedfed.server.caches import CloseFailure
from seedfed.server.orm import Schedule
from seedfed.shared.protocol.messages import Waiting


@dataclass(frozen=True)
class TaskMoment:
    """The facts `waiting_of` reads, taken from one unit of work."""

    task_id: str
    state: str  # idle, open or aggregating (`TaskStatus.state`)
    round: int | None  # the latest round's number
    uploads: int  # accepted in the open round
    quorum: int
    deadline: datetime | None  # the open round's
    devices: int  # enrolled, not revoked
    version: int
    schedule: str
    max_rounds: int | None
    schedule_on: bool  # the coordinator runs automatic schedules (`auto_open_rounds`)
    failure: CloseFailure | None
    now: datetime


def _span(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _failing(m: TaskMoment, f: CloseFailure) -> tuple[Waiting, str]:
    if f.permanent:
        return "operator", (f"round {f.round}'s close fails on every attempt ({f.error}); it is "
                            f"not retried: abandon it (seedfed round abandon {m.task_id} "
                            f"{f.round} --reason ...) and the task goes on from v{m.version}")
    when = "now" if f.retry_at is None or f.retry_at <= m.now else \
        f"in {_span((f.retry_at - m.now).total_seconds())}"
    return "close_retry", (f"round {f.round}'s close failed (attempt {f.attempts}: {f.error}); "
                           f"retried {when}")


def _open(m: TaskMoment) -> tuple[Waiting, str]:
    line = (f"round {m.round}: {m.uploads} of {m.quorum} uploads for the quorum "
            f"({m.devices} device(s) enrolled)")
    if m.deadline is None:
        return "uploads", line
    left = (m.deadline - m.now).total_seconds()
    if left <= 0:
        return "uploads", f"{line}; its deadline passed: it ends at the next tick"
    return "uploads", (f"{line}; it closes at the quorum, or at its deadline "
                       f"{m.deadline:%Y-%m-%d %H:%M:%S} UTC (in {_span(left)}) with what "
                       "arrived (none: it expires)")


def _idle(m: TaskMoment) -> tuple[Waiting, str]:
    if m.schedule == Schedule.MANUAL:
        return "operator", ("rounds are opened by hand: seedfed round open "
                            f"{m.task_id} (or seedfed round schedule {m.task_id} --auto)")
    if not m.schedule_on:
        return "operator", ("this coordinator runs no automatic schedule (auto_open_rounds "
                            f"is off): open rounds by hand (seedfed round open {m.task_id})")
    if m.max_rounds is not None and m.version >= m.max_rounds:
        return "round_limit", (f"the round limit is reached: v{m.version} of max_rounds "
                               f"{m.max_rounds} (seedfed round schedule {m.task_id} --rounds N "
                               "raises it)")
    if m.devices == 0:
        return "devices", ("no device enrolled: the first round opens when one enrolls with the "
                           "task's join token")
    return "schedule", "the next round opens at the coordinator's next tick"


def waiting_of(m: TaskMoment) -> tuple[Waiting, str]:
    """(keyword, line) of what the task waits for: a failing close first, then its round."""
    if m.failure is not None:
        return _failing(m, m.failure)
    if m.state == "aggregating":
        return "aggregation", f"round {m.round} is being aggregated"
    if m.state == "open":
        return _open(m)
    return _idle(m)
