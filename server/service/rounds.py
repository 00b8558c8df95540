"""The round lifecycle: open -> aggregating -> closed (or expired, or abandoned), and crash
recovery. Opening a round is `opening`'s; abandoning one by hand `abandon`'s.

Closing is two units of work around the file writes: (1) mark the round `aggregating`
(uploads stop), (2) after the new master and snapshot files are on disk, insert the version
row (log entry + checksum), close the round and move the task's version in one commit. A
crash before (2) leaves the round `aggregating`; `recover` recomputes the same entry (seeds,
noise and uploads all come from stored rows) and finishes it. After (2), the files of the
version `keep_versions` behind are deleted (`prune_versions`); a crash before that leaves them
for the next prune, which lists the task's store directories.

A close that fails is recorded (`Runtime.close_failures`): retried by the ticker with backoff,
or, when it would fail the same way on every attempt (`errors.fails_every_time`: a
non-finite update), left for an operator to abandon (`abandon.abandon_round`); each start's
`recover` tries it once more.
"""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import timedelta

import numpy as np
from seedfed.server.aggregation import apply_entry, combine
from seedfed.server.caches import at_quorum
from seedfed.server.errors import (
    ConflictError,
    EmptyRoundError,
    NotFoundError,
    RoundClosedError,
    fails_every_time,
)
from seedfed.server.orm import (
    DeviceRow,
    RoundRow,
    RoundState,
    TaskRow,
    UploadRow,
    VersionRow,
    utcnow,
)
from seedfed.server.runtime import CloseFailure, Runtime
from seedfed.server.service.opening import abandon_stale, locked_task, open_idle, open_scheduled
from seedfed.server.service.opening import (
    open_round as open_round,  # re-exported: opening rounds lives there
)
from seedfed.server.service.tasks import (
    get_task,
    load_master,
    mask_epoch_of,
    prune_versions,
    round_cap_of,
    spec_of,
    write_version_files,
)
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.scopes import Scope
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.wire import (
    MAX_ABS_LOSS,
    MAX_ABS_SCALAR,
    MAX_NUM_EXAMPLES,
    LogEntryWire,
    RoundPlan,
)
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

logger = logging.getLogger("seedfed.server")


def entry_of(row: VersionRow, task_id: str) -> LogEntry:
    coefs = np.frombuffer(row.coefs, dtype="<f4")
    return LogEntry(task_id, row.version - 1, tuple(json.loads(row.seeds_json)),
                    tuple(float(c) for c in coefs), row.checksum)


def wire_of(row: VersionRow, task_id: str, mask_epoch: int | None = None) -> LogEntryWire:
    """The log entry that produced version row `row`; `mask_epoch`: that version's epoch."""
    return LogEntryWire.from_entry(entry_of(row, task_id), mask_epoch=mask_epoch)


def get_round(session: Session, *, task_id: str, number: int) -> RoundRow:
    row = session.scalars(select(RoundRow).where(RoundRow.task_id == task_id,
                                                 RoundRow.number == number)).first()
    if row is None:
        get_task(session, task_id=task_id)
        raise NotFoundError(f"task {task_id!r} has no round {number}")
    return row


def open_plan(rt: Runtime, *, task_id: str) -> tuple[int, RoundPlan] | None:
    """(round id, plan) of the task's open round, cached; None when no round is open."""
    if rt.rounds.known(task_id):
        return rt.rounds.plan(task_id)
    with rt.transaction() as s:
        task = get_task(s, task_id=task_id)
        row = s.scalars(select(RoundRow).where(RoundRow.task_id == task_id,
                                               RoundRow.state == RoundState.OPEN)).first()
        hit = None if row is None else (row.id, RoundPlan.model_validate_json(row.plan_json))
        cap = round_cap_of(task)
    # Round transitions set the cache inside the state lock: one that came after the read
    # above must be kept, never overwritten with what this older read saw (a round opened
    # meanwhile, cached as "none open", refused every upload). This may run on the event
    # loop (the upload path), so it waits for the lock only briefly (a transition or an
    # upload batch holds it for one short unit of work); past that the read is answered
    # without being cached, and the next miss reads again.
    if not rt.state_lock.acquire(timeout=0.1):
        return hit
    try:
        if rt.rounds.known(task_id):
            return rt.rounds.plan(task_id)
        rt.rounds.found(task_id, hit, cap)
    finally:
        rt.state_lock.release()
    return hit


