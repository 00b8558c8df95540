"""Abandoning a round by hand: the way out of a round whose close cannot succeed.

An operator ends an open or aggregating round without a new version: its uploads are not
aggregated, the reason is stored with the round (`RoundRow.abandon_reason`) and shown in the
task's status and on the dashboard, any failure of its close is forgotten (nothing is left to
retry), and the task goes on from its committed version (an `auto` task's next round opens at
the ticker's next tick; a `manual` one's when its driver opens it).

Against a close (docs/design.md, "Crash-safe round close"): the abandonment waits for a close
attempt in progress (the task lock every close attempt holds) and then finds the round either
committed (409: nothing to abandon) or still aggregating (abandoned). The close's final commit
also moves the round only from `aggregating`, so a close can never commit a round abandoned
meanwhile. After a crash mid-close the round is `aggregating` and the next start's recovery
finishes it first; only a round whose recovery fails can be abandoned, and files a crashed
close wrote for the next version are overwritten by the next close that reaches it.
"""

from __future__ import annotations

import logging

from seedfed.server.errors import ConflictError, RoundClosedError
from seedfed.server.orm import RoundState, UploadRow, utcnow
from seedfed.server.runtime import Runtime
from seedfed.server.schemas import AbandonedRound
from seedfed.server.service.opening import locked_task
from seedfed.server.service.rounds import get_round
from sqlalchemy import func, select

logger = logging.getLogger("seedfed.server")

#: Seconds an abandonment waits for a close attempt in progress before answering 409.
CLOSE_WAIT_S = 30.0


def abandon_round(rt: Runtime, *, task_id: str, number: int, reason: str,
                  wait_s: float = CLOSE_WAIT_S) -> AbandonedRound:
    """End round `number` of the task without a new version (it must be open or aggregating)."""
    reason = reason.strip()
    if not reason:
        raise ValueError("an abandoned round needs a reason")
    lock = rt.task_lock(task_id)
    if not lock.acquire(timeout=wait_s):
        raise ConflictError(f"round {number} of task {task_id!r} is being closed right now "
                            f"(the attempt took more than {wait_s:.0f} s); retry once it ends")
    try:
        with rt.state_lock, rt.transaction() as s:
            task = locked_task(s, task_id)
            row = get_round(s, task_id=task_id, number=number)
            if row.state not in (RoundState.OPEN, RoundState.AGGREGATING):
                made = f" (it made v{row.result_version})" if row.result_version else ""
                raise RoundClosedError(f"round {number} of task {task_id!r} is {row.state}"
                                       f"{made}: only an open or aggregating round can be "
                                       "abandoned")
            uploads = s.scalar(select(func.count()).select_from(UploadRow)
                               .where(UploadRow.round_id == row.id)) or 0
            was, now = row.state, utcnow()
            row.state, row.closed_at, row.participants = RoundState.ABANDONED, now, 0
            row.abandon_reason = reason
            round_id, base, version = row.id, row.base_version, task.current_version
            if was == RoundState.OPEN:
                rt.rounds.stopped(task_id)  # uploads to it are refused from now on
    finally:
        lock.release()
    rt.rounds.finished(round_id)
    rt.close_failures.clear(task_id, round_id)
    logger.warning("round %s of task %s (%s, %d upload(s)) abandoned by an operator: %s",
                   number, task_id, was, uploads, reason)
    return AbandonedRound(task_id=task_id, round=number, base_version=base, version=version,
                          uploads=uploads, reason=reason, abandoned_at=now)
