import numpy as np
import pytest
from seedfed.shared.protocol.aggregate import (
    AggregationConfig,
    aggregate,
    build_entry,
    clipped_mean,
    dp_clip_rows,
    median,
    trimmed_mean,
    weighted_mean,
)
from seedfed.shared.protocol.errors import NonFiniteScalarError, ShapeError


def test_weighted_mean_weights_by_examples():
    g = np.array([[1.0, 0.0], [4.0, 3.0]])
    assert weighted_mean(g, np.array([3, 1])).tolist() == [1.75, 0.75]


def test_clipped_mean_bounds_each_scalar():
    g = np.array([[1000.0], [1.0]])
    assert clipped_mean(g, np.array([1, 1]), bound=3.0).tolist() == [2.0]


def test_trimmed_mean_drops_extremes_per_seed():
    g = np.array([[100.0], [1.0], [2.0], [3.0], [-100.0]])
    assert trimmed_mean(g, 0.2).tolist() == [2.0]


def test_median_ignores_a_minority_of_outliers():
    g = np.array([[1.0], [2.0], [1e9]])
    assert median(g).tolist() == [2.0]


def test_dp_clip_rows_bounds_l2_norm():
    g = np.array([[3.0, 4.0], [0.3, 0.4]])
    out = dp_clip_rows(g, 1.0)
    assert np.allclose(np.linalg.norm(out, axis=1), [1.0, 0.5])


def test_dp_noise_needs_explicit_generator_and_is_reproducible():
    cfg = AggregationConfig(dp_clip=1.0, dp_noise_multiplier=1.0)
    g, w = np.ones((4, 3)), np.ones(4)
    with pytest.raises(ValueError, match="Generator"):
        aggregate(g, w, cfg)
    a = aggregate(g, w, cfg, np.random.default_rng(1))
    b = aggregate(g, w, cfg, np.random.default_rng(1))
    assert np.array_equal(a, b) and not np.allclose(a, weighted_mean(dp_clip_rows(g, 1.0), w))


@pytest.mark.parametrize("bad", [np.array([[np.nan]]), np.array([[np.inf, 1.0]])])
def test_non_finite_scalars_refused(bad):
    with pytest.raises(NonFiniteScalarError):
        weighted_mean(bad, np.ones(bad.shape[0]))


def test_shape_errors_name_the_problem():
    with pytest.raises(ShapeError, match="3 weights for 2 devices"):
        weighted_mean(np.ones((2, 2)), np.ones(3))
    with pytest.raises(ShapeError, match="columns"):
        build_entry("t", 0, [1, 2, 3], np.ones((2, 2)), np.ones(2), 0.1, 1)


@pytest.mark.parametrize("kwargs, msg", [
    ({"rule": "mode"}, "rule"), ({"trim": 0.5}, "trim"), ({"clip_bound": 0}, "clip_bound"),
    ({"dp_noise_multiplier": 1.0}, "dp_clip"),
])
def test_config_validation_names_bad_value(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        AggregationConfig(**kwargs)


def test_build_entry_coefficients_are_float32_of_minus_lr_over_p_times_mean():
    entry = build_entry("t", 4, [7, 8], np.array([[1.0, 2.0]]), np.ones(1), lr=0.1, perturbations=2)
    assert entry.base_version == 4 and entry.version == 5
    assert entry.coefs == (float(np.float32(-0.05)), float(np.float32(-0.1)))
