"""Weights in the robust rules and the cap on one device's weight (issue 9)."""

import numpy as np
import pytest
from seedfed.shared.aggregate import (
    DEFAULT_MAX_NUM_EXAMPLES,
    AggregationConfig,
    aggregate,
    capped_weights,
    median,
    trimmed_mean,
)
from seedfed.shared.task import TaskSpec


def test_median_rule_follows_the_weights():
    # Arrange: the heavy device holds 5/7 of the examples
    g, w = np.array([[1.0], [2.0], [10.0]]), np.array([1, 1, 5])

    # Act
    out = aggregate(g, w, AggregationConfig(rule="median"))

    # Assert: the weighted median is the heavy device's value (unweighted it would be 2)
    assert out.tolist() == [10.0]


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_weighted_median_with_equal_weights_is_numpy_median(n: int):
    g = np.random.default_rng(n).normal(size=(n, 7))

    assert np.array_equal(median(g, np.full(n, 3.0)), np.median(g, axis=0))


def test_trimmed_mean_rule_trims_weight_not_devices():
    # Arrange: trim 10% of the weight (1 of 10) from each end; the heavy device straddles it
    g, w = np.array([[0.0], [1.0], [2.0], [100.0]]), np.array([1, 1, 1, 7])

    # Act
    out = aggregate(g, w, AggregationConfig(rule="trimmed_mean", trim=0.1))

    # Assert: kept weights 0, 1, 1, 6 of 8 (unweighted, trim 0.1 of 4 devices keeps all: 25.75)
    assert out.tolist() == [pytest.approx((1.0 + 2.0 + 600.0) / 8)]


def test_weighted_trimmed_mean_with_equal_weights_matches_the_unweighted_one():
    g = np.random.default_rng(0).normal(size=(10, 4))

    assert np.allclose(trimmed_mean(g, 0.2, np.full(10, 7.0)), trimmed_mean(g, 0.2))


def test_one_device_cannot_buy_the_mean_with_a_huge_example_count():
    # Arrange: two honest devices push +1 with 10 examples each; one claims 2**31 - 1 for -1
    g = np.array([[1.0], [1.0], [-1.0]])
    claimed = [10, 10, 2**31 - 1]
    config = AggregationConfig(max_num_examples=10)

    # Act
    out = aggregate(g, capped_weights(claimed, config.max_num_examples), config)

    # Assert: capped at 10, the liar has a third of the weight and cannot flip the sign
    assert out.tolist() == [pytest.approx(1 / 3)]


def test_task_json_without_the_cap_loads_with_the_documented_default():
    spec = TaskSpec.from_dict({"model_path": "m", "aggregation": {"rule": "median"}})

    assert spec.aggregation.max_num_examples == DEFAULT_MAX_NUM_EXAMPLES == 100_000


@pytest.mark.parametrize("bad", [0, -1, 2**31, 1.5])
def test_cap_outside_its_range_is_refused(bad: object):
    with pytest.raises(ValueError, match="max_num_examples"):
        AggregationConfig(max_num_examples=bad)  # type: ignore[arg-type]
