"""A ternary device's sync through `client.device.Device` (the torch backend's packed model):
replay inside a mask epoch, the published snapshot across an epoch start, after a divergence,
or when the log announces an epoch the device's config does not expect."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import save as save_safetensors
from seedfed.client.backends.torch import TorchBackend
from seedfed.client.device import Device
from seedfed.client.ternary import PackedTernary
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.ternary import TernaryScope, publish_ternary
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.task import TaskSpec

from tests.fleet_helpers import ternary_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TASK = "tern"


def _coordinator(spec: TaskSpec) -> TernaryScope:
    """Version 0 of the task's master, as the coordinator builds it (full latents)."""
    scope = build_model(spec, initialize=True).scope
    assert isinstance(scope, TernaryScope)
    return scope


def _commit(coord: TernaryScope, version: int) -> LogEntry:
    """The coordinator's close of `version`: apply an entry, start an epoch if due."""
    seeds, coefs = (3 * version, 3 * version + 1), (0.01, -0.01)
    apply_seeds(coord, seeds, coefs)
    coord.enter_version(version)
    return LogEntry(TASK, version - 1, seeds, coefs, checksum(coord), mask_epoch=coord.epoch)


class Snapshots:
    """The coordinator's published ternary snapshot of its current version (a device's
    `Fetch`), counting downloads."""

    def __init__(self, coord: TernaryScope) -> None:
        self.coord, self.fetched = coord, 0

    def __call__(self) -> tuple[bytes, str]:
        self.fetched += 1
        return save_safetensors(publish_ternary(self.coord.read(), self.coord)), \
            checksum(self.coord)


def _device(spec: TaskSpec, coord: TernaryScope) -> tuple[Device, PackedTernary]:
    """A packed device on the coordinator's v0 snapshot."""
    device = Device(spec, TASK)
    data, chk = Snapshots(coord)()
    device.load_snapshot(data, 0, chk, fmt="ternary")
    assert isinstance(device.backend, TorchBackend) and device.backend.packed is not None
    return device, device.backend.packed


def test_replays_inside_an_epoch_and_loads_the_snapshot_across_one(tiny_llama: Path) -> None:
    # Arrange
    spec = ternary_spec(tiny_llama, epoch_rounds=2)
    coord = _coordinator(spec)
    device, packed = _device(spec, coord)
    scope0 = packed.scope
    snapshots = Snapshots(coord)
    # Act: v0 -> v1 (same epoch), then v1 -> v2 (epoch 1 starts at v2)
    e1 = _commit(coord, 1)
    r1 = device.sync(1, entries=[e1], fetch=snapshots)
    scope1 = packed.scope
    e2 = _commit(coord, 2)
    r2 = device.sync(2, entries=[e2], fetch=snapshots)
    # Assert
    assert (r1.method, r2.method, snapshots.fetched) == ("replay", "snapshot", 1)
    assert r1.checksum == e1.checksum
    assert scope1 is scope0 and packed.scope is not scope1
    assert packed.scope is not None and packed.scope.epoch == 1
    assert checksum(packed.scope) == checksum(coord) == r2.checksum == device.checksum


def test_diverged_device_falls_back_to_the_snapshot(tiny_llama: Path) -> None:
    spec = ternary_spec(tiny_llama, epoch_rounds=2)
    coord = _coordinator(spec)
    device, packed = _device(spec, coord)
    assert packed.scope is not None
    next(iter(packed.scope)).tensor.data[0] += 1.0  # the device's state no longer matches v0
    e1 = _commit(coord, 1)
    snapshots = Snapshots(coord)

    result = device.sync(1, entries=[e1], fetch=snapshots)

    assert result.method == "snapshot" and snapshots.fetched == 1
    assert packed.scope is not None and checksum(packed.scope) == checksum(coord)


def test_an_entry_announcing_another_epoch_is_not_replayed(tiny_llama: Path) -> None:
    # The device's task says no epoch starts before v10, but the log says v2 started one:
    # the log wins. The entries carry no checksums here, so only that rule stops a replay.
    coord = _coordinator(ternary_spec(tiny_llama, epoch_rounds=2))
    device, packed = _device(ternary_spec(tiny_llama, epoch_rounds=10), coord)
    entries = [replace(_commit(coord, v), checksum=None) for v in (1, 2)]
    snapshots = Snapshots(coord)

    result = device.sync(2, entries=entries, fetch=snapshots)

    assert result.method == "snapshot" and snapshots.fetched == 1
    assert packed.scope is not None and checksum(packed.scope) == checksum(coord)
