"""The fleet's mean and worst decile of the devices' accuracies: one definition."""

import pytest
from seedfed.shared.protocol.fleet_stats import fleet_accuracy, mean, worst_decile


def test_worst_decile_of_ten_devices_is_the_worst_one():
    values = [0.9, 0.2, 0.8, 0.7, 0.95, 0.6, 0.85, 0.75, 0.65, 0.5]

    assert worst_decile(values) == 0.2


def test_worst_decile_averages_the_lowest_tenth_rounded_down():
    values = [0.1, 0.3] + [1.0] * 23  # 25 devices: the lowest 2

    assert worst_decile(values) == pytest.approx(0.2)


@pytest.mark.parametrize("n", [1, 5, 9])
def test_worst_decile_of_fewer_than_ten_devices_is_the_lowest(n: int):
    values = [0.5 + i / 100 for i in range(n)][::-1]

    assert worst_decile(values) == 0.5


def test_no_value_has_no_statistics():
    with pytest.raises(ValueError):
        worst_decile([])
    with pytest.raises(ValueError):
        mean([])
    assert fleet_accuracy([]) is None


def test_fleet_accuracy_counts_the_devices_and_takes_both_statistics():
    values = [0.5, 1.0, 0.75, 0.25]

    got = fleet_accuracy(values)

    assert got is not None
    assert (got.devices, got.mean, got.worst_decile) == (4, 0.625, 0.25)
