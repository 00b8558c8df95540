"""The in-process facade of the coordinator: what `seedfed simulate` and the Flower ServerApp
call, and the same service functions the REST routes use.

    coord = Coordinator.open(Settings(database_url=..., store_dir=..., admin_token=...))
    task_id = coord.create_task(spec, quorum=2)
    device_id, token = coord.enroll(task_id)
    plan = coord.open_round(task_id)
    coord.submit(task_id, device_id, Upload.build(plan, g, n, loss))
    entry = coord.close_round(task_id)          # new version, log entry, checksum
    data, chk = coord.snapshot(task_id, entry.base_version + 1)

Rounds close when this object is told to (`close_round`) or on `tick()` (quorum or deadline
reached); the HTTP app runs `tick()` on a timer, with the automatic schedule. Tasks created
here default to `schedule="manual"`: this object's callers (simulate, the Flower ServerApp,
benchmarks) open every round themselves. Errors are the typed errors of
`seedfed.server.errors` and `seedfed.shared.protocol.errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from seedfed.server import service
from seedfed.server.orm import DeviceMetricsRow, Schedule
from seedfed.server.runtime import Runtime
from seedfed.server.schemas import (
    AbandonedRound,
    CatchupPlan,
    MetricsReceipt,
    RoundMetrics,
    TaskStats,
    TaskStatus,
    UploadReceipt,
)
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import DeviceMetrics, LogEntryWire, RoundPlan, Upload, pack_binary


class Coordinator:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    @classmethod
    def open(cls, settings: Settings) -> Coordinator:
        """Engine, migrations, model store; finishes any round a crash left aggregating."""
        coord = cls(Runtime(settings))
        service.recover(coord.rt)
        return coord

    def close(self) -> None:
        self.rt.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def settings(self) -> Settings:
        return self.rt.settings

    def create_task(self, spec: TaskSpec, *, name: str | None = None, quorum: int = 1,
                    round_timeout_s: float = 600.0, devices_per_round: int | None = None,
                    schedule: str = Schedule.MANUAL, max_rounds: int | None = None,
                    secret: str | None = None) -> str:
        """`secret`: simulations and tests only (`service.create_task`); None: random.
        `schedule`: manual by default (the caller opens rounds); `auto` lets a coordinator app
        serving the same runtime run them (`max_rounds`: its limit)."""
        task_id, _join, _v, _chk = service.create_task(
            self.rt, spec=spec, name=name, quorum=quorum, round_timeout_s=round_timeout_s,
            devices_per_round=devices_per_round, schedule=schedule, max_rounds=max_rounds,
            secret=secret)
        return task_id

    def create_task_with_token(self, spec: TaskSpec, **kwargs: object) -> tuple[str, str]:
        """Like `create_task`, also returning the join token devices enroll with over HTTP."""
        kwargs.setdefault("schedule", Schedule.MANUAL)
        task_id, join, _v, _chk = service.create_task(self.rt, spec=spec, **kwargs)  # type: ignore[arg-type]
        return task_id, join

    def enroll(self, task_id: str) -> tuple[str, str]:
        return service.enroll_device(self.rt, task_id=task_id, join_token=None)

    def revoke(self, task_id: str, device_id: str) -> None:
        service.revoke_device(self.rt, task_id=task_id, device_id=device_id)

    def open_round(self, task_id: str) -> RoundPlan:
        return service.open_round(self.rt, task_id=task_id)

    def current_plan(self, task_id: str) -> RoundPlan | None:
        return service.current_plan(self.rt, task_id=task_id)

    def submit(self, task_id: str, device_id: str, upload: Upload,
               wire_bytes: int | None = None) -> UploadReceipt:
        """Accept a device's upload. `wire_bytes`: what it cost on the transport that brought
        it (the Flower strategy passes the reply's bytes); default its binary form's size, what
        a REST device sends."""
        if wire_bytes is None:
            wire_bytes = len(pack_binary(upload.matrix()))
        return service.submit_upload(self.rt, task_id=task_id, round_number=upload.round,
                                     device_id=device_id, upload=upload, wire_bytes=wire_bytes)

    def submit_many(self, task_id: str, uploads: Sequence[tuple[str, Upload, int | None]],
                    ) -> list[UploadReceipt | Exception]:
        """Accept a round's uploads, (device id, upload, wire bytes) each, in one transaction;
        per upload its receipt or the typed error that refused it (never raised)."""
        return service.submit_uploads(self.rt, task_id=task_id, uploads=[
            (d, u, len(pack_binary(u.matrix())) if w is None else w) for d, u, w in uploads])

    def close_round(self, task_id: str) -> LogEntryWire:
        return service.close_round(self.rt, task_id=task_id)

    def abandon_round(self, task_id: str, number: int, reason: str) -> AbandonedRound:
        """End round `number` without a new version (`service.abandon_round`)."""
        return service.abandon_round(self.rt, task_id=task_id, number=number, reason=reason)

    def set_schedule(self, task_id: str, schedule: str | None = None,
                     max_rounds: int | None = None, *, clear_limit: bool = False) -> None:
        """Who opens the task's rounds, and the automatic schedule's limit."""
        service.set_schedule(self.rt, task_id=task_id, schedule=schedule,
                             max_rounds=max_rounds, clear_limit=clear_limit)

    def record_metrics(self, task_id: str, device_id: str, round_number: int,
                       metrics: DeviceMetrics) -> MetricsReceipt:
        """Store a device's held-out scores for a round (a repeat replaces the earlier one)."""
        return service.record_device_metrics(self.rt, task_id=task_id,
                                             round_number=round_number, device_id=device_id,
                                             metrics=metrics)

    def device_metrics(self, task_id: str, round_number: int) -> list[DeviceMetricsRow]:
        with self.rt.transaction() as s:
            return service.device_metrics(s, task_id=task_id, round_number=round_number)

    def tick(self) -> list[LogEntryWire]:
        """Close rounds at quorum or past their deadline (expire those without uploads)."""
        return service.tick(self.rt)

    def log_since(self, task_id: str, version: int) -> list[LogEntryWire]:
        with self.rt.transaction() as s:
            return service.log_since(s, task_id=task_id, since=version)

    def snapshot(self, task_id: str, version: int, fmt: str | None = None) -> tuple[bytes, str]:
        """(safetensors bytes of the fp32 trainable state, or of the published `fmt`; the
        state checksum). The file maps scope tensor names to flat covered values."""
        return service.snapshot_bytes(self.rt, task_id=task_id, version=version, fmt=fmt)

    def catchup(self, task_id: str, from_version: int, **rates: float) -> CatchupPlan:
        with self.rt.transaction() as s:
            return service.catchup_plan(s, task_id=task_id, from_version=from_version, **rates)

    def task_spec(self, task_id: str) -> TaskSpec:
        """The task definition devices build their model from (sent to new Flower devices)."""
        with self.rt.transaction() as s:
            return service.task_spec(s, task_id=task_id)

    def task_status(self, task_id: str) -> TaskStatus:
        with self.rt.transaction() as s:
            return service.task_status(self.rt, s, task_id=task_id)

    def round_metrics(self, task_id: str) -> list[RoundMetrics]:
        with self.rt.transaction() as s:
            return service.round_metrics(s, task_id=task_id)

    def stats(self, task_id: str) -> TaskStats:
        with self.rt.transaction() as s:
            return service.task_stats(s, task_id=task_id, delta=self.settings.dp_delta)
