"""Plain-HTTP devices on a ternary (TerMeZO) task against the real coordinator app.

A tiny Llama converted to BitLinear, mask epochs every 2 versions: the devices hold the packed
model, download the published ternary snapshot (`?format=ternary`) at join time and at each
epoch start, replay the log inside an epoch, and rebuild the packed model from their state
directory after a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from seedfed.client.backends.torch import TorchBackend
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import TERNARY_SNAPSHOT_FILE, DeviceConfig, HttpDevice
from seedfed.client.ternary import PackedTernary
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.ternary import bitlinear_modules

from tests.fleet_helpers import replay_when_allowed, ternary_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EPOCH_ROUNDS = 2

def _packed(d: HttpDevice) -> PackedTernary | None:
    """The device's packed ternary model, once it built its device."""
    backend = None if d.device is None else d.device.backend
    return backend.packed if isinstance(backend, TorchBackend) else None



@pytest.fixture
def world(tiny_llama: Path, fleet_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[dict]:
    _, data = fleet_assets
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    task_id, join = coord.create_task_with_token(ternary_spec(tiny_llama, EPOCH_ROUNDS), quorum=50)
    requests: list[httpx.Request] = []
    with TestClient(create_app(runtime=coord.rt)) as client:
        client.event_hooks["request"].append(requests.append)

        def device(i: int, token: str | None = join) -> HttpDevice:
            cfg = DeviceConfig(url="http://testserver", task_id=task_id, join_token=token,
                               state_dir=tmp_path / f"dev{i}", model=str(tiny_llama),
                               data=DeviceData(source=str(data), partition_id=i,
                                               num_partitions=2, alpha=1.0))
            return replay_when_allowed(HttpDevice(cfg, client=client))

        yield {"coord": coord, "task": task_id, "device": device, "requests": requests}
    coord.close()


def _snapshot_downloads(requests: list[httpx.Request]) -> list[str]:
    """`<version>?<query>` of each snapshot request."""
    return [f"{r.url.path.rsplit('/', 1)[-1]}?{r.url.query.decode()}" for r in requests
            if "/snapshots/" in r.url.path]


def test_two_devices_follow_four_rounds_across_two_mask_epoch_starts(world: dict) -> None:
    coord, task, requests = world["coord"], world["task"], world["requests"]
    devices = [world["device"](0), world["device"](1)]
    for d in devices:
        d.enroll()
    trained, synced, downloads = [], [], []

    for r in range(1, 5):
        plan = coord.open_round(task)
        assert plan.mask_epoch == plan.version // EPOCH_ROUNDS
        trained.append([d.train_and_upload(plan).sync for d in devices])
        entry = coord.close_round(task)
        requests.clear()
        results = [d.sync() for d in devices]
        downloads.append(_snapshot_downloads(requests))
        status = coord.task_status(task)
        # Assert (per round): every device stands at the coordinator's new version
        assert status.version == r and entry.checksum == status.checksum
        assert [(x.version, x.checksum) for x in results] == [(r, status.checksum)] * 2
        assert all(_packed(d) is not None and _packed(d).scope is not None
                   and checksum(_packed(d).scope) == status.checksum for d in devices)
        synced.append([x.method for x in results])

    # new devices load v0's snapshot; afterwards they are current when each round opens
    assert trained == [["snapshot"] * 2] + [["none"] * 2] * 3
    # replay inside a mask epoch, the published ternary snapshot at each epoch start (v2, v4)
    assert synced == [["replay"] * 2, ["snapshot"] * 2, ["replay"] * 2, ["snapshot"] * 2]
    assert downloads == [[], ["2?format=ternary"] * 2, [], ["4?format=ternary"] * 2]
    assert [m.participants for m in coord.round_metrics(task)] == [2, 2, 2, 2]
    for d in devices:
        t = _packed(d)
        assert t is not None and t.scope is not None
        layers = bitlinear_modules(t.model)
        assert all(m.weight is None and m.packed is not None for _, m in layers), "packed"
        total = sum(m.in_features * m.out_features for _, m in layers)
        assert 0 < t.scope.numel <= 0.06 * total  # z covers the masked latents only
        assert d.meta["snapshot_version"] == 4 and d.meta["version"] == 4


def test_a_restarted_device_rebuilds_its_packed_model_without_a_download(world: dict) -> None:
    coord, task, requests = world["coord"], world["task"], world["requests"]
    d = world["device"](0)
    d.enroll()
    for _ in range(3):  # v3: epoch 1, stored snapshot of v2 plus the latents of v3
        plan = coord.open_round(task)
        d.train_and_upload(plan)
        coord.close_round(task)
    d.sync()
    assert (d.meta["snapshot_version"], d.version) == (2, 3)
    requests.clear()

    again = world["device"](0, token=None)
    restored = again.sync()
    plan = coord.open_round(task)
    outcome = again.train_and_upload(plan)
    coord.close_round(task)
    crossed = again.sync()

    status = coord.task_status(task)
    assert restored.method == "none" and restored.version == 3
    assert outcome.sync == "none" and outcome.version == 3
    assert _snapshot_downloads(requests) == ["4?format=ternary"]  # only the epoch start
    assert (crossed.method, crossed.version, crossed.checksum) == ("snapshot", 4,
                                                                   status.checksum)


def test_a_corrupt_stored_snapshot_means_a_fresh_download(world: dict) -> None:
    coord, task = world["coord"], world["task"]
    d = world["device"](0)
    d.enroll()
    plan = coord.open_round(task)
    d.train_and_upload(plan)
    coord.close_round(task)
    d.sync()
    path = d.state_dir / TERNARY_SNAPSHOT_FILE
    path.write_bytes(path.read_bytes()[:-64])  # truncated

    result = world["device"](0, token=None).sync()

    assert result.method == "snapshot"
    assert result.checksum == coord.task_status(task).checksum
