from __future__ import annotations

import math

import numpy as np
import pytest
from seedfed.server.privacy import epsilon, gaussian_rdp


def test_epsilon_matches_a_brute_force_minimum_over_orders() -> None:
    sigma, rounds, delta = 1.1, 50, 1e-5
    orders = np.linspace(1.01, 200, 200_000)
    brute = float(np.min(rounds * orders / (2 * sigma**2) + math.log(1 / delta) / (orders - 1)))

    eps = epsilon(sigma, rounds, delta)

    assert brute <= eps <= brute * 1.02


def test_epsilon_grows_with_rounds_and_shrinks_with_noise() -> None:
    e = [epsilon(1.0, t, 1e-5) for t in (1, 10, 100)]

    assert e[0] < e[1] < e[2]
    assert epsilon(2.0, 10, 1e-5) < epsilon(1.0, 10, 1e-5)
    assert epsilon(1.0, 0, 1e-5) == 0.0
    assert epsilon(0.0, 3, 1e-5) == math.inf


def test_rdp_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="order must be > 1"):
        gaussian_rdp(1.0, 1.0)
    with pytest.raises(ValueError, match="delta must be in"):
        epsilon(1.0, 3, 0.0)
