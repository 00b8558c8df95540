from __future__ import annotations

import numpy as np
import pytest
from seedfed.server.aggregation import combine, draw_seeds, round_rng, upload_digest
from seedfed.shared.protocol.aggregate import AggregationConfig
from seedfed.shared.protocol.npzo import update_coefficients
from seedfed.shared.protocol.wire import MAX_SEED

SECRET = "0123456789abcdef0123456789abcdef"


def test_seeds_are_deterministic_per_secret_and_round_and_in_range() -> None:
    a = draw_seeds(SECRET, 3, 4, 5)

    assert a == draw_seeds(SECRET, 3, 4, 5)
    assert a != draw_seeds(SECRET, 4, 4, 5)
    assert a != draw_seeds("f" * 32, 3, 4, 5)
    assert np.array(a).shape == (4, 5)
    assert all(0 <= s <= MAX_SEED for row in a for s in row)


def test_combine_is_the_weighted_mean_in_plan_order() -> None:
    m = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[3.0, 0.0], [1.0, 0.0]])]

    out = combine(task_id="t", base_version=2, round_number=1, seeds=[5, 6, 7, 8],
                  perturbations=2, lr=0.1, matrices=m, num_examples=[1, 3], losses=[1.0, 2.0],
                  config=AggregationConfig(max_weight_ratio=None), secret=SECRET)

    mean = (np.array([1, 2, 3, 4]) * 1 + np.array([3, 0, 1, 0]) * 3) / 4
    assert out.entry.seeds == (5, 6, 7, 8) and out.entry.base_version == 2
    assert out.entry.coefs == tuple(float(c) for c in update_coefficients(mean, 0.1, 2))
    assert out.loss == pytest.approx(1.75) and out.noise_std == 0.0


def test_combine_weighs_with_the_round_weights_of_the_task() -> None:
    # claims 1 and 3: the default caps each weight at the median claim, 2
    m = [np.array([[1.0, 2.0]]), np.array([[3.0, 0.0]])]

    out = combine(task_id="t", base_version=0, round_number=1, seeds=[5, 6], perturbations=2,
                  lr=0.1, matrices=m, num_examples=[1, 3], losses=[1.0, 2.0],
                  config=AggregationConfig(), secret=SECRET)

    mean = (np.array([1, 2]) * 1 + np.array([3, 0]) * 2) / 3
    assert out.entry.coefs == tuple(float(c) for c in update_coefficients(mean, 0.1, 2))
    assert out.loss == pytest.approx(5 / 3)


def test_dp_noise_is_reproducible_from_the_secret() -> None:
    cfg = AggregationConfig(dp_clip=1.0, dp_noise_multiplier=1.0)
    kw = dict(task_id="t", base_version=0, seeds=[1, 2], perturbations=1, lr=1.0,
              matrices=[np.ones((2, 1))], num_examples=[2], losses=[0.0], config=cfg)

    a = combine(round_number=1, secret=SECRET, **kw)  # type: ignore[arg-type]
    b = combine(round_number=1, secret=SECRET, **kw)  # type: ignore[arg-type]
    c = combine(round_number=2, secret=SECRET, **kw)  # type: ignore[arg-type]

    assert a.entry.coefs == b.entry.coefs != c.entry.coefs
    assert a.noise_std == 1.0


def test_digest_covers_every_field() -> None:
    g = np.zeros((2, 2), dtype=np.float32)
    base = upload_digest(1, g, 5, 0.5)

    assert upload_digest(1, g, 5, 0.5) == base
    assert len({base, upload_digest(2, g, 5, 0.5), upload_digest(1, g + 1, 5, 0.5),
                upload_digest(1, g, 6, 0.5), upload_digest(1, g, 5, 0.6),
                upload_digest(1, g.reshape(1, 4), 5, 0.5)}) == 6


def test_round_rng_streams_differ() -> None:
    a = round_rng(SECRET, 1, 1).integers(0, 1 << 60)
    b = round_rng(SECRET, 1, 2).integers(0, 1 << 60)

    assert a != b
