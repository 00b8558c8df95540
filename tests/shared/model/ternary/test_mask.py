from __future__ import annotations

import numpy as np
import pytest
import torch
from seedfed.shared.model.ternary import (
    MaskConfig,
    absmean_gamma,
    mask_size,
    random_mask,
    threshold_distance,
    threshold_mask,
)


def _latents(seed: int = 0, shape: tuple[int, int] = (40, 30)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_threshold_mask_keeps_the_latents_nearest_half_gamma() -> None:
    # Arrange
    w = _latents()
    gamma = absmean_gamma(w)
    d = (np.abs(np.abs(w.numpy().astype(np.float64)) / gamma.item() - 0.5)).reshape(-1)
    k = mask_size(w.numel(), 0.05)
    # Act
    mask = threshold_mask(w, gamma, 0.05)
    # Assert: k sorted unique int32 indices, every kept distance <= every dropped one
    assert mask.dtype == torch.int32 and mask.numel() == k
    idx = mask.long().numpy()
    assert np.all(np.diff(idx) > 0)
    dropped = np.setdiff1d(np.arange(w.numel()), idx)
    assert d[idx].max() <= d[dropped].min() + 1e-6


def test_threshold_mask_breaks_ties_by_lower_index() -> None:
    gamma = torch.tensor(1.0)
    w = torch.tensor([0.875, 0.75, 0.25, -0.75, 0.25, 0.0])  # distances 3/8, 1/4 x4, 1/2
    assert threshold_mask(w, gamma, 3 / 6).tolist() == [1, 2, 3]


def test_masked_latents_are_the_ones_a_small_step_flips() -> None:
    w = _latents(1)
    gamma = absmean_gamma(w)
    mask = threshold_mask(w, gamma, 0.02)
    reach = threshold_distance(w, gamma).reshape(-1)[mask.long()].max() * gamma
    flippable = (threshold_distance(w, gamma).reshape(-1) * gamma < reach).nonzero().reshape(-1)
    assert set(flippable.tolist()) <= set(mask.tolist())


def test_threshold_mask_refuses_nan_latents() -> None:
    w = _latents()
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        threshold_mask(w, torch.tensor(0.01), 0.1)


def test_random_mask_is_reproducible_and_depends_on_name_and_epoch() -> None:
    a = random_mask(1000, 0.03, seed=5, name="l.weight", epoch=0)
    assert a.numel() == 30 and a.dtype == torch.int32
    assert torch.equal(a, random_mask(1000, 0.03, seed=5, name="l.weight", epoch=0))
    assert not torch.equal(a, random_mask(1000, 0.03, seed=5, name="l.weight", epoch=1))
    assert not torch.equal(a, random_mask(1000, 0.03, seed=5, name="m.weight", epoch=0))
    assert bool((a[1:] > a[:-1]).all())


def test_mask_size_is_at_least_one_and_at_most_all() -> None:
    assert mask_size(10, 1e-6) == 1
    assert mask_size(10, 1.0) == 10
    assert mask_size(1000, 0.015) == 15


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"selection": "magic"}, "selection"),
    ({"fraction": 0.0}, "fraction"),
    ({"fraction": 1.5}, "fraction"),
    ({"epoch_rounds": 0}, "epoch_rounds"),
    ({"seed": -1}, "seed"),
])
def test_mask_config_names_the_bad_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MaskConfig(**kwargs)  # type: ignore[arg-type]


def test_mask_epochs_advance_every_m_rounds() -> None:
    c = MaskConfig(epoch_rounds=3)
    assert [c.epoch_of(r) for r in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [r for r in range(7) if c.starts_epoch(r)] == [0, 3, 6]
