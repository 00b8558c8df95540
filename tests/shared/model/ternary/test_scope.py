from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from seedfed.shared.model.estimator import ZOConfig, spsa_step
from seedfed.shared.model.perturb import Perturber
from seedfed.shared.model.replay import apply_seeds, checksum, replay
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.model.ternary import (
    MaskConfig,
    TernaryScope,
    absmean_gamma,
    bitlinear_modules,
    load_ternary_model,
    save_ternary_model,
    start_mask_epoch,
    ternarize,
    ternary_snapshot,
    threshold_mask,
    unpack_ternary,
)
from seedfed.shared.model.ternary.snapshot import layer_tensors
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.npzo import LogEntry

from tests.shared.model.ternary.conftest import tiny_llama


def _coordinator(fraction: float = 0.05, selection: str = "threshold") -> TernaryScope:
    scope = build_scope("ternary", tiny_llama(), fraction=fraction, selection=selection)
    assert isinstance(scope, TernaryScope)
    return scope


def _device(coord: TernaryScope, tmp_path: Path) -> TernaryScope:
    save_ternary_model(coord.model, tmp_path / "snap", mask_config=coord.config)
    scope = build_scope("ternary", load_ternary_model(tmp_path / "snap"))
    assert isinstance(scope, TernaryScope)
    return scope


def _entries(scope: TernaryScope, n: int) -> list[LogEntry]:
    """Log entries made on `scope` (the coordinator), each with its checksum."""
    rng = np.random.default_rng(11)
    out = []
    for v in range(n):
        seeds = tuple(int(s) for s in rng.integers(0, 2**63, size=4))
        coefs = tuple(float(np.float32(c)) for c in rng.normal(0, 2e-3, size=4))
        apply_seeds(scope, seeds, coefs)
        out.append(LogEntry("t", v, seeds, coefs, checksum(scope)))
    return out


def test_threshold_scope_covers_the_masked_latents_of_every_layer() -> None:
    scope = _coordinator(0.05)
    layers = bitlinear_modules(scope.model)
    assert scope.names == sorted(f"{n}.weight" for n, _ in layers)
    for t, (_, m) in zip(scope, layers, strict=True):
        assert m.weight is not None
        assert torch.equal(t.indices, threshold_mask(m.weight, m.gamma, 0.05))
        assert t.tensor is m.weight and not t.compact


def test_random_and_full_variants() -> None:
    rand = _coordinator(0.05, "random")
    full = _coordinator(0.05, "full")
    thr = _coordinator(0.05, "threshold")
    assert rand.numel == thr.numel
    assert [t.indices for t in full] == [None] * len(full)
    assert full.numel == sum(m.in_features * m.out_features
                             for _, m in bitlinear_modules(full.model))
    assert any(not torch.equal(a.indices, b.indices) for a, b in zip(rand, thr, strict=True))


def test_device_holds_only_masked_latents_as_compact_tensors(tmp_path: Path) -> None:
    coord = _coordinator()
    dev = _device(coord, tmp_path)
    assert all(t.compact for t in dev)
    assert all(m.weight is None for _, m in bitlinear_modules(dev.model))
    assert dev.names == coord.names and dev.numel == coord.numel
    assert checksum(dev) == checksum(coord)
    parts = dev.device_bytes()
    assert parts["latent"] == 4 * dev.numel and parts["mask"] == 4 * dev.numel


@pytest.mark.parametrize("selection", ["threshold", "random", "full"])
def test_replay_is_bit_exact_between_device_and_coordinator(tmp_path: Path,
                                                             selection: str) -> None:
    # Arrange: a device at version 0
    coord = _coordinator(0.05, selection)
    dev = _device(coord, tmp_path)
    # Act: the coordinator writes 3 entries, the device replays them with verification
    entries = _entries(coord, 3)
    version = replay(dev, entries, task_id="t", version=0, verify=True)
    # Assert
    assert version == 3
    for d, c in zip(dev, coord, strict=True):
        assert torch.equal(d.values(), c.values())
    snap_c, snap_d = ternary_snapshot(coord.model), ternary_snapshot(dev.model)
    assert all(torch.equal(snap_c[k], snap_d[k]) for k in snap_c)


