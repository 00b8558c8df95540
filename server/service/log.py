"""The update log, snapshots, catch-up plans and per-round statistics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from seedfed.server.errors import (
    FormatNotPublishedError,
    InvalidQueryError,
    NotFoundError,
    StoreError,
    VersionAheadError,
)
from seedfed.server.orm import DeviceRow, RoundRow, UploadRow, VersionRow
from seedfed.server.runtime import Runtime
from seedfed.server.schemas import CatchupPlan, DeviceSummary, RoundMetrics, TaskStats
from seedfed.server.service.metrics import fleet_metrics, with_fleet_accuracy
from seedfed.server.service.rounds import wire_of
from seedfed.server.service.tasks import (
    devices_seen,
    dp_epsilon,
    get_task,
    get_version,
    mask_epoch_of,
    pruned_through,
    spec_of,
)
from seedfed.shared.protocol.messages import replay_bytes as estimate_replay_bytes
from seedfed.shared.protocol.wire import LogEntryWire
from sqlalchemy import func, select
from sqlalchemy.orm import Session

#: Defaults of the catch-up cost model, for a modest device (a Raspberry Pi 4 on Wi-Fi).
DEFAULT_BANDWIDTH = 2e6  # bytes/s
DEFAULT_REGEN_RATE = 1e8  # perturbation elements regenerated and added per second


def check_known_version(task_id: str, name: str, version: int, current: int) -> None:
    """A device's version (`from`, `since`) must be one the task has had: a negative one is
    invalid (422), one beyond the current version a conflict with the task's state (409: the
    device holds a state the coordinator never made, e.g. after a restore from an older
    backup; it must load the current snapshot)."""
    if version < 0:
        raise InvalidQueryError(f"{name}={version} is not a version (0..{current})")
    if version > current:
        raise VersionAheadError(f"{name}={version} is beyond task {task_id!r}'s current version "
                                f"{current}: this device's state is not one of the task's "
                                f"versions; download snapshot {current} and start from it")


def log_since(session: Session, *, task_id: str, since: int,
              limit: int | None = None) -> list[LogEntryWire]:
    """Entries after version `since` (from `since` to `since + 1` onwards), in version order."""
    task = get_task(session, task_id=task_id)
    check_known_version(task_id, "since", since, task.current_version)
    q = (select(VersionRow).where(VersionRow.task_id == task_id, VersionRow.version > since)
         .order_by(VersionRow.version))
    if limit is not None:
        q = q.limit(limit)
    spec = spec_of(task)
    return [wire_of(row, task_id, mask_epoch_of(spec, row.version))
            for row in session.scalars(q)]


def snapshot_info(session: Session, *, task_id: str, version: int,
                  fmt: str | None = None) -> tuple[str, str, str, int, str]:
    """(store path, file sha256, state checksum, size, format) of a version's snapshot:
    the fp32 master by default, the task's published format with fmt=task format."""
    task = get_task(session, task_id=task_id)
    row = get_version(session, task_id=task_id, version=version)
    if fmt is None or fmt == "fp32":
        return row.master_path, row.master_sha256, row.checksum, row.master_bytes, "fp32"
    if fmt != task.format:
        raise FormatNotPublishedError(f"task {task_id!r} publishes its snapshots as fp32 and "
                                      f"{task.format}, not {fmt!r}: ask for ?format="
                                      f"{task.format}, or leave format out for fp32")
    return row.snapshot_path, row.snapshot_sha256, row.checksum, row.snapshot_bytes, task.format


def unavailable_snapshot(rt: Runtime, *, task_id: str, version: int,
                         path: str) -> NotFoundError | None:
    """Why the store file `path` of `version` cannot be read, as a 404 for the device: None
    when the file is there (the failure was something else) or when the version is one the
    store must hold (0 and the current one: their loss is a StoreError, a 500)."""
    if rt.store.exists(path):
        return None
    with rt.transaction() as s:  # fresh: a close may have committed since the row was read
        current = get_task(s, task_id=task_id).current_version
    if version in (0, current):
        return None
    keep = rt.settings.keep_versions
    advice = (f"download version {current} (the current one) or replay the log from a "
              "version you hold")
    if 0 < version <= pruned_through(current, keep):
        return NotFoundError(f"task {task_id!r} v{version}: its snapshot was pruned from the "
                             f"model store (keep_versions={keep} keeps version 0 and the last "
                             f"{keep}); {advice}")
    return NotFoundError(f"task {task_id!r} v{version}: its snapshot is no longer in the model "
                         f"store (pruned under an earlier, smaller keep_versions, or lost; "
                         f"keep_versions={keep}); {advice}")