def current_plan(rt: Runtime, *, task_id: str) -> RoundPlan | None:
    hit = open_plan(rt, task_id=task_id)
    return None if hit is None else hit[1]


def cached_plan(rt: Runtime, *, task_id: str) -> tuple[bool, RoundPlan | None]:
    """(known, plan) of the task's open round from the cache alone, no query: an async
    route answers a known plan without a thread hop, and calls `current_plan` otherwise."""
    if not rt.rounds.known(task_id):
        return False, None
    hit = rt.rounds.plan(task_id)
    return True, None if hit is None else hit[1]


def _begin_close(rt: Runtime, task_id: str, number: int | None = None,
                 round_id: int | None = None) -> int:
    """Unit of work 1: stop uploads. Returns the id of the round to aggregate."""
    with rt.state_lock, rt.transaction() as s:
        get_task(s, task_id=task_id)
        q = select(RoundRow).where(RoundRow.task_id == task_id,
                                   RoundRow.state.in_([RoundState.OPEN, RoundState.AGGREGATING]))
        if number is not None:
            q = q.where(RoundRow.number == number)
        if round_id is not None:
            q = q.where(RoundRow.id == round_id)
        row = s.scalars(q).first()
        if row is None:
            if number is not None:
                got = get_round(s, task_id=task_id, number=number)
                raise RoundClosedError(f"round {number} of task {task_id!r} is {got.state}")
            raise ConflictError(f"task {task_id!r} has no open round to close")
        if row.state == RoundState.OPEN:
            n = s.scalar(select(func.count()).select_from(UploadRow)
                         .where(UploadRow.round_id == row.id)) or 0
            if n == 0:
                raise EmptyRoundError(f"round {row.number} of task {task_id!r} has no uploads "
                                      "to aggregate")
            row.state = RoundState.AGGREGATING
        rt.rounds.stopped(task_id)
        return row.id


def _usable(u: UploadRow, plan: RoundPlan) -> bool:
    """Whether a stored upload is within today's wire bounds. Rows stored before the bounds
    existed (a loss of 1e308, 10**12 examples) are left out instead of failing the close."""
    if (u.rows, u.cols) != (plan.steps, plan.perturbations) or \
            len(u.scalars) != 4 * u.rows * u.cols:
        return False
    if not (1 <= u.num_examples <= MAX_NUM_EXAMPLES and math.isfinite(u.loss)
            and abs(u.loss) <= MAX_ABS_LOSS):
        return False
    g = np.frombuffer(u.scalars, dtype="<f4")
    return bool(np.isfinite(g).all()) and (g.size == 0 or float(np.abs(g).max()) <= MAX_ABS_SCALAR)


def _aggregable_uploads(s: Session, round_id: int, plan: RoundPlan) -> list[UploadRow]:
    """The round's uploads that count: from devices not revoked (a device revoked while its
    upload sat in the open round is not aggregated), within the wire bounds."""
    rows = list(s.scalars(select(UploadRow).join(DeviceRow, DeviceRow.id == UploadRow.device_id)
                          .where(UploadRow.round_id == round_id, DeviceRow.revoked_at.is_(None))
                          .order_by(UploadRow.device_id)))
    kept = [u for u in rows if _usable(u, plan)]
    if len(kept) != len(rows):
        logger.warning("round %s: %d stored upload(s) outside the wire bounds left out",
                       round_id, len(rows) - len(kept))
    return kept


def _expire_unaggregatable(rt: Runtime, task_id: str, round_id: int, number: int) -> None:
    """Close a round none of whose uploads can be aggregated, without a new version."""
    with rt.state_lock, rt.transaction() as s:
        r = s.get(RoundRow, round_id)
        if r is not None and r.state == RoundState.AGGREGATING:
            r.state, r.closed_at, r.participants = RoundState.EXPIRED, utcnow(), 0
    rt.rounds.finished(round_id, keep_cap=True)
    rt.metrics.rounds_expired.inc()
    raise EmptyRoundError(f"round {number} of task {task_id!r} has no upload from an enrolled "
                          "device within the bounds; it expired without a new version")


