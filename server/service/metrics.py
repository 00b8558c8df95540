"""Device metrics: each device's held-out scores per round, and the fleet's statistics of them.

Devices report what they scored on their own held-out examples (`shared.wire.DeviceMetrics`):
the shared model alone, shared + personal, local only. Numbers only, bounded by the wire
schema before they get here. The Flower strategy (sync replies) and the REST route
`POST /v1/tasks/{id}/rounds/{n}/metrics` both store them through `record_device_metrics`.

A repeat **replaces**: the latest report of a device for a round is the one kept (an upsert on
the (round, device) unique key, atomic on SQLite and PostgreSQL alike). Metrics feed no
aggregation and commit nothing else, so there is no earlier value a later one could corrupt,
and a device that scores again (after a restart, or a reset of its personal part) reports
where it stands now; the same report sent twice leaves the same row.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from seedfed.server.errors import InvalidMetricsError, PermissionDeniedError
from seedfed.server.orm import DeviceMetricsRow, DeviceRow, RoundRow, utcnow
from seedfed.server.runtime import Runtime
from seedfed.server.schemas import MetricsReceipt, RoundMetrics
from seedfed.server.service.lookups import get_task
from seedfed.server.service.rounds import get_round
from seedfed.shared.protocol.fleet_stats import fleet_accuracy
from seedfed.shared.protocol.wire import DeviceMetrics
from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def record_device_metrics(rt: Runtime, *, task_id: str, round_number: int, device_id: str,
                          metrics: DeviceMetrics) -> MetricsReceipt:
    """Store a device's scores for a round, replacing its earlier report for that round.

    Refused: an unknown task or round (NotFoundError), a device that is not the task's or is
    revoked (PermissionDeniedError), and a `version` outside the round's base version .. the
    task's current version (InvalidMetricsError): the device cannot have scored a version the
    task never had, nor one older than the round it reports for.
    """
    with rt.transaction() as s:
        task = get_task(s, task_id=task_id)
        row = get_round(s, task_id=task_id, number=round_number)
        device = s.get(DeviceRow, device_id)
        if device is None or device.task_id != task_id or device.revoked_at is not None:
            raise PermissionDeniedError(f"device {device_id!r} is not an active device of "
                                        f"task {task_id!r}")
        if not row.base_version <= metrics.version <= task.current_version:
            raise InvalidMetricsError(
                f"metrics of v{metrics.version} for round {round_number}: the version must be "
                f"in v{row.base_version} (the round's base) .. v{task.current_version} (the "
                "task's current version)")
        now = utcnow()
        values = {"version": metrics.version, "num_examples": metrics.num_examples,
                  "shared_accuracy": metrics.shared_accuracy,
                  "personal_accuracy": metrics.personal_accuracy,
                  "local_accuracy": metrics.local_accuracy, "reported_at": now}
        dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
        stmt = dialect.insert(DeviceMetricsRow).values(round_id=row.id, device_id=device_id,
                                                       **values)
        s.execute(stmt.on_conflict_do_update(index_elements=["round_id", "device_id"],
                                             set_=values))
    return MetricsReceipt(task_id=task_id, round=round_number, device_id=device_id,
                          version=metrics.version, received_at=now)


def device_metrics(session: Session, *, task_id: str, round_number: int,
                   ) -> list[DeviceMetricsRow]:
    """The reports stored for a round, by device id."""
    row = get_round(session, task_id=task_id, number=round_number)
    return list(session.scalars(select(DeviceMetricsRow)
                                .where(DeviceMetricsRow.round_id == row.id)
                                .order_by(DeviceMetricsRow.device_id)))


Scores = tuple[float, float | None, float | None]  # shared, personal, local


def fleet_metrics(session: Session, *, task_id: str) -> dict[int, list[Scores]]:
    """Per round number, every device's (shared, personal, local) accuracies. One query."""
    get_task(session, task_id=task_id)
    out: dict[int, list[Scores]] = defaultdict(list)
    for number, shared, personal, local in session.execute(
            select(RoundRow.number, DeviceMetricsRow.shared_accuracy,
                   DeviceMetricsRow.personal_accuracy, DeviceMetricsRow.local_accuracy)
            .join(RoundRow, RoundRow.id == DeviceMetricsRow.round_id)
            .where(RoundRow.task_id == task_id)):
        out[number].append((shared, personal, local))
    return out


def with_fleet_accuracy(m: RoundMetrics, scores: Iterable[Scores]) -> RoundMetrics:
    """`m` with the fleet's mean and worst decile of the round's reported accuracies: shared
    over every reporting device, personalized over those that have a personal part."""
    scores = list(scores)
    shared = fleet_accuracy([a for a, _, _ in scores])
    if shared is None:
        return m
    personal = fleet_accuracy([p for _, p, _ in scores if p is not None])
    local = fleet_accuracy([v for _, _, v in scores if v is not None])
    return m.model_copy(update={
        "metric_devices": shared.devices, "shared_accuracy_mean": shared.mean,
        "shared_accuracy_worst_decile": shared.worst_decile,
        "personal_devices": 0 if personal is None else personal.devices,
        "personal_accuracy_mean": None if personal is None else personal.mean,
        "personal_accuracy_worst_decile": None if personal is None else personal.worst_decile,
        "local_accuracy_mean": None if local is None else local.mean})
