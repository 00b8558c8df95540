"""Tasks: creation (version 0 in the model store), listing, status, and the loaded masters."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Literal

import numpy as np
from seedfed.server import privacy
from seedfed.server.errors import InvalidTaskError, NotFoundError, StoreError
from seedfed.server.formats import publisher
from seedfed.server.orm import (
    DeviceRow,
    RoundRow,
    RoundState,
    Schedule,
    TaskRow,
    UploadRow,
    VersionRow,
    utcnow,
)
from seedfed.server.runtime import Master, Runtime
from seedfed.server.schemas import TaskStatus
from seedfed.server.service.join_tokens import new_join_token
from seedfed.server.service.lookups import get_task, hash_token
from seedfed.server.service.waiting import TaskMoment, waiting_of
from seedfed.server.store import StoredFile
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.probe_check import ProbeMemoryError, check_task_probes
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.scopes import scope_epoch
from seedfed.shared.protocol.errors import ScopeError, SeedfedError
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import (
    MAX_DIM,
    MAX_NUM_EXAMPLES,
    MAX_ROUND,
    MAX_VERSION,
    Upload,
    encode_scalars,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session

#: The form of a task secret (`secrets.token_hex(16)`; `aggregation.round_rng` reads it).
_SECRET = re.compile(r"[0-9a-f]{32}")


def spec_of(task: TaskRow) -> TaskSpec:
    return TaskSpec.from_dict(json.loads(task.spec_json), stored=True)  # ranges: at creation


def round_cap_of(task: TaskRow) -> int | None:
    """Most uploads one round of the task accepts (devices_per_round; None: no cap)."""
    return task.devices_per_round


def largest_upload_bytes(steps: int, perturbations: int) -> int:
    """Bytes of the largest JSON upload a device can send for a steps x P plan (its
    numbers at their widest), a little more than the binary form."""
    if steps > MAX_DIM or perturbations > MAX_DIM:
        return 4 * steps * perturbations  # refused for its dimensions anyway
    up = Upload(task_id="f" * 64, round=MAX_ROUND, version=MAX_VERSION,
                shape=(steps, perturbations), scalars=encode_scalars(
                    np.zeros((steps, perturbations), dtype=np.float32)),
                num_examples=MAX_NUM_EXAMPLES, loss=-0.12345678901234567)
    return len(up.model_dump_json()) + 64  # whitespace a client's JSON writer may add


def check_plan_fits(spec: TaskSpec, max_body_bytes: int) -> None:
    """Refuse a task whose uploads could never pass the body limit (or the wire's MAX_DIM)."""
    steps, p = spec.largest_plan()
    if steps > MAX_DIM or p > MAX_DIM:
        raise InvalidTaskError(f"steps ({steps}) and perturbations ({p}) must each be at most "
                               f"{MAX_DIM}")
    need = 4 * steps * p if 4 * steps * p > max_body_bytes else largest_upload_bytes(steps, p)
    if need > max_body_bytes:
        raise InvalidTaskError(f"an upload for {steps} x {p} scalars takes up to {need} bytes, "
                               f"above the coordinator's body limit of {max_body_bytes} "
                               "(max_body_bytes): no device could upload")


def get_version(session: Session, *, task_id: str, version: int) -> VersionRow:
    row = session.get(VersionRow, (task_id, version))
    if row is None:
        current = get_task(session, task_id=task_id).current_version
        raise NotFoundError(f"task {task_id!r} has no version {version} (current: {current})")
    return row


def mask_epoch_of(spec: TaskSpec, version: int) -> int | None:
    """The mask epoch of `version` of the task (None: its scope has no epochs)."""
    return scope_epoch(spec.scope, spec.scope_options, version)


def write_version_files(rt: Runtime, *, task_id: str, version: int, spec: TaskSpec,
                        master: Master, chk: str) -> tuple[StoredFile, StoredFile]:
    """fp32 master and published snapshot of `version`; both on disk before any commit.

    The master file holds the scope's `master_state` (what a restart needs: for most scopes the
    covered values, for the ternary scope every latent plus gammas, masks and mask epoch); the
    snapshot is the task's format published from the covered values."""
    scope = master.bundle.scope
    state = scope.read()
    meta = {"task_id": task_id, "version": str(version), "checksum": chk}
    epoch = mask_epoch_of(spec, version)
    if epoch is not None:
        meta["mask_epoch"] = str(epoch)
    fp32 = rt.store.write_state(task_id, version, "master", scope.master_state(state),
                                {**meta, "format": "fp32"})
    if spec.format == "fp32":
        return fp32, fp32
    published = publisher(spec.format)(state, scope)
    snap = rt.store.write_state(task_id, version, spec.format, published,
                                {**meta, "format": spec.format})
    return fp32, snap


def pruned_through(current: int, keep: int) -> int:
    """The highest version whose files are pruned once version `current` is committed with
    `keep_versions = keep` (0: none). Version 0 and the last `keep` versions are kept."""
    return max(current - keep, 0) if keep > 0 else 0


def prune_versions(rt: Runtime, *, task_id: str, version: int) -> list[str]:
    """After the commit of `version` (never before it): delete the model store files of the
    versions `keep_versions` behind it and of any older one a crash left (not version 0).
    Returns the removed paths; the version rows and their log entries stay."""
    through = pruned_through(version, rt.settings.keep_versions)
    return rt.store.prune(task_id, through=through) if through > 0 else []


def create_task(rt: Runtime, *, spec: TaskSpec | dict[str, Any], name: str | None = None,
                quorum: int = 1, round_timeout_s: float = 600.0,
                devices_per_round: int | None = None,
                max_devices_per_token: int | None = None,
                schedule: str = Schedule.AUTO, max_rounds: int | None = None,
                secret: str | None = None) -> tuple[str, str, int, str]:
    """Build version 0 of the task's trainable state, store it, and commit the task with
    its first join token (enrolling at most `max_devices_per_token` devices; None: the
    Settings default). `schedule`: who opens its rounds (`orm.Schedule`; `auto` runs them
    back to back until version `max_rounds`, None: no limit).

    `secret` (32 lowercase hex digits) is for simulations and tests only: every round's
    seeds and DP noise derive from it, so a fixed one makes a run repeatable. A real task
    keeps the default, None: a fresh random secret, which no route or setting can replace
    (whoever knows it can predict every round's seeds and noise).

    Returns (task_id, join_token, version 0, checksum).
    """
    try:
        if isinstance(spec, dict):
            spec = TaskSpec.from_dict(spec)
    except (TypeError, ValueError) as e:
        raise InvalidTaskError(f"invalid task spec: {e}") from e
    if quorum < 1 or round_timeout_s <= 0 or (devices_per_round is not None
                                                and devices_per_round < 1):
        raise InvalidTaskError(f"quorum ({quorum}), round_timeout_s ({round_timeout_s}) and "
                               f"devices_per_round ({devices_per_round}) must be positive")
    if devices_per_round is not None and devices_per_round < quorum:
        raise InvalidTaskError(f"devices_per_round ({devices_per_round}) is below the quorum "
                               f"({quorum}): no round could reach its quorum")
    if secret is not None and not _SECRET.fullmatch(secret):
        raise InvalidTaskError("a task secret is 32 lowercase hex digits")
    if schedule not in (Schedule.AUTO, Schedule.MANUAL) or (max_rounds is not None
                                                           and max_rounds < 1):
        raise InvalidTaskError(f"schedule must be {Schedule.AUTO!r} or {Schedule.MANUAL!r} "
                               f"(got {schedule!r}) and max_rounds >= 1 (got {max_rounds})")
    check_plan_fits(spec, rt.settings.max_body_bytes)
    publisher(spec.format)  # unknown or not yet available formats fail before any work
    try:
        bundle = build_model(spec, initialize=True)
    except Exception as e:  # any loader failure is the spec's fault from the API's view
        raise InvalidTaskError(f"cannot build the task's model from {spec.model_path!r}: "
                               f"{type(e).__name__}: {e}") from e
    try:  # a scope the loss never reads, or stacked probes a device could not hold
        check_task_probes(bundle.model, bundle.scope, batch_size=spec.hyper.batch_size,
                          seq_len=spec.max_seq_len, copies=spec.hyper.probe_copies,
                          budget_mb=spec.hyper.probe_memory_mb)
    except (ScopeError, ProbeMemoryError) as e:
        raise InvalidTaskError(f"invalid task: {e}") from e
    task_id = secrets.token_hex(8)
    master = Master(bundle=bundle, version=0)
    chk = checksum(bundle.scope)
    fp32, snap = write_version_files(rt, task_id=task_id, version=0, spec=spec, master=master,
                                     chk=chk)
    with rt.transaction() as s:
        row = TaskRow(id=task_id, name=name or task_id, spec_json=json.dumps(spec.to_dict()),
                      format=spec.format, quorum=quorum, round_timeout_s=round_timeout_s,
                      devices_per_round=devices_per_round, join_token_hash="",
                      secret=secret or secrets.token_hex(16), current_version=0,
                      scope_numel=bundle.scope.numel, schedule=schedule,
                      max_rounds=max_rounds)
        s.add(row)
        s.flush()
        _, join_token = new_join_token(s, task_id=task_id, max_devices=max_devices_per_token)
        row.join_token_hash = hash_token(join_token)  # legacy column; enrolment reads join_tokens
        s.add(VersionRow(task_id=task_id, version=0, round_number=None, seeds_json="[]",
                         coefs=b"", checksum=chk, master_path=fp32.path,
                         master_sha256=fp32.sha256, master_bytes=fp32.nbytes,
                         snapshot_path=snap.path, snapshot_sha256=snap.sha256,
                         snapshot_bytes=snap.nbytes, noise_std=0.0))
    rt.keep_master(task_id, master)
    rt.rounds.stopped(task_id)
    return task_id, join_token, 0, chk


def load_master(rt: Runtime, *, task_id: str) -> Master:
    """The task's master at its committed version, from memory or from the model store."""
    with rt.transaction() as s:
        task = get_task(s, task_id=task_id)
        row = get_version(s, task_id=task_id, version=task.current_version)
        spec = spec_of(task)
    master = rt.cached_master(task_id)
    if master is not None and master.version == row.version:
        return master
    bundle = build_model(spec, initialize=False)
    try:
        bundle.scope.load_master_state(rt.store.read_state(row.master_path, row.master_sha256))
    except SeedfedError as e:  # a master file this model cannot take: the store is at fault
        raise StoreError(f"task {task_id} v{row.version}: master file does not fit the task's "
                         f"model: {e}") from e
    got = checksum(bundle.scope)
    if got != row.checksum:
        raise StoreError(f"task {task_id} v{row.version}: master file hashes to {got[:16]}..., "
                         f"the database says {row.checksum[:16]}...")
    master = Master(bundle=bundle, version=row.version)
    rt.keep_master(task_id, master)
    return master


def list_tasks(session: Session) -> list[TaskRow]:
    return list(session.scalars(select(TaskRow).order_by(TaskRow.created_at, TaskRow.id)))


def dp_epsilon(session: Session, *, task: TaskRow, delta: float) -> float | None:
    config = spec_of(task).aggregation
    if config.dp_clip is None:
        return None
    rounds = session.scalar(select(func.count()).select_from(VersionRow).where(
        VersionRow.task_id == task.id, VersionRow.version > 0)) or 0
    return privacy.epsilon(config.dp_noise_multiplier, rounds, delta)


def devices_seen(session: Session, *, task_id: str) -> int:
    q = (select(func.count(func.distinct(UploadRow.device_id)))
         .join(RoundRow, RoundRow.id == UploadRow.round_id).where(RoundRow.task_id == task_id))
    return session.scalar(q) or 0


def task_spec(session: Session, *, task_id: str) -> TaskSpec:
    """The task definition devices build their model from."""
    return spec_of(get_task(session, task_id=task_id))


def task_status(rt: Runtime, session: Session, *, task_id: str) -> TaskStatus:
    """The task's status: its round, what it waits for (`waiting.waiting_of`), its failing
    round close if any (`Runtime.close_failures`), its latest abandoned round, and its privacy
    spent at the coordinator's `dp_delta`."""
    failure = rt.close_failures.get(task_id)
    delta = rt.settings.dp_delta
    task = get_task(session, task_id=task_id)
    spec = spec_of(task)
    version = get_version(session, task_id=task_id, version=task.current_version)
    rounds = select(RoundRow).where(RoundRow.task_id == task_id).order_by(RoundRow.number.desc())
    last = session.scalars(rounds.limit(1)).first()
    abandoned = session.scalars(rounds.where(RoundRow.state == RoundState.ABANDONED)
                                .limit(1)).first()
    state: Literal["idle", "open", "aggregating"] = "idle"
    if last is not None and last.state == RoundState.OPEN:
        state = "open"
    elif last is not None and last.state == RoundState.AGGREGATING:
        state = "aggregating"
    open_row = last if last is not None and state == RoundState.OPEN else None
    uploads = 0 if open_row is None else session.scalar(
        select(func.count()).select_from(UploadRow).where(UploadRow.round_id == open_row.id)) or 0
    devices = session.scalar(select(func.count()).select_from(DeviceRow).where(
        DeviceRow.task_id == task_id, DeviceRow.revoked_at.is_(None))) or 0
    moment = TaskMoment(
        task_id=task_id, state=state, round=None if last is None else last.number,
        uploads=uploads, quorum=task.quorum,
        deadline=None if open_row is None else open_row.deadline,
        devices=devices, version=task.current_version, schedule=task.schedule,
        max_rounds=task.max_rounds, schedule_on=rt.settings.auto_open_rounds,
        failure=failure, now=utcnow())
    waiting_for, waiting = waiting_of(moment)
    eps = dp_epsilon(session, task=task, delta=delta)
    return TaskStatus(
        task_id=task.id, name=task.name, version=task.current_version, checksum=version.checksum,
        round=moment.round, state=state,
        devices=devices, devices_seen=devices_seen(session, task_id=task_id),
        quorum=task.quorum, round_timeout_s=task.round_timeout_s,
        devices_per_round=task.devices_per_round, scope=spec.scope, scope_numel=task.scope_numel,
        format=task.format, aggregation=spec.aggregation.rule, epsilon=eps,
        delta=None if eps is None else delta, created_at=task.created_at,
        close_error=None if failure is None else failure.error,
        close_attempts=0 if failure is None else failure.attempts,
        close_retry_at=None if failure is None else failure.retry_at,
        close_permanent=failure is not None and failure.permanent,
        schedule="auto" if task.schedule == Schedule.AUTO else "manual",
        max_rounds=task.max_rounds, uploads=uploads, deadline=moment.deadline,
        waiting_for=waiting_for, waiting=waiting,
        abandoned_round=None if abandoned is None else abandoned.number,
        abandon_reason=None if abandoned is None else abandoned.abandon_reason)