def _abandon_stale(rt: Runtime, task_id: str, round_id: int) -> None:
    """Abandon an `aggregating` round planned at a base the task has moved past: no close
    can ever commit it, so it must not stay `aggregating` (refused at every start, the task
    stuck). Raises the ConflictError that tells its closer (nothing left to retry)."""
    with rt.state_lock, rt.transaction() as s:
        r = s.get(RoundRow, round_id)
        task = locked_task(s, task_id)
        assert r is not None
        number, base, current = r.number, r.base_version, task.current_version
        if r.state == RoundState.AGGREGATING and base != current:
            abandon_stale(s, r, current)
    rt.rounds.finished(round_id, keep_cap=True)
    raise RoundClosedError(f"round {number} of task {task_id!r} was planned at v{base} but the "
                           f"task is at v{current}: abandoned without a new version (its "
                           "uploads are not aggregated); the next round opens at "
                           f"v{current}")


def _record_failure(rt: Runtime, task_id: str, round_id: int, exc: BaseException) -> None:
    """Note a failed close for the status pages and, unless it would fail the same way again
    (`errors.fails_every_time`), for the ticker's retry with exponential backoff."""
    prev = rt.close_failures.get(task_id)
    attempts = 1 if prev is None or prev.round_id != round_id else prev.attempts + 1
    st = rt.settings
    delay = min(st.close_retry_base_s * 2.0 ** (attempts - 1), st.close_retry_max_s)
    permanent = fails_every_time(exc)
    now = utcnow()
    number = None if prev is None else prev.round
    try:
        with rt.transaction() as s:
            r = s.get(RoundRow, round_id)
            number = None if r is None else r.number
    except Exception:  # the database is what failed: record the failure all the same
        pass
    rt.close_failures.record(task_id, CloseFailure(
        round_id=round_id, round=number, attempts=attempts,
        error=f"{type(exc).__name__}: {exc}"[:500], failed_at=now,
        retry_at=None if permanent else now + timedelta(seconds=delay), permanent=permanent))
    if permanent:
        logger.error("close of round %s of task %s fails on every attempt and is not retried "
                     "(%s: %s); abandon the round (seedfed round abandon %s %s --reason ...) "
                     "for the task to go on from its committed version", number, task_id,
                     type(exc).__name__, exc, task_id, number, exc_info=exc)
    else:
        logger.error("close of round %s of task %s failed (attempt %d, retry in %.0f s): %s",
                     number, task_id, attempts, delay, exc, exc_info=exc)


def _finish(rt: Runtime, task_id: str, round_id: int) -> LogEntryWire:
    """`_finish_once`, recording a failure (anything but a state conflict) for the retry."""
    try:
        out = _finish_once(rt, task_id, round_id)
    except (ConflictError, NotFoundError):
        rt.close_failures.clear(task_id)  # nothing left to retry
        raise
    except Exception as e:
        try:
            _record_failure(rt, task_id, round_id, e)
        except Exception:  # the database itself is down: retry anyway, later
            logger.exception("could not record the failed close of task %s", task_id)
        raise
    rt.close_failures.clear(task_id)
    return out