def snapshot_bytes(rt: Runtime, *, task_id: str, version: int,
                   fmt: str | None = None) -> tuple[bytes, str]:
    with rt.transaction() as s:
        path, sha, chk, _, _ = snapshot_info(s, task_id=task_id, version=version, fmt=fmt)
    try:
        return rt.store.read_bytes(path, sha), chk
    except StoreError as e:
        gone = unavailable_snapshot(rt, task_id=task_id, version=version, path=path)
        if gone is None:
            raise
        raise gone from e


def open_snapshot(rt: Runtime, session: Session, *, task_id: str, version: int,
                  fmt: str | None = None,
                  ) -> tuple[tuple[str, str, str, int, str], Iterator[bytes]]:
    """`snapshot_info` and the file's chunks, opened now: a missing file is an error before
    any byte is sent (a pruned version's NotFoundError), and a prune after this call does
    not cut the stream."""
    info = snapshot_info(session, task_id=task_id, version=version, fmt=fmt)
    try:
        return info, rt.store.iter_file(info[0])
    except StoreError as e:
        gone = unavailable_snapshot(rt, task_id=task_id, version=version, path=info[0])
        if gone is None:
            raise
        raise gone from e


def serve_log(rt: Runtime, session: Session, *, task_id: str, since: int,
              limit: int | None = None) -> list[LogEntryWire]:
    """`log_since` for a device over HTTP, counted in the `bytes_out{kind="log"}` metric."""
    entries = log_since(session, task_id=task_id, since=since, limit=limit)
    rt.metrics.bytes_out.labels("log").inc(sum(len(e.coefs) + 40 * len(e.seeds)
                                               for e in entries))
    return entries


def serve_snapshot(rt: Runtime, session: Session, *, task_id: str, version: int,
                   fmt: str | None = None,
                   ) -> tuple[tuple[str, str, str, int, str], Iterator[bytes]]:
    """`open_snapshot` for a device over HTTP, counted in `bytes_out{kind="snapshot"}`."""
    info, stream = open_snapshot(rt, session, task_id=task_id, version=version, fmt=fmt)
    rt.metrics.bytes_out.labels("snapshot").inc(info[3])
    return info, stream


def catchup_plan(session: Session, *, task_id: str, from_version: int,
                 bandwidth: float = DEFAULT_BANDWIDTH,
                 regen_rate: float = DEFAULT_REGEN_RATE) -> CatchupPlan:
    """Replay or download, whichever the device's rates make cheaper (estimated seconds).

    Download, whatever the rates, when (from, to] holds a mask epoch start (a ternary task):
    the new masks select latents a device's packed model does not hold, so replay cannot
    reach the target's state. A download is always of the current version, whose files are
    never pruned (`keep_versions`), and the log it replays is never pruned either."""
    if bandwidth <= 0 or regen_rate <= 0:
        raise InvalidQueryError(f"bandwidth ({bandwidth}) and regen_rate ({regen_rate}) must "
                                "be positive")
    task = get_task(session, task_id=task_id)
    to = task.current_version
    check_known_version(task_id, "from", from_version, to)
    latest = get_version(session, task_id=task_id, version=to)
    if from_version == to:
        return CatchupPlan(task_id=task_id, from_version=from_version, to_version=to,
                           action="none", replay_seeds=0, replay_bytes=0, replay_seconds=0.0,
                           download_bytes=latest.snapshot_bytes, download_seconds=0.0)
    n_entries, n_seeds = session.execute(
        select(func.count(), func.coalesce(func.sum(func.length(VersionRow.coefs)), 0))
        .where(VersionRow.task_id == task_id, VersionRow.version > from_version)).one()
    n_seeds = int(n_seeds) // 4
    replay_bytes = estimate_replay_bytes(int(n_entries), n_seeds)
    replay_s = replay_bytes / bandwidth + n_seeds * task.scope_numel / regen_rate
    download_s = latest.snapshot_bytes / bandwidth
    spec = spec_of(task)
    epochs = (mask_epoch_of(spec, from_version), mask_epoch_of(spec, to))
    reason = None
    action: Literal["replay", "download"]
    if epochs[0] != epochs[1]:
        action = "download"
        reason = (f"v{from_version} (mask epoch {epochs[0]}) and v{to} (mask epoch "
                  f"{epochs[1]}) lie in different mask epochs; replay cannot cross one")
    else:
        action = "replay" if replay_s <= download_s else "download"
    return CatchupPlan(task_id=task_id, from_version=from_version, to_version=to,
                       action=action, replay_seeds=n_seeds, replay_bytes=replay_bytes,
                       replay_seconds=replay_s, download_bytes=latest.snapshot_bytes,
                       download_seconds=download_s, mask_epoch=epochs[1], reason=reason)


