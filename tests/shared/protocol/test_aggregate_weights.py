"""The weights of a round: uniform for the robust rules, FedAvg's claims capped at the round's
median claim for the mean; the weighted rules themselves."""

import numpy as np
import pytest
from seedfed.shared.protocol.aggregate import (
    DEFAULT_MAX_NUM_EXAMPLES,
    DEFAULT_MAX_WEIGHT_RATIO,
    AggregationConfig,
    aggregate,
    capped_weights,
    median,
    round_weights,
    trimmed_mean,
)
from seedfed.shared.protocol.task import TaskSpec


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


# -- round_weights: the weights the coordinator gives a round's claims ---------------------------
@pytest.mark.parametrize("rule", ["trimmed_mean", "median"])
def test_robust_rules_weigh_every_device_the_same_whatever_it_claims(rule: str) -> None:
    claims = [1, 1000, 2**31 - 1, 7]

    w = round_weights(claims, AggregationConfig(rule=rule))  # type: ignore[arg-type]

    assert w.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_the_mean_caps_each_weight_at_the_median_claim_by_default() -> None:
    # five claims: median 35 (200,000 first capped at 100,000)
    w = round_weights([40, 30, 200_000, 35, 25], AggregationConfig())

    assert DEFAULT_MAX_WEIGHT_RATIO == 1.0
    assert w.tolist() == [35.0, 30.0, 35.0, 35.0, 25.0]


def test_the_ratio_multiplies_the_median_of_an_even_count_and_none_drops_it() -> None:
    claims = [7, 9, 20, 100]  # median 14.5

    assert round_weights(claims, AggregationConfig(max_weight_ratio=2.5)).tolist() == \
        [7.0, 9.0, 20.0, 36.25]
    assert round_weights(claims, AggregationConfig(max_weight_ratio=None)).tolist() == \
        [7.0, 9.0, 20.0, 100.0]


def test_six_liars_of_twenty_claiming_the_cap_hold_their_count_share_not_the_round() -> None:
    # Arrange: the probe's attack: 14 honest devices report 1,000, 6 liars the cap (100,000)
    claims = np.array([1000] * 14 + [100_000] * 6)
    liars = np.arange(20) >= 14

    # Act
    shares = {rule: float(w[liars].sum() / w.sum()) for rule in ("mean", "median")
              for w in [round_weights(claims, AggregationConfig(rule=rule))]}  # type: ignore
    uncapped = round_weights(claims, AggregationConfig(max_weight_ratio=None))

    # Assert: 30% under the default mean and the median; 97.7% with the cap alone
    assert shares == {"mean": pytest.approx(0.3), "median": pytest.approx(0.3)}
    assert float(uncapped[liars].sum() / uncapped.sum()) == pytest.approx(0.977, abs=1e-3)


def test_liars_claiming_the_cap_cannot_move_the_median() -> None:
    # Arrange: 14 honest devices push +1, 6 liars push -1e4 claiming 2**31 - 1 examples
    g = np.array([[1.0]] * 14 + [[-1e4]] * 6)
    claims = [1000] * 14 + [2**31 - 1] * 6
    config = AggregationConfig(rule="median")

    out = aggregate(g, round_weights(claims, config), config)

    assert out.tolist() == [1.0]


def test_task_json_without_the_ratio_loads_with_the_default() -> None:
    spec = TaskSpec.from_dict({"model_path": "m", "aggregation": {"rule": "mean",
                                                                  "max_num_examples": 50}})

    assert spec.aggregation.max_weight_ratio == DEFAULT_MAX_WEIGHT_RATIO


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("inf"), 1e7])
def test_a_ratio_outside_its_range_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"aggregation.max_weight_ratio must be in \[1, 1e\+06\]"):
        AggregationConfig(max_weight_ratio=bad)


def test_the_spec_json_leaves_the_default_ratio_out_for_older_readers() -> None:
    # A device of a release before max_weight_ratio builds AggregationConfig(**aggregation)
    plain = TaskSpec(model_path="m")
    set_ = TaskSpec(model_path="m", aggregation=AggregationConfig(max_weight_ratio=None))

    assert "max_weight_ratio" not in plain.to_dict()["aggregation"]
    assert set_.to_dict()["aggregation"]["max_weight_ratio"] is None
    assert TaskSpec.from_dict(plain.to_dict()) == plain
    assert TaskSpec.from_dict(set_.to_dict()) == set_
