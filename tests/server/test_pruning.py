"""Model store pruning (`Settings.keep_versions`): version 0, the current version and the ones
just before it keep their files; older ones are deleted after the commit that makes them
unneeded, their reads are a 404 that names the pruning, and the log still rebuilds everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError
from safetensors.torch import load as st_load
from seedfed.server import service
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.errors import NotFoundError, StoreError
from seedfed.server.settings import Settings
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.model.ternary import TernaryScope
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import Upload
from typer.testing import CliRunner

from tests.server.conftest import make_settings, tiny_spec
from tests.server.test_api import ADMIN
from tests.server.test_storage_contract import Crash, _crash, run_round
from tests.server.test_ternary_task import (
    EPOCH_ROUNDS,
    MasterView,
    master_scope,
    packed_device,
    play_round,
    ternary_spec,
)

ROUNDS = 5


def store_versions(store: Path, task_id: str) -> dict[str, list[int]]:
    """Versions with a file in each of the task's store directories (temporary files too)."""
    out: dict[str, list[int]] = {}
    for sub in ("master", "published"):
        folder = store / "tasks" / task_id / sub
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        out[sub] = sorted({int(n.lstrip(".").split(".")[0][1:]) for n in names})
    return out


def run_rounds(c: Coordinator, task_id: str, n: int, first_seed: int = 0) -> None:
    devices = [c.enroll(task_id) for _ in range(2)]
    for r in range(n):
        run_round(c, task_id, devices, seed=first_seed + 10 * r)


# --- a LoRA task with an fp16 published format (both store directories) ---------------------
@pytest.fixture
def pruned(tmp_path: Path, tiny_bert: Path, one_torch_thread: None,
           ) -> tuple[Settings, TaskSpec, str]:
    """Five rounds with keep_versions=2 on SQLite; the coordinator closed afterwards."""
    spec = tiny_spec(tiny_bert, format="fp16")
    settings = make_settings(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "store",
                             keep_versions=2)
    with Coordinator.open(settings) as c:
        task_id = c.create_task(spec)
        run_rounds(c, task_id, ROUNDS)
        assert c.task_status(task_id).version == ROUNDS
    return settings, spec, task_id


def test_store_holds_version_zero_and_the_last_keep_versions(
        pruned: tuple[Settings, TaskSpec, str]) -> None:
    settings, _spec, task_id = pruned

    assert store_versions(settings.store_dir, task_id) == {"master": [0, 4, 5],
                                                           "published": [0, 4, 5]}


def test_pruned_snapshot_is_a_404_naming_the_pruning_over_the_api(
        pruned: tuple[Settings, TaskSpec, str]) -> None:
    settings, _spec, task_id = pruned
    with TestClient(create_app(settings)) as client:
        url = f"/v1/tasks/{task_id}/snapshots"
        gone = client.get(f"{url}/2", headers=ADMIN)
        gone_fp16 = client.get(f"{url}/2", params={"format": "fp16"}, headers=ADMIN)
        kept = {v: client.get(f"{url}/{v}", headers=ADMIN) for v in (0, 4, 5)}
        kept_fp16 = client.get(f"{url}/4", params={"format": "fp16"}, headers=ADMIN)
        unknown = client.get(f"{url}/9", headers=ADMIN)

    for r in (gone, gone_fp16):
        assert r.status_code == 404, r.text
        detail = r.json()["detail"]
        assert r.json()["error"] == "NotFoundError"
        assert "v2" in detail and "pruned" in detail and "keep_versions=2" in detail
        assert "download version 5" in detail and "replay the log" in detail
    assert all(r.status_code == 200 for r in kept.values())
    assert kept_fp16.status_code == 200 and kept_fp16.headers["x-seedfed-format"] == "fp16"
    assert unknown.status_code == 404 and "no version 9" in unknown.json()["detail"]


def test_pruned_snapshot_through_the_facade_is_a_not_found_error(
        pruned: tuple[Settings, TaskSpec, str]) -> None:
    settings, _spec, task_id = pruned
    with Coordinator.open(settings) as c:
        for fmt in (None, "fp16"):
            with pytest.raises(NotFoundError, match=r"v3: its snapshot was pruned .*"
                                                    r"keep_versions=2.*download version 5"):
                c.snapshot(task_id, 3, fmt)
        # The log is never pruned, and the catch-up plan only ever offers the current version.
        assert [e.base_version for e in c.log_since(task_id, 0)] == list(range(ROUNDS))
        plan = c.catchup(task_id, 1, bandwidth=1e12, regen_rate=1.0)
        assert (plan.action, plan.to_version) == ("download", ROUNDS)
        assert plan.download_bytes == len(c.snapshot(task_id, plan.to_version, "fp16")[0])


