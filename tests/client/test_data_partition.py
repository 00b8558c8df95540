"""The fleet partitions of client/data.py: `fleet_partition` at any fleet size, the classic
per-class Dirichlet split it keeps where that works, and `sized_partition` beyond."""

from __future__ import annotations

import time

import numpy as np
import pytest
from seedfed.client.data import dirichlet_partition, fleet_partition, sized_partition


def _sst2_like_labels(n: int = 64_000, seed: int = 0) -> np.ndarray:
    """Two classes at SST-2's 44/56 balance."""
    return (np.random.default_rng(seed).random(n) < 0.557).astype(np.int64)


def test_ten_thousand_devices_each_get_data_and_every_example_is_used_once() -> None:
    # Arrange
    labels = _sst2_like_labels()
    started = time.perf_counter()
    # Act
    parts = fleet_partition(labels, 10_000, 0.5, np.random.default_rng(0), min_size=2)
    elapsed = time.perf_counter() - started
    # Assert
    sizes = np.array([p.size for p in parts])
    assert len(parts) == 10_000 and sizes.min() >= 2
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))
    assert all(np.all(np.diff(p) > 0) for p in parts)  # sorted, no repeat within a device
    assert sizes.max() > 5 * np.median(sizes)  # sizes spread, not an equal split
    assert elapsed < 10, f"partitioning 10,000 devices took {elapsed:.1f} s"


def test_the_partition_is_a_pure_function_of_labels_and_seed() -> None:
    labels = _sst2_like_labels(20_000)

    a = fleet_partition(labels, 3_000, 0.5, np.random.default_rng(7), min_size=2)
    b = fleet_partition(labels, 3_000, 0.5, np.random.default_rng(7), min_size=2)
    c = fleet_partition(labels, 3_000, 0.5, np.random.default_rng(8), min_size=2)

    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_a_fleet_the_classic_split_serves_keeps_the_classic_split() -> None:
    # the measured recipes' 20-device fleets: the same partition as before fleets of any size
    labels = _sst2_like_labels()

    classic = dirichlet_partition(labels, 20, 0.5, np.random.default_rng(0), min_size=2)
    fleet = fleet_partition(labels, 20, 0.5, np.random.default_rng(0), min_size=2)

    assert all(np.array_equal(x, y) for x, y in zip(classic, fleet, strict=True))


def test_the_classic_split_gives_up_where_fleet_partition_goes_on() -> None:
    labels = _sst2_like_labels()

    with pytest.raises(ValueError, match="no Dirichlet"):
        dirichlet_partition(labels, 1_000, 0.5, np.random.default_rng(0), min_size=2)
    parts = fleet_partition(labels, 1_000, 0.5, np.random.default_rng(0), min_size=2)

    assert min(p.size for p in parts) >= 2


def test_sized_partition_deals_each_class_exactly_its_supply() -> None:
    labels = np.random.default_rng(1).integers(0, 5, size=9_000)

    parts = sized_partition(labels, 700, 0.3, np.random.default_rng(2), min_size=3)

    joined = np.concatenate(parts)
    assert np.array_equal(np.bincount(labels[joined], minlength=5), np.bincount(labels))
    assert min(p.size for p in parts) >= 3


def test_small_alpha_skews_device_label_mixes_more() -> None:
    labels = _sst2_like_labels(30_000)

    def mean_skew(alpha: float) -> float:
        parts = sized_partition(labels, 2_000, alpha, np.random.default_rng(3), min_size=2)
        return float(np.mean([abs(labels[p].mean() - labels.mean()) for p in parts]))

    assert mean_skew(0.1) > mean_skew(100.0) + 0.15


def test_more_devices_than_examples_share_examples_evenly_never_twice_on_one_device() -> None:
    # Arrange: 1,000 devices x 2 examples from 500 examples
    labels = np.arange(500) % 2
    # Act
    parts = fleet_partition(labels, 1_000, 0.5, np.random.default_rng(4), min_size=2)
    # Assert
    assert all(p.size == 2 and np.unique(p).size == 2 for p in parts)
    uses = np.bincount(np.concatenate(parts), minlength=500)
    assert uses.min() >= 3 and uses.max() <= 5  # 2,000 draws spread over 500 examples


@pytest.mark.parametrize("kwargs, needle", [
    ({"n_devices": 0, "alpha": 0.5}, "n_devices"),
    ({"n_devices": 2, "alpha": 0.0}, "alpha"),
    ({"n_devices": 2, "alpha": 0.5, "min_size": 0}, "min_size"),
])
def test_sized_partition_rejects_bad_arguments(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        sized_partition(np.arange(100) % 2, rng=np.random.default_rng(0), **kwargs)


def test_fleet_partition_rejects_what_no_partition_fixes() -> None:
    with pytest.raises(ValueError, match="alpha"):
        fleet_partition(np.arange(100) % 2, 10, -1.0, np.random.default_rng(0))
