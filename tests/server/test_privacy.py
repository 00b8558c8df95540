"""Client-level DP: the noise scale and the reported epsilon checked against an independent
accountant (Google's dp-accounting, RDP and PLD), and the rules DP is refused for."""

from __future__ import annotations

import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from seedfed.server import privacy
from seedfed.server.aggregation import combine
from seedfed.server.coordinator import Coordinator
from seedfed.server.errors import InvalidTaskError
from seedfed.server.privacy import DEFAULT_ORDERS, epsilon, gaussian_rdp
from seedfed.shared.protocol.aggregate import AggregationConfig, aggregate, dp_noise_std

from tests.server.conftest import tiny_spec

SECRET = "0123456789abcdef" * 2


def test_epsilon_matches_a_brute_force_minimum_over_orders() -> None:
    sigma, rounds, delta = 1.1, 50, 1e-5
    a = np.linspace(1.01, 200, 200_000)
    brute = float(np.min(rounds * a / (2 * sigma**2) + np.log((a - 1) / a)
                         - (math.log(delta) + np.log(a)) / (a - 1)))

    eps = epsilon(sigma, rounds, delta)

    assert brute <= eps <= brute * 1.02


@pytest.mark.parametrize(("z", "rounds", "delta"),
                         [(0.8, 1, 1e-5), (1.1, 50, 1e-5), (1.3, 300, 1e-6), (4.0, 1000, 1e-5)])
def test_epsilon_equals_dp_accountings_rdp_and_bounds_its_pld(z: float, rounds: int,
                                                              delta: float) -> None:
    acc = rdp.RdpAccountant(orders=list(DEFAULT_ORDERS),
                            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.GaussianDpEvent(z), rounds)
    tight = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    tight.compose(dp_accounting.GaussianDpEvent(z), rounds)

    ours = epsilon(z, rounds, delta)

    assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-6)
    # PLD is (numerically) tight: a valid bound is never below it, and RDP stays close to it.
    pld_eps = tight.get_epsilon(delta)
    assert pld_eps <= ours <= 1.35 * pld_eps + 0.1


def test_one_device_moves_the_dp_aggregate_by_at_most_clip_over_the_quorum() -> None:
    # Arrange: a round of 7 uploads for a quorum of 8, plus one more device whose presence
    # is what adjacency is about; its vector is huge and its claimed weight absurd.
    cfg = AggregationConfig(dp_clip=2.0, dp_noise_multiplier=1.3)
    quorum = 8
    rng = np.random.default_rng(0)
    others = rng.normal(0.0, 5.0, size=(7, 16))
    outlier = rng.normal(0.0, 1e3, size=(1, 16))
    with_it = np.vstack([others, outlier])

    # Act: the noiseless aggregate without and with the device (noise 0, same config else)
    quiet = AggregationConfig(dp_clip=2.0, dp_noise_multiplier=0.0)
    a = aggregate(others, np.ones(7), quiet, dp_devices=quorum)
    b = aggregate(with_it, np.array([1.0] * 7 + [1e12]), quiet, dp_devices=quorum)

    # Assert: the L2 shift is C / quorum exactly (its clipped norm), whatever it claimed
    sensitivity = cfg.dp_clip / quorum  # type: ignore[operator]
    assert np.linalg.norm(b - a) == pytest.approx(sensitivity, rel=1e-9)
    # and the noise the coordinator adds has standard deviation z * sensitivity
    assert dp_noise_std(cfg, quorum) == pytest.approx(1.3 * sensitivity)
    draws = np.stack([aggregate(others, np.ones(7), cfg, np.random.default_rng(s),
                                dp_devices=quorum) - a for s in range(400)])
    assert draws.std() == pytest.approx(1.3 * sensitivity, rel=0.05)
    assert abs(draws.mean()) < 0.05 * sensitivity * 1.3


def test_the_coordinators_round_noise_is_the_accounted_multiplier() -> None:
    # Arrange: what a DP round of quorum 4 releases, from the same combine() as a close
    cfg = AggregationConfig(dp_clip=1.0, dp_noise_multiplier=1.1)
    matrices = [np.full((1, 4), 3.0), np.full((1, 4), -3.0), np.full((1, 4), 0.1)]
    kw = dict(task_id="t", base_version=0, seeds=[1, 2, 3, 4], perturbations=4, lr=0.4,
              matrices=matrices, num_examples=[1, 10**9, 5], losses=[0.5] * 3, config=cfg,
              secret=SECRET, dp_devices=4)

    # Act
    out = combine(round_number=1, **kw)  # type: ignore[arg-type]

    # Assert: noise std on the aggregate = z * (C / quorum): multiplier z, as accounted
    assert out.noise_std == pytest.approx(1.1 * 1.0 / 4)
    assert out.noise_std / (cfg.dp_clip / 4) == pytest.approx(cfg.dp_noise_multiplier)  # type: ignore[operator]


@pytest.mark.parametrize("rule", ["trimmed_mean", "median"])
def test_dp_is_refused_for_rules_whose_sensitivity_differs(rule: str) -> None:
    with pytest.raises(ValueError, match="sensitivity of a trimmed mean or median"):
        AggregationConfig(rule=rule, dp_clip=1.0, dp_noise_multiplier=1.0)  # type: ignore[arg-type]


def test_task_creation_refuses_dp_with_median(coord: Coordinator, tiny_bert: Path) -> None:
    spec = tiny_spec(tiny_bert).to_dict()
    spec["aggregation"] = {"rule": "median", "dp_clip": 1.0, "dp_noise_multiplier": 1.0}

    with pytest.raises(InvalidTaskError, match="supports the rules"):
        coord.create_task(spec)  # type: ignore[arg-type]


def test_clipped_mean_keeps_the_dp_bound() -> None:
    cfg = AggregationConfig(rule="clipped_mean", clip_bound=0.1, dp_clip=1.0)
    g = np.array([[10.0, 0.0], [0.0, 0.0]])

    out = aggregate(g, np.ones(2), cfg, dp_devices=2)

    assert np.allclose(out, [0.05, 0.0])  # L2 clip to 1, then element clip to 0.1, over 2


def test_epsilon_grows_with_rounds_and_shrinks_with_noise() -> None:
    e = [epsilon(1.0, t, 1e-5) for t in (1, 10, 100)]

    assert e[0] < e[1] < e[2]
    assert epsilon(2.0, 10, 1e-5) < epsilon(1.0, 10, 1e-5)
    assert epsilon(1.0, 0, 1e-5) == 0.0
    assert epsilon(0.0, 3, 1e-5) == math.inf
    assert privacy.rdp_to_epsilon(0.0, 2.0, 0.5) >= 0.0


def test_rdp_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="order must be > 1"):
        gaussian_rdp(1.0, 1.0)
    with pytest.raises(ValueError, match="delta must be in"):
        epsilon(1.0, 3, 0.0)
