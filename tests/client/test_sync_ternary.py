"""The ternary device's sync decision: replay inside a mask epoch, the snapshot otherwise."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from seedfed.client.sync import catch_up_ternary
from seedfed.shared.model.replay import LogEntry, apply_seeds, checksum
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.model.ternary import (
    MaskConfig,
    TernaryScope,
    bitlinear_modules,
    load_published_ternary,
    publish_ternary,
)
from torch import nn

TASK = "tern"
OPTIONS = {"fraction": 0.25, "epoch_rounds": 2}


def _base() -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 12, bias=False), nn.Linear(12, 8, bias=False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _coordinator() -> TernaryScope:
    scope = build_scope("ternary", _base(), **OPTIONS)
    assert isinstance(scope, TernaryScope)
    return scope


def _packed_device(coord: TernaryScope) -> tuple[nn.Module, TernaryScope]:
    model = _coordinator().model
    for _, m in bitlinear_modules(model):
        m.to_packed(keep_latents=False)
    scope = load_published_ternary(model, publish_ternary(coord.read(), coord),
                                   config=coord.config, epoch=0)
    return model, scope


def _commit(coord: TernaryScope, version: int) -> LogEntry:
    """The coordinator's close of `version`: apply an entry, start an epoch if due."""
    seeds, coefs = (3 * version, 3 * version + 1), (0.01, -0.01)
    apply_seeds(coord, seeds, coefs)
    coord.enter_version(version)
    return LogEntry(TASK, version - 1, seeds, coefs, checksum(coord), mask_epoch=coord.epoch)


class Snapshots:
    """The coordinator's published snapshot of its current version, counting downloads."""

    def __init__(self, coord: TernaryScope) -> None:
        self.coord, self.fetched = coord, 0

    def __call__(self) -> tuple[Mapping[str, torch.Tensor], str]:
        self.fetched += 1
        return publish_ternary(self.coord.read(), self.coord), checksum(self.coord)


def test_replays_inside_an_epoch_and_loads_the_snapshot_across_one() -> None:
    # Arrange
    coord = _coordinator()
    model, scope = _packed_device(coord)
    snapshots = Snapshots(coord)
    # Act: v0 -> v1 (same epoch), then v1 -> v2 (epoch 1 starts at v2)
    e1 = _commit(coord, 1)
    scope1, r1 = catch_up_ternary(model, scope, task_id=TASK, version=0, target=1,
                                  config=coord.config,
                                  entries=[e1], snapshot=snapshots)
    e2 = _commit(coord, 2)
    scope2, r2 = catch_up_ternary(model, scope1, task_id=TASK, version=1, target=2,
                                  config=coord.config,
                                  entries=[e2], snapshot=snapshots)
    # Assert
    assert (r1.method, r2.method, snapshots.fetched) == ("replay", "snapshot", 1)
    assert scope1 is scope and scope2 is not scope1 and scope2.epoch == 1
    assert checksum(scope2) == checksum(coord) == r2.checksum


def test_diverged_device_falls_back_to_the_snapshot() -> None:
    coord = _coordinator()
    model, scope = _packed_device(coord)
    next(iter(scope)).tensor.data[0] += 1.0  # the device's state no longer matches v0
    e1 = _commit(coord, 1)
    snapshots = Snapshots(coord)

    fresh, result = catch_up_ternary(model, scope, task_id=TASK, version=0, target=1,
                                     config=coord.config,
                                     entries=[e1], snapshot=snapshots)

    assert result.method == "snapshot" and snapshots.fetched == 1
    assert checksum(fresh) == checksum(coord)


def test_an_entry_announcing_another_epoch_is_not_replayed() -> None:
    # The device's config says no epoch starts before v10, but the log says v2 started one:
    # the log wins. The entries carry no checksums here, so only that rule stops a replay.
    coord = _coordinator()
    model, scope = _packed_device(coord)
    entries = [replace(_commit(coord, v), checksum=None) for v in (1, 2)]
    snapshots = Snapshots(coord)

    fresh, result = catch_up_ternary(model, scope, task_id=TASK, version=0, target=2,
                                     config=MaskConfig(fraction=0.25, epoch_rounds=10),
                                     entries=entries, snapshot=snapshots)

    assert result.method == "snapshot" and checksum(fresh) == checksum(coord)