def test_rebuild_from_version_zero_and_the_log_reproduces_the_current_version(
        pruned: tuple[Settings, TaskSpec, str]) -> None:
    settings, spec, task_id = pruned
    with Coordinator.open(settings) as c:
        data0, chk0 = c.snapshot(task_id, 0)
        log = [e.to_entry() for e in c.log_since(task_id, 0)]
        status = c.task_status(task_id)
        data5, chk5 = c.snapshot(task_id, ROUNDS)
    device = build_model(spec, initialize=False)
    device.scope.write(st_load(data0))
    assert checksum(device.scope) == chk0

    replay(device.scope, log, task_id=task_id, version=0)

    assert checksum(device.scope) == status.checksum == chk5 == log[-1].checksum
    stored, mine = st_load(data5), device.scope.read()
    assert all(torch.equal(mine[k].view(torch.int32), stored[k].view(torch.int32))
               for k in stored)


def test_restarted_coordinator_loads_the_current_version_and_trains_on(
        pruned: tuple[Settings, TaskSpec, str]) -> None:
    settings, _spec, task_id = pruned
    with Coordinator.open(settings) as c:
        master = service.load_master(c.rt, task_id=task_id)
        assert master.version == ROUNDS
        assert checksum(master.bundle.scope) == c.task_status(task_id).checksum
        run_rounds(c, task_id, 1, first_seed=99)
        assert c.task_status(task_id).version == ROUNDS + 1

    assert store_versions(settings.store_dir, task_id)["master"] == [0, 5, 6]


def test_keep_versions_zero_keeps_every_version(tmp_path: Path, tiny_bert: Path,
                                                one_torch_thread: None) -> None:
    settings = make_settings(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "store",
                             keep_versions=0)
    with Coordinator.open(settings) as c:
        task_id = c.create_task(tiny_spec(tiny_bert, format="fp16"))
        run_rounds(c, task_id, ROUNDS)
        checksums = [c.snapshot(task_id, v, "fp16")[1] for v in range(ROUNDS + 1)]
        log = c.log_since(task_id, 0)

    every = list(range(ROUNDS + 1))
    assert store_versions(settings.store_dir, task_id) == {"master": every, "published": every}
    assert checksums[1:] == [e.checksum for e in log]


def test_a_later_prune_sweeps_leftovers_and_never_touches_newer_files(
        tmp_path: Path, tiny_bert: Path, one_torch_thread: None) -> None:
    # Arrange: three versions kept by keep_versions=0, then leftovers a crash could leave:
    # a temporary file of v1 and an orphan of v9 (a close interrupted before its commit).
    store = tmp_path / "store"
    url = f"sqlite:///{tmp_path / 'c.db'}"
    with Coordinator.open(make_settings(url, store, keep_versions=0)) as c:
        task_id = c.create_task(tiny_spec(tiny_bert))
        run_rounds(c, task_id, 3)
    master_dir = store / "tasks" / task_id / "master"
    (master_dir / ".v00000001.safetensors.123.tmp").write_bytes(b"partial")
    (master_dir / "v00000009.safetensors").write_bytes(b"orphan")
    # Act: a restart with keep_versions=1 commits v4, after which v1..v3 go
    with Coordinator.open(make_settings(url, store, keep_versions=1)) as c:
        run_rounds(c, task_id, 1, first_seed=50)
        with pytest.raises(NotFoundError, match="v2: its snapshot was pruned"):
            c.snapshot(task_id, 2)
    # Assert
    assert store_versions(store, task_id)["master"] == [0, 4, 9]
    assert not (master_dir / ".v00000001.safetensors.123.tmp").exists()
    # A larger keep_versions later does not bring files back: still a 404, saying why
    with Coordinator.open(make_settings(url, store, keep_versions=3)) as c, pytest.raises(
            NotFoundError, match="v2: its snapshot is no longer in the model store.*"
                                 "download version 4"):
        c.snapshot(task_id, 2)


def test_a_missing_file_of_a_version_the_store_must_hold_is_still_a_store_error(
        pruned: tuple[Settings, TaskSpec, str]) -> None:
    settings, _spec, task_id = pruned
    (settings.store_dir / "tasks" / task_id / "master" / "v00000000.safetensors").unlink()
    with Coordinator.open(settings) as c, pytest.raises(StoreError, match="missing"):
        c.snapshot(task_id, 0)