def round_metrics(session: Session, *, task_id: str) -> list[RoundMetrics]:
    task = get_task(session, task_id=task_id)
    versions = {v.version: v for v in session.scalars(
        select(VersionRow).where(VersionRow.task_id == task_id, VersionRow.version > 0))}
    fedavg_each = 2 * 4 * task.scope_numel
    spec = spec_of(task)
    reported = fleet_metrics(session, task_id=task_id)
    out = []
    for r in session.scalars(select(RoundRow).where(RoundRow.task_id == task_id)
                             .order_by(RoundRow.number)):
        v = versions.get(r.result_version) if r.result_version is not None else None
        entry_bytes = len(wire_of(v, task_id, mask_epoch_of(spec, v.version))
                          .model_dump_json()) if v is not None else 0
        participants = r.participants
        upload_bytes = r.upload_bytes
        if r.result_version is None:  # still open: count what arrived so far
            participants, upload_bytes = session.execute(
                select(func.count(), func.coalesce(func.sum(UploadRow.wire_bytes), 0))
                .where(UploadRow.round_id == r.id)).one()
        out.append(with_fleet_accuracy(RoundMetrics(
            round=r.number, version=r.result_version, base_version=r.base_version, state=r.state,
            participants=participants, loss=r.loss, upload_bytes=upload_bytes,
            download_bytes=participants * (len(r.plan_json) + entry_bytes),
            fedavg_bytes=participants * fedavg_each, opened_at=r.opened_at,
            closed_at=r.closed_at, aggregation_seconds=r.aggregation_s,
            abandon_reason=r.abandon_reason),
            reported.get(r.number, ())))
    return out


# --- for the dashboard: the devices behind the counts ----------------------------------------

#: Most devices listed in the stats; a fleet of thousands keeps the payload small.
DEVICE_LIST_LIMIT = 200


def device_summaries(session: Session, *, task_id: str,
                     limit: int = DEVICE_LIST_LIMIT) -> list[DeviceSummary]:
    """The task's devices, most recently seen first (never-seen ones last), with their
    upload counts. One query: uploads aggregated per device, outer-joined to the devices."""
    per_device = (select(UploadRow.device_id, func.count().label("uploads"),
                         func.max(RoundRow.number).label("last_round"))
                  .join(RoundRow, RoundRow.id == UploadRow.round_id)
                  .where(RoundRow.task_id == task_id)
                  .group_by(UploadRow.device_id).subquery())
    rows = session.execute(
        select(DeviceRow, per_device.c.uploads, per_device.c.last_round)
        .outerjoin(per_device, per_device.c.device_id == DeviceRow.id)
        .where(DeviceRow.task_id == task_id)
        .order_by(DeviceRow.last_seen_at.desc().nulls_last(), DeviceRow.created_at.desc(),
                  DeviceRow.id)
        .limit(limit))
    return [DeviceSummary(device_id=d.id, enrolled_at=d.created_at, last_seen_at=d.last_seen_at,
                          uploads=int(n or 0), last_round=last, revoked_at=d.revoked_at)
            for d, n, last in rows]


def task_stats(session: Session, *, task_id: str, delta: float) -> TaskStats:
    task = get_task(session, task_id=task_id)
    enrolled, revoked = session.execute(
        select(func.count(), func.count(DeviceRow.revoked_at)).where(
            DeviceRow.task_id == task_id)).one()
    return TaskStats(task_id=task.id, name=task.name, version=task.current_version,
                     scope_numel=task.scope_numel, devices_enrolled=int(enrolled),
                     devices_revoked=int(revoked),
                     devices_seen=devices_seen(session, task_id=task_id),
                     fedavg_bytes_per_participant=2 * 4 * task.scope_numel,
                     epsilon=dp_epsilon(session, task=task, delta=delta),
                     rounds=round_metrics(session, task_id=task_id),
                     devices=device_summaries(session, task_id=task_id))  # dashboard
