"""Mask epochs on the coordinator's scope, its master state, and the device's snapshot loader."""

from __future__ import annotations

import pytest
import torch
from seedfed.shared.model.replay import apply_seeds, checksum, state_checksum
from seedfed.shared.model.scopes import build_scope, scope_epoch
from seedfed.shared.model.ternary import (
    EPOCH_KEY,
    MaskConfig,
    TernaryChecksumError,
    TernaryFormatError,
    TernaryScope,
    bitlinear_modules,
    crosses_epoch,
    load_published_ternary,
    mask_config,
    publish_ternary,
    ternary_snapshot,
)
from seedfed.shared.protocol.errors import MissingTensorError

from tests.shared.model.ternary.conftest import tiny_llama

OPTIONS = {"fraction": 0.05, "epoch_rounds": 2}


def _coordinator(**over: object) -> TernaryScope:
    scope = build_scope("ternary", tiny_llama(), **{**OPTIONS, **over})
    assert isinstance(scope, TernaryScope)
    return scope


def _packed_device() -> torch.nn.Module:
    """The task's model on a device: converted from the same base, then packed (no latents)."""
    model = _coordinator().model
    for _, m in bitlinear_modules(model):
        m.to_packed(keep_latents=False)
    return model


def _step(scope: TernaryScope, k: int) -> None:
    apply_seeds(scope, [k, k + 1, k + 2], [0.01, -0.01, 0.01])


def _masks(scope: TernaryScope) -> list[torch.Tensor]:
    return [t.indices.clone() for t in scope if t.indices is not None]


def test_scope_epoch_schedule_needs_no_model() -> None:
    assert [scope_epoch("ternary", OPTIONS, v) for v in range(6)] == [0, 0, 1, 1, 2, 2]
    assert scope_epoch("full", {}, 7) is None
    assert mask_config({"act_bits": 8, "fraction": 0.1}) == MaskConfig(fraction=0.1)
    assert crosses_epoch(MaskConfig(epoch_rounds=2), 1, 2)
    assert not crosses_epoch(MaskConfig(epoch_rounds=2), 2, 3)


def test_enter_version_starts_an_epoch_only_at_multiples_of_epoch_rounds() -> None:
    # Arrange
    scope = _coordinator()
    _step(scope, 1)
    masks_v0 = _masks(scope)
    # Act
    started = [scope.enter_version(v) for v in (1, 2, 3)]
    # Assert: v2 started epoch 1 in place, the scope covers the new masks
    assert started == [False, True, False]
    assert scope.epoch == 1
    assert any(not torch.equal(a, b) for a, b in zip(masks_v0, _masks(scope), strict=True))
    for t, (_, m) in zip(scope, bitlinear_modules(scope.model), strict=True):
        assert t.indices is m.mask and m.mask_epoch == 1


def test_master_state_restores_latents_gamma_masks_and_epoch_exactly() -> None:
    # Arrange: a coordinator two epochs on
    coord = _coordinator()
    for v in (1, 2, 3, 4):
        _step(coord, v)
        coord.enter_version(v)
    state = {k: v.clone() for k, v in coord.master_state().items()}
    # Act: a restart rebuilds the task's model (epoch-0 masks) and loads the master state
    fresh = _coordinator()
    fresh.load_master_state(state)
    # Assert
    assert fresh.epoch == 2 and int(state[EPOCH_KEY]) == 2
    assert checksum(fresh) == checksum(coord)
    for (_, a), (_, b) in zip(bitlinear_modules(coord.model), bitlinear_modules(fresh.model),
                              strict=True):
        assert a.weight is not None and b.weight is not None
        assert torch.equal(a.weight, b.weight) and torch.equal(a.gamma, b.gamma)
        assert a.mask is not None and b.mask is not None and torch.equal(a.mask, b.mask)
        assert b.mask_epoch == 2


def test_master_state_of_a_full_latent_scope_has_no_masks() -> None:
    coord = _coordinator(selection="full")
    state = coord.master_state()
    assert not any(k.endswith(".mask") for k in state)
    fresh = _coordinator(selection="full")
    fresh.load_master_state(state)
    assert checksum(fresh) == checksum(coord)


@pytest.mark.parametrize("damage", ["missing", "extra", "short", "mask_order"])
def test_bad_master_state_is_refused_before_any_layer_changes(damage: str) -> None:
    coord = _coordinator()
    state = {k: v.clone() for k, v in coord.master_state().items()}
    name = next(k for k in state if k.endswith(".mask"))
    if damage == "missing":
        del state[name.replace(".mask", ".gamma")]
    elif damage == "extra":
        state["not.a.layer.weight"] = torch.zeros(3)
    elif damage == "short":
        w = name.replace(".mask", ".weight")
        state[w] = state[w].reshape(-1)[:-1]
    else:
        state[name] = state[name].flip(0)
    target = _coordinator()
    _step(target, 9)
    before = checksum(target)
    with pytest.raises(MissingTensorError):
        target.load_master_state(state)
    assert checksum(target) == before


def test_old_master_file_without_epoch_loads_as_epoch_zero_values() -> None:
    coord = _coordinator()
    _step(coord, 3)
    fresh = _coordinator()
    fresh.load_master_state(coord.read())  # the pre-epoch layout: masked values only
    assert checksum(fresh) == checksum(coord) and fresh.epoch == 0


def test_packed_device_loads_the_published_snapshot_of_a_later_epoch() -> None:
    # Arrange: the coordinator in epoch 1, a fresh packed device
    coord = _coordinator()
    _step(coord, 1)
    coord.enter_version(2)
    published = publish_ternary(coord.read(), coord)
    device = _packed_device()
    # Act
    scope = load_published_ternary(device, published, config=coord.config, epoch=1,
                                   expected_checksum=checksum(coord))
    # Assert: compact masked latents, same checksum, same ternary weights
    assert scope.epoch == 1 and all(t.compact for t in scope)
    assert all(m.weight is None for _, m in bitlinear_modules(device))
    assert checksum(scope) == checksum(coord)
    assert state_checksum(coord.read()) == checksum(coord)
    snap_c, snap_d = ternary_snapshot(coord.model), ternary_snapshot(device)
    assert all(torch.equal(snap_c[k], snap_d[k]) for k in snap_c)


def test_device_refuses_a_snapshot_of_another_version_and_keeps_its_model() -> None:
    coord = _coordinator()
    published = publish_ternary(coord.read(), coord)
    device = _packed_device()
    scope = load_published_ternary(device, published, config=coord.config, epoch=0)
    before = checksum(scope)
    _step(coord, 5)  # the version moved on: the old snapshot's latents hash differently
    with pytest.raises(TernaryChecksumError):
        load_published_ternary(device, published, config=coord.config, epoch=0,
                               expected_checksum=checksum(coord))
    assert checksum(scope) == before
    assert all(mod is m for (_, mod), (_, m) in zip(bitlinear_modules(scope.model),
                                                     bitlinear_modules(device), strict=True))


def test_device_refuses_a_snapshot_with_foreign_tensors_or_no_latents() -> None:
    coord = _coordinator()
    published = publish_ternary(coord.read(), coord)
    device = _packed_device()
    with pytest.raises(TernaryFormatError, match="belong to no BitLinear"):
        load_published_ternary(device, {**published, "lm_head.packed": torch.zeros(1)},
                               config=coord.config, epoch=0)
    inference_only = {k: v for k, v in published.items()
                      if not k.endswith((".mask", ".latent"))}
    with pytest.raises(TernaryFormatError, match="no latents"):
        load_published_ternary(device, inference_only, config=coord.config, epoch=0)
