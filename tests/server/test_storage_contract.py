"""The storage contract: the same suite on SQLite (file) and PostgreSQL.

Round lifecycle, one upload per device and round, atomic version commits, crash recovery and
replay from version 0, through the in-process facade (the REST routes call the same services).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from seedfed.server.coordinator import Coordinator
from seedfed.server.db import make_engine
from seedfed.server.errors import (
    ConflictError,
    DuplicateUploadError,
    EmptyRoundError,
    RoundClosedError,
    StaleVersionError,
)
from seedfed.server.orm import Base, RoundRow, RoundState, UploadRow, VersionRow
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload
from sqlalchemy import func, select

from tests.server.conftest import make_settings

Factory = Callable[[], Coordinator]


@pytest.fixture
def open_coord(database_url: str, tmp_path: Path) -> Iterator[Factory]:
    """Opens coordinators on one database and store (a second one = a restart)."""
    opened: list[Coordinator] = []

    def factory() -> Coordinator:
        c = Coordinator.open(make_settings(database_url, tmp_path / "store"))
        opened.append(c)
        return c

    yield factory
    for c in opened:
        c.close()


def scalars(plan: RoundPlan, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(plan.steps, plan.perturbations)).astype(np.float32)


def run_round(c: Coordinator, task_id: str, devices: list[tuple[str, str]], seed: int):
    plan = c.open_round(task_id)
    for i, (dev, _tok) in enumerate(devices):
        c.submit(task_id, dev, Upload.build(plan, scalars(plan, seed + i), 4 + i, 0.5 + i))
    return c.close_round(task_id)


def test_migrations_match_the_orm(open_coord: Factory) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    c = open_coord()
    with c.rt.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)

    assert diff == []


def test_round_lifecycle_commits_version_log_and_files(open_coord: Factory,
                                                       spec: TaskSpec) -> None:
    c = open_coord()
    task_id = c.create_task(spec, quorum=2)
    devices = [c.enroll(task_id) for _ in range(3)]

    plan = c.open_round(task_id)
    assert c.open_round(task_id) == plan  # opening again returns the open round
    assert c.task_status(task_id).state == "open"
    for i, (dev, _) in enumerate(devices):
        c.submit(task_id, dev, Upload.build(plan, scalars(plan, i), 10, 0.25 * i))
    entry = c.close_round(task_id)

    status = c.task_status(task_id)
    assert (status.version, status.state, status.checksum) == (1, "idle", entry.checksum)
    assert entry.seeds == plan.flat_seeds and entry.base_version == 0
    assert c.log_since(task_id, 0) == [entry]
    data, chk = c.snapshot(task_id, 1)
    assert chk == entry.checksum
    assert set(st_load(data)) == {t.name for t in c.rt.cached_master(task_id).bundle.scope}
    (metrics,) = c.round_metrics(task_id)
    assert (metrics.round, metrics.version, metrics.participants) == (1, 1, 3)
    assert metrics.loss == pytest.approx(0.25)
    assert metrics.upload_bytes > 0 and metrics.fedavg_bytes > metrics.upload_bytes
    assert c.current_plan(task_id) is None


def test_one_upload_per_device_and_round(open_coord: Factory, spec: TaskSpec) -> None:
    c = open_coord()
    task_id = c.create_task(spec)
    dev, _ = c.enroll(task_id)
    plan = c.open_round(task_id)
    up = Upload.build(plan, scalars(plan, 0), 8, 0.5)

    first = c.submit(task_id, dev, up)
    again = c.submit(task_id, dev, up)
    with pytest.raises(DuplicateUploadError, match="already uploaded different scalars"):
        c.submit(task_id, dev, Upload.build(plan, scalars(plan, 1), 8, 0.5))

    assert again == first
    with c.rt.transaction() as s:
        assert s.scalar(select(func.count()).select_from(UploadRow)) == 1


def test_closed_round_and_stale_version_are_refused(open_coord: Factory, spec: TaskSpec) -> None:
    c = open_coord()
    task_id = c.create_task(spec)
    (dev, _), (dev2, _) = c.enroll(task_id), c.enroll(task_id)
    plan1 = c.open_round(task_id)
    c.submit(task_id, dev, Upload.build(plan1, scalars(plan1, 0), 8, 0.5))
    c.close_round(task_id)
    plan2 = c.open_round(task_id)

    with pytest.raises(RoundClosedError, match="round 1 .* is closed"):
        c.submit(task_id, dev2, Upload.build(plan1, scalars(plan1, 1), 8, 0.5))
    stale = Upload.build(plan2, scalars(plan2, 2), 8, 0.5).model_copy(update={"version": 0})
    with pytest.raises(StaleVersionError, match="computed at version 0.*at version 1"):
        c.submit(task_id, dev2, stale)
    with pytest.raises(EmptyRoundError, match="no uploads"):
        c.close_round(task_id)
    assert c.task_status(task_id).version == 1


def test_replay_from_version_zero_rebuilds_every_version_bit_for_bit(
        open_coord: Factory, spec: TaskSpec) -> None:
    c = open_coord()
    task_id = c.create_task(spec)
    devices = [c.enroll(task_id) for _ in range(2)]
    entries = [run_round(c, task_id, devices, seed=10 * r) for r in range(3)]
    device = build_model(spec, initialize=False)
    data0, chk0 = c.snapshot(task_id, 0)
    device.scope.write(st_load(data0))
    assert checksum(device.scope) == chk0

    for v in range(1, 4):
        replay(device.scope, [entries[v - 1].to_entry()], task_id=task_id, version=v - 1)
        stored = st_load(c.snapshot(task_id, v)[0])
        mine = device.scope.read()
        assert all(torch.equal(mine[k].view(torch.int32), stored[k].view(torch.int32))
                   for k in stored)
    assert checksum(device.scope) == c.task_status(task_id).checksum


def test_restart_keeps_state_and_the_open_round(open_coord: Factory, spec: TaskSpec) -> None:
    c = open_coord()
    task_id = c.create_task(spec)
    devices = [c.enroll(task_id) for _ in range(2)]
    run_round(c, task_id, devices, seed=0)
    plan = c.open_round(task_id)
    c.submit(task_id, devices[0][0], Upload.build(plan, scalars(plan, 5), 8, 0.5))
    c.close()

    c2 = open_coord()
    assert c2.current_plan(task_id) == plan
    c2.submit(task_id, devices[1][0], Upload.build(plan, scalars(plan, 6), 8, 0.5))
    entry = c2.close_round(task_id)

    assert entry.base_version == 1
    assert c2.round_metrics(task_id)[-1].participants == 2


class Crash(Exception):
    pass


def _crash(*_args: object) -> None:
    raise Crash("simulated crash")


@pytest.mark.parametrize("point", ["after_files", "mid_aggregation"])
def test_crash_during_close_recovers_the_same_version(open_coord: Factory, spec: TaskSpec,
                                                      tmp_path: Path, point: str) -> None:
    # Reference: the same task and uploads closed without a crash, in a separate database.
    c = open_coord()
    task_id = c.create_task(spec)
    devices = [c.enroll(task_id) for _ in range(2)]
    plan = c.open_round(task_id)
    for i, (dev, _) in enumerate(devices):
        c.submit(task_id, dev, Upload.build(plan, scalars(plan, i), 8, 0.5))
    setattr(c.rt.faults, point, _crash)

    with pytest.raises(Crash):
        c.close_round(task_id)
    with c.rt.transaction() as s:  # nothing committed: the round waits, the version did not move
        assert s.scalar(select(RoundRow.state)) == RoundState.AGGREGATING
        assert s.scalar(select(func.count()).select_from(VersionRow)) == 1
    assert c.task_status(task_id).version == 0
    c.close()

    c2 = open_coord()  # restart: recovery finishes the round from the stored rows
    status = c2.task_status(task_id)
    entry = c2.log_since(task_id, 0)[0]
    device = build_model(spec, initialize=False)
    device.scope.write(st_load(c2.snapshot(task_id, 0)[0]))
    replay(device.scope, [entry.to_entry()], task_id=task_id, version=0)

    assert (status.version, status.state) == (1, "idle")
    assert checksum(device.scope) == entry.checksum == status.checksum
    assert c2.round_metrics(task_id)[0].participants == 2


def test_recovery_recomputes_the_entry_the_crashed_close_wrote(open_coord: Factory,
                                                               spec: TaskSpec) -> None:
    import json

    from safetensors import safe_open

    c = open_coord()
    task_id = c.create_task(spec, quorum=1)
    devices = [c.enroll(task_id) for _ in range(3)]
    plan = c.open_round(task_id)
    for i, (dev, _) in enumerate(devices):
        c.submit(task_id, dev, Upload.build(plan, scalars(plan, 7 + i), 3 + i, 0.5))
    c.rt.faults.after_files = _crash
    with pytest.raises(Crash):
        c.close_round(task_id)
    orphan = c.rt.store.root / f"tasks/{task_id}/master/v00000001.safetensors"
    with safe_open(str(orphan), "pt") as f:
        crashed_checksum = json.loads(json.dumps(f.metadata()))["checksum"]
    c.close()

    c2 = open_coord()
    (entry,) = c2.log_since(task_id, 0)

    assert entry.checksum == crashed_checksum
    with pytest.raises(ConflictError, match="no open round"):
        c2.close_round(task_id)


def test_sqlite_engine_uses_wal(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.connect() as conn:
        mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
    engine.dispose()
    assert mode == "wal"


def test_migrations_downgrade_and_upgrade_again(database_url: str) -> None:
    from seedfed.server.db import downgrade, upgrade
    from sqlalchemy import inspect

    engine = make_engine(database_url)
    try:
        upgrade(engine)
        downgrade(engine, "base")
        empty = set(inspect(engine).get_table_names()) - {"alembic_version"}
        upgrade(engine)
        full = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()

    assert empty == set()
    assert full >= {"tasks", "devices", "rounds", "uploads", "versions"}
