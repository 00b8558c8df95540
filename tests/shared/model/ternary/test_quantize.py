from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from seedfed.shared.model.ternary import (
    GAMMA_FLOOR,
    absmean_gamma,
    exact_abs_sum,
    invalid_code_count,
    pack_ternary,
    packed_size,
    ternarize,
    threshold_distance,
    unpack_ternary,
)


def test_pack_layout_matches_the_documented_code_map() -> None:
    # Arrange: codes q+1 = [0, 1, 2, 1 | 2, pad 1, 1, 1], two bits each, LSB pair first
    q = torch.tensor([-1, 0, 1, 0, 1], dtype=torch.int8)
    expected = [0 | 1 << 2 | 2 << 4 | 1 << 6, 2 | 1 << 2 | 1 << 4 | 1 << 6]
    # Act
    packed = pack_ternary(q)
    # Assert
    assert packed.dtype == torch.uint8
    assert packed.tolist() == expected


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([-1, 0, 1]), min_size=0, max_size=67))
def test_pack_unpack_round_trip_is_exact(values: list[int]) -> None:
    q = torch.tensor(values, dtype=torch.int8)
    packed = pack_ternary(q)
    assert packed.numel() == packed_size(len(values))
    assert torch.equal(unpack_ternary(packed, len(values)), q)
    assert torch.equal(unpack_ternary(packed, len(values), torch.float32), q.float())


def test_pack_round_trip_of_a_matrix_keeps_row_major_order() -> None:
    q = torch.randint(-1, 2, (7, 9), generator=torch.Generator().manual_seed(1)).to(torch.int8)
    flat = unpack_ternary(pack_ternary(q), q.numel())
    assert torch.equal(flat.view(7, 9), q)


def test_pack_refuses_values_outside_ternary() -> None:
    with pytest.raises(ValueError, match=r"range \[-1, 2\]"):
        pack_ternary(torch.tensor([0, 2, -1], dtype=torch.int8))


def test_unpack_refuses_wrong_length_and_dtype() -> None:
    with pytest.raises(ValueError, match="need 3 packed bytes"):
        unpack_ternary(torch.zeros(2, dtype=torch.uint8), 9)
    with pytest.raises(TypeError, match="uint8"):
        unpack_ternary(torch.zeros(3, dtype=torch.int8), 9)


def test_invalid_code_is_counted() -> None:
    good = pack_ternary(torch.tensor([1, -1, 0, 0, 1, 1, 1, 1], dtype=torch.int8))
    bad = good.clone()
    bad[1] |= 0b11 << 4
    assert invalid_code_count(good) == 0
    assert invalid_code_count(bad) == 1


def test_ternarize_rounds_at_half_gamma_and_clamps() -> None:
    gamma = torch.tensor(0.5)
    # w / gamma: 0.49 -> 0, 0.5 -> 0 (half to even), 0.51 -> 1, 1.5 -> 2 -> clamp 1, -0.7 -> -1
    w = torch.tensor([0.245, 0.25, 0.255, 0.75, -0.35, 3.0, -3.0, 0.0])
    assert ternarize(w, gamma).tolist() == [0, 0, 1, 1, -1, 1, -1, 0]


def test_ternarize_matches_a_numpy_float32_reference() -> None:
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(2)) * 0.03
    gamma = absmean_gamma(w)
    ref = np.clip(np.round(w.numpy() / np.float32(gamma.item())), -1, 1).astype(np.int8)
    assert np.array_equal(ternarize(w, gamma).numpy(), ref)


def test_gamma_is_the_mean_absolute_value_with_a_floor() -> None:
    w = torch.tensor([[1.0, -3.0], [0.5, -0.5]])
    assert absmean_gamma(w).item() == pytest.approx(1.25)
    assert absmean_gamma(w).dtype == torch.float32
    assert absmean_gamma(torch.zeros(3, 3)).item() == pytest.approx(GAMMA_FLOOR)
    with pytest.raises(ValueError, match="gamma must be positive"):
        ternarize(w, 0.0)


def test_threshold_distance_is_zero_exactly_at_half_gamma() -> None:
    d = threshold_distance(torch.tensor([0.5, -0.5, 0.0, 1.0, 0.75]), torch.tensor(1.0))
    assert d.tolist() == [0.0, 0.0, 0.5, 0.5, 0.25]


def test_gamma_is_exact_and_independent_of_element_order() -> None:
    # Arrange: normal and subnormal magnitudes
    w = torch.randn(60, 50, generator=torch.Generator().manual_seed(5)) * 0.02
    w[0, :2] = torch.tensor([1e-42, -3e-39])
    shuffled = w.reshape(-1)[torch.randperm(w.numel(), generator=torch.Generator().manual_seed(6))]
    exact = sum(Fraction(x) for x in w.abs().reshape(-1).tolist())
    # Act / Assert
    assert exact_abs_sum(w) == exact
    assert absmean_gamma(w).item() == np.float32(float(exact / w.numel()))
    assert torch.equal(absmean_gamma(shuffled), absmean_gamma(w))