def test_published_snapshot_equals_ternarizing_the_coordinator_latents(tmp_path: Path) -> None:
    coord = _coordinator()
    _entries(coord, 3)  # latents moved within the epoch (gamma frozen)
    for name, m in bitlinear_modules(coord.model):
        assert m.weight is not None
        packed = layer_tensors(name, m)[f"{name}.packed"]
        got = unpack_ternary(packed, m.weight.numel()).view_as(m.weight)
        assert torch.equal(got, ternarize(m.weight, m.gamma))
    # a new mask epoch refreshes gamma: the snapshot is absmean ternarization proper
    start_mask_epoch(coord.model, MaskConfig(fraction=0.05), epoch=1)
    for name, m in bitlinear_modules(coord.model):
        assert m.weight is not None
        assert torch.equal(m.gamma, absmean_gamma(m.weight))
        packed = layer_tensors(name, m)[f"{name}.packed"]
        got = unpack_ternary(packed, m.weight.numel()).view_as(m.weight)
        assert torch.equal(got, ternarize(m.weight, absmean_gamma(m.weight)))


def test_mask_epoch_reselects_from_moved_latents() -> None:
    coord = _coordinator()
    before = [t.indices.clone() for t in coord]
    apply_seeds(coord, [1, 2, 3], [0.02, -0.02, 0.02])  # big steps: masked latents move away
    scope = start_mask_epoch(coord.model, MaskConfig(fraction=0.05), epoch=1)
    assert scope.epoch == 1
    assert any(not torch.equal(a, t.indices) for a, t in zip(before, scope, strict=True))


def test_packed_model_cannot_start_a_mask_epoch(tmp_path: Path) -> None:
    dev = _device(_coordinator(), tmp_path)
    with pytest.raises(ScopeError, match="packed"):
        start_mask_epoch(dev.model, MaskConfig(), epoch=1)


def test_inference_only_snapshot_has_no_scope(tmp_path: Path) -> None:
    coord = _coordinator()
    save_ternary_model(coord.model, tmp_path / "s")
    with pytest.raises(ScopeError, match="no latents"):
        build_scope("ternary", load_ternary_model(tmp_path / "s", with_latents=False))


def test_model_without_bitlinear_is_refused_when_conversion_is_off() -> None:
    with pytest.raises(ScopeError, match="no BitLinear"):
        build_scope("ternary", tiny_llama(), convert=False)


@pytest.mark.parametrize("mode", ["copy", "virtual"])
def test_device_zo_step_equals_coordinator_replay_of_its_scalars(
        tmp_path: Path, tokens: torch.Tensor, mode: str) -> None:
    # Arrange
    coord = _coordinator()
    dev = _device(coord, tmp_path)
    model = dev.model

    def loss() -> float:
        with torch.no_grad():
            out = model(input_ids=tokens, labels=tokens)
        return float(out.loss)

    config = ZOConfig(lr=1e-3, eps=5e-3, perturbations=2, mode=mode)  # type: ignore[arg-type]
    seeds = [101, 202]
    # Act: a device step, then the coordinator applies the device's scalars
    res = spsa_step(dev, loss, seeds, config, Perturber(dev, mode))  # type: ignore[arg-type]
    coefs = (-(config.lr / 2) * res.g.astype(np.float64)).astype(np.float32)
    apply_seeds(coord, seeds, coefs.tolist())
    # Assert
    assert res.forwards == 4
    assert checksum(dev) == checksum(coord)


def test_device_forward_uses_ternarized_latents_like_the_coordinator(
        tmp_path: Path, tokens: torch.Tensor) -> None:
    # Arrange
    coord = _coordinator()
    dev = _device(coord, tmp_path)
    codes_before = ternary_snapshot(dev.model)
    with torch.no_grad():
        before = dev.model(input_ids=tokens).logits
    # Act: a step large enough to flip masked weights, on both sides
    apply_seeds(coord, [9], [0.05])
    apply_seeds(dev, [9], [0.05])
    # Assert
    with torch.no_grad():
        after = dev.model(input_ids=tokens).logits
        assert torch.equal(after, coord.model(input_ids=tokens).logits)
    assert not torch.equal(after, before)
    assert any(not torch.equal(codes_before[k], v) for k, v in ternary_snapshot(dev.model).items())