def test_crash_after_the_files_recovers_with_pruning_on(tmp_path: Path, tiny_bert: Path,
                                                        one_torch_thread: None) -> None:
    # Arrange: keep_versions=1 keeps only v0 and the current version's files
    settings = make_settings(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "store",
                             keep_versions=1)
    with Coordinator.open(settings) as c:
        task_id = c.create_task(tiny_spec(tiny_bert))
        devices = [c.enroll(task_id) for _ in range(2)]
        for r in range(2):
            run_round(c, task_id, devices, seed=r)
        assert store_versions(settings.store_dir, task_id)["master"] == [0, 2]
        plan = c.open_round(task_id)
        for i, (dev, _) in enumerate(devices):
            g = np.random.default_rng(i).normal(size=(plan.steps, plan.perturbations))
            c.submit(task_id, dev, Upload.build(plan, g, 8, 0.5))
        c.rt.faults.after_files = _crash
        # Act: v3's files are written, its commit never happens
        with pytest.raises(Crash):
            c.close_round(task_id)
        assert store_versions(settings.store_dir, task_id)["master"] == [0, 2, 3]
    with Coordinator.open(settings) as c:  # recover() reloads v2's master and commits v3
        status = c.task_status(task_id)
        log = [e.to_entry() for e in c.log_since(task_id, 0)]
        data0, _ = c.snapshot(task_id, 0)
    # Assert: v2 went only after v3's commit; v0 + the log still rebuild v3
    assert (status.version, status.state) == (3, "idle")
    assert store_versions(settings.store_dir, task_id)["master"] == [0, 3]
    device = build_model(tiny_spec(tiny_bert), initialize=False)
    device.scope.write(st_load(data0))
    replay(device.scope, log, task_id=task_id, version=0)
    assert checksum(device.scope) == status.checksum


# --- a ternary task (mask epochs every 2 versions) with keep_versions=2 ----------------------
@pytest.fixture(scope="module")
def ternary(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None,
            ) -> Iterator[tuple[Settings, TaskSpec, str, list[MasterView], list[str]]]:
    root = tmp_path_factory.mktemp("ternary-pruned")
    spec = ternary_spec(root)
    settings = make_settings(f"sqlite:///{root / 'c.db'}", root / "store", keep_versions=2)
    with Coordinator.open(settings) as coord:
        task_id = coord.create_task(spec, quorum=2)
        devices = [packed_device(spec, task_id, coord.enroll(task_id)[0], seed)
                   for seed in (1, 2)]
        masters = [MasterView.of(master_scope(coord, task_id))]
        for _ in range(ROUNDS):
            play_round(coord, task_id, devices)
            masters.append(MasterView.of(master_scope(coord, task_id)))
        finals = [d.sync(coord, task_id).checksum for d in devices]
    yield settings, spec, task_id, masters, finals


def test_ternary_task_with_pruning_keeps_v0_and_the_last_two(ternary: tuple) -> None:
    settings, _spec, task_id, masters, finals = ternary
    with Coordinator.open(settings) as coord:
        with pytest.raises(NotFoundError, match="pruned"):
            coord.snapshot(task_id, 2, "ternary")
        kept = [coord.snapshot(task_id, v, "ternary")[1] for v in (0, 4, 5)]

    assert store_versions(settings.store_dir, task_id) == {"master": [0, 4, 5],
                                                           "published": [0, 4, 5]}
    assert kept == [masters[v].checksum for v in (0, 4, 5)]
    assert finals == [masters[-1].checksum] * 2, "devices reached the current version"


def test_ternary_restart_and_rebuild_with_pruning(ternary: tuple) -> None:
    from seedfed.server.aggregation import apply_entry

    settings, spec, task_id, masters, _finals = ternary
    with Coordinator.open(settings) as coord:  # a restart loads v5's master, every latent
        view = MasterView.of(master_scope(coord, task_id))
        log = coord.log_since(task_id, 0)
    last = masters[-1]
    assert view.checksum == last.checksum and view.epoch == ROUNDS // EPOCH_ROUNDS
    assert all(torch.equal(view.latents[n], last.latents[n]) for n in last.latents)

    scope = build_model(spec, initialize=True).scope  # version 0, then the whole log
    assert isinstance(scope, TernaryScope)
    for wire in log:
        entry = wire.to_entry()
        apply_entry(scope, entry.seeds, entry.coefs)
        scope.enter_version(entry.version)
        assert checksum(scope) == entry.checksum == masters[entry.version].checksum
    assert checksum(scope) == last.checksum


# --- the setting ------------------------------------------------------------------------------
def test_keep_versions_setting_validates_and_reads_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().keep_versions == 20
    with pytest.raises(ValidationError, match=r"keep_versions must be >= 0 .*got -1"):
        Settings(keep_versions=-1)
    monkeypatch.setenv("SEEDFED_KEEP_VERSIONS", "3")
    assert Settings().keep_versions == 3


def test_coordinator_command_passes_keep_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    import seedfed.server.serve as serve_module

    from seedfed.cli import app

    seen: list[Settings] = []
    monkeypatch.setattr(serve_module, "serve", seen.append)
    runner = CliRunner()

    ok = runner.invoke(app, ["coordinator", "--keep-versions", "7"])
    bad = runner.invoke(app, ["coordinator", "--keep-versions", "-2"])

    assert ok.exit_code == 0, ok.output
    assert [s.keep_versions for s in seen] == [7]
    assert bad.exit_code != 0 and "got -2" in bad.output