def _finish_once(rt: Runtime, task_id: str, round_id: int) -> LogEntryWire:
    """Aggregate an `aggregating` round, write its files, commit its version (unit of work 2)."""
    started = time.perf_counter()
    with rt.task_lock(task_id):
        with rt.transaction() as s:
            task = get_task(s, task_id=task_id)
            row = s.get(RoundRow, round_id)
            if row is None or row.task_id != task_id:
                raise NotFoundError(f"task {task_id!r} has no round with id {round_id}")
            if row.state == RoundState.CLOSED and row.result_version is not None:
                done = s.get(VersionRow, (task_id, row.result_version))
                assert done is not None
                return wire_of(done, task_id, mask_epoch_of(spec_of(task), done.version))
            spec = spec_of(task)
            plan = RoundPlan.model_validate_json(row.plan_json)
            if row.state != RoundState.AGGREGATING:
                raise RoundClosedError(f"round {row.number} of task {task_id!r} is "
                                       f"{row.state}, not aggregating")
            uploads = _aggregable_uploads(s, round_id, plan)
            base, number, secret = row.base_version, row.number, task.secret
        if base != task.current_version:
            _abandon_stale(rt, task_id, round_id)
        if not uploads:
            _expire_unaggregatable(rt, task_id, round_id, number)
        combined = combine(
            task_id=task_id, base_version=base, round_number=number, seeds=plan.flat_seeds,
            perturbations=plan.perturbations, lr=plan.lr,
            matrices=[np.frombuffer(u.scalars, dtype="<f4").reshape(u.rows, u.cols)
                      for u in uploads],
            num_examples=[u.num_examples for u in uploads], losses=[u.loss for u in uploads],
            config=spec.aggregation, secret=secret, dp_devices=plan.quorum)
        master = load_master(rt, task_id=task_id)
        entry = combined.entry
        with master.lock:
            scope: Scope = master.bundle.scope
            try:
                chk = apply_entry(scope, entry.seeds, entry.coefs, rt.faults.mid_aggregation)
                if scope.enter_version(base + 1):
                    # A new mask epoch (ternary): the version's state, and so its checksum,
                    # is that of the new masks. Rebuilding from the log redoes this step at
                    # the same version, on the same latents, with the same result.
                    chk = checksum(scope)
                fp32, snap = write_version_files(rt, task_id=task_id, version=base + 1,
                                                 spec=spec, master=master, chk=chk)
                if rt.faults.after_files is not None:
                    rt.faults.after_files()
                elapsed = time.perf_counter() - started
                with rt.transaction() as s:
                    moved = s.execute(update(TaskRow).where(
                        TaskRow.id == task_id, TaskRow.current_version == base).values(
                        current_version=base + 1)).rowcount  # type: ignore[attr-defined]
                    if moved != 1:
                        raise ConflictError(f"task {task_id!r} moved past v{base} during the "
                                            f"close of round {number}")
                    s.add(VersionRow(
                        task_id=task_id, version=base + 1, round_number=number,
                        seeds_json=json.dumps(list(entry.seeds)),
                        coefs=np.asarray(entry.coefs, dtype="<f4").tobytes(), checksum=chk,
                        master_path=fp32.path, master_sha256=fp32.sha256,
                        master_bytes=fp32.nbytes, snapshot_path=snap.path,
                        snapshot_sha256=snap.sha256, snapshot_bytes=snap.nbytes,
                        noise_std=combined.noise_std))
                    r = s.get(RoundRow, round_id)
                    if r is None or r.state != RoundState.AGGREGATING:
                        # Abandoned by an operator while this close ran (the version move
                        # above is rolled back with this unit of work; the files written for
                        # v{base + 1} are overwritten by the next close that reaches it).
                        raise ConflictError(f"round {number} of task {task_id!r} was "
                                            "abandoned during its close")
                    r.state = RoundState.CLOSED
                    r.closed_at = utcnow()
                    r.participants = len(uploads)
                    r.loss = combined.loss
                    r.upload_bytes = sum(u.wire_bytes for u in uploads)
                    r.aggregation_s = elapsed
                    r.result_version = base + 1
            except BaseException:
                # The in-memory master may hold a partial update: forget it, so the next use
                # reloads the committed version from the store (cheaper than a stash copy).
                rt.drop_master(task_id)
                raise
            master.version = base + 1
        # Version base + 1 is committed: only now may the files it made unneeded go.
        prune_versions(rt, task_id=task_id, version=base + 1)
    rt.rounds.finished(round_id)
    rt.metrics.rounds_closed.inc()
    rt.metrics.aggregation_seconds.observe(time.perf_counter() - started)
    return LogEntryWire.from_entry(LogEntry(task_id, base, entry.seeds, entry.coefs, chk),
                                   mask_epoch=mask_epoch_of(spec, base + 1))


def close_round(rt: Runtime, *, task_id: str, number: int | None = None,
                round_id: int | None = None) -> LogEntryWire:
    """Aggregate what arrived in the open round (only if it is round `number` / row
    `round_id`, when given) and commit the new version."""
    return _finish(rt, task_id, _begin_close(rt, task_id, number, round_id))


def is_due(rt: Runtime, *, task_id: str, round_id: int) -> bool:
    """Whether round `round_id` is the task's open round and at its quorum (cached counts)."""
    return rt.rounds.is_due(task_id, round_id)


def close_if_due(rt: Runtime, *, task_id: str, round_id: int) -> LogEntryWire | None:
    """Close round `round_id` if it is still open and reached its quorum (upload path), then
    open the task's next round if its automatic schedule runs it."""
    if not is_due(rt, task_id=task_id, round_id=round_id):
        return None
    try:
        entry = close_round(rt, task_id=task_id, round_id=round_id)
    except ConflictError:
        return None  # closed concurrently
    try:
        open_scheduled(rt, task_id=task_id)
    except Exception as e:  # the ticker opens it at its next tick: the close stands
        logger.warning("task %s: the next round did not open after round %s closed (%s: %s); "
                       "the ticker retries", task_id, round_id, type(e).__name__, e)
    return entry


def expire_round(rt: Runtime, *, task_id: str, round_id: int) -> bool:
    """Close an open round without uploads at its deadline (no new version). True if done."""
    with rt.state_lock, rt.transaction() as s:
        row = s.get(RoundRow, round_id)
        if row is None or row.state != RoundState.OPEN:
            return False
        n = s.scalar(select(func.count()).select_from(UploadRow)
                     .where(UploadRow.round_id == round_id)) or 0
        if n:
            return False
        row.state = RoundState.EXPIRED
        row.closed_at = utcnow()
        rt.rounds.stopped(task_id)
    rt.metrics.rounds_expired.inc()
    return True


def due_rounds(rt: Runtime) -> list[tuple[str, int, bool]]:
    """Open rounds at quorum or past their deadline: (task_id, round id, has uploads)."""
    now = utcnow()
    out: list[tuple[str, int, bool]] = []
    with rt.transaction() as s:
        counts = (select(UploadRow.round_id, func.count().label("n"))
                  .group_by(UploadRow.round_id).subquery())
        q = (select(RoundRow.task_id, RoundRow.id, RoundRow.quorum, RoundRow.deadline,
                    func.coalesce(counts.c.n, 0))
             .outerjoin(counts, counts.c.round_id == RoundRow.id)
             .where(RoundRow.state == RoundState.OPEN))
        for task_id, rid, quorum, deadline, n in s.execute(q):
            if at_quorum(n, quorum) or deadline <= now:
                out.append((task_id, rid, n > 0))
    return out


def retry_failed_closes(rt: Runtime) -> list[LogEntryWire]:
    """Retry every failed close whose backoff has passed (the ticker calls this); one task's
    failure does not keep the others from closing."""
    now = utcnow()
    due = rt.close_failures.due(now)
    done: list[LogEntryWire] = []
    for task_id, round_id in due + _orphaned(rt):
        try:
            done.append(_finish(rt, task_id, round_id))
        except Exception:  # recorded by _finish with its next retry time
            continue
    return done


def _orphaned(rt: Runtime) -> list[tuple[str, int]]:
    """Rounds left `aggregating` with no failure on record and no close in progress (e.g. a
    close whose failure could not even be noted). Finishing one twice is harmless: `_finish`
    holds the task lock, and the second call returns the committed entry."""
    with rt.transaction() as s:
        rows = list(s.execute(select(RoundRow.task_id, RoundRow.id)
                              .where(RoundRow.state == RoundState.AGGREGATING)))
    return [(t, rid) for t, rid in rows
            if t not in rt.close_failures and not rt.task_lock(t).locked()]


def tick(rt: Runtime, *, auto_open: bool = False) -> list[LogEntryWire]:
    """Close every round that reached its quorum or deadline; expire empty ones at deadline;
    retry failed closes whose backoff passed; with `auto_open`, then open the next round of
    every task the automatic schedule runs (`opening.open_idle`). A failing task is recorded
    and skipped, never blocking the others."""
    closed = retry_failed_closes(rt)
    for task_id, rid, has_uploads in due_rounds(rt):
        if not has_uploads:
            expire_round(rt, task_id=task_id, round_id=rid)
            continue
        try:
            closed.append(close_round(rt, task_id=task_id, round_id=rid))
        except (ConflictError, NotFoundError):
            continue  # closed concurrently by an admin or the upload path
        except Exception:
            continue  # recorded in rt.close_failures: retried with backoff
    if auto_open:
        open_idle(rt)
    return closed


def recover(rt: Runtime) -> list[LogEntryWire]:
    """Finish every round a crash left `aggregating` (same entry as the interrupted close).
    A task whose close fails again is recorded for the ticker's retry; the others recover."""
    with rt.transaction() as s:
        pending = list(s.execute(select(RoundRow.task_id, RoundRow.id)
                                 .where(RoundRow.state == RoundState.AGGREGATING)))
    done: list[LogEntryWire] = []
    for task_id, rid in pending:
        try:
            done.append(_finish(rt, task_id, rid))
        except ConflictError as e:
            logger.warning("recovery of round %s of task %s: %s", rid, task_id, e)
        except Exception:
            continue  # recorded by _finish: the ticker retries it
    return done
