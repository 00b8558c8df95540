"""A device's share of a data file (client/device_data.py): one partition per fleet and process,
whatever the number of devices that ask for theirs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from seedfed.client import data as data_mod
from seedfed.client import device_data
from seedfed.client.device_data import DeviceData, fleet_shares, fleet_texts, load_device_examples

from tests.fleet_helpers import write_sentiment_tsv


@pytest.fixture()
def data_file(tmp_path: Path) -> str:
    fleet_shares.cache_clear()
    return str(write_sentiment_tsv(tmp_path / "d.tsv", n=3_000))


def test_a_fleet_of_a_thousand_devices_is_partitioned_once(
        data_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange
    calls = []
    real = data_mod.fleet_partition

    def counting(*args: object, **kwargs: object) -> list[np.ndarray]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(device_data.data_mod, "fleet_partition", counting)
    base = DeviceData(source=data_file, num_partitions=1_000)
    # Act
    shares = [load_device_examples(DeviceData(source=data_file, partition_id=i,
                                              num_partitions=1_000)) for i in range(1_000)]
    # Assert
    assert len(calls) == 1
    assert all(len(train) >= 1 for train, _ in shares)
    held = sum(len(train) + len(local) for train, local in shares)
    assert held == len(fleet_texts(base))  # every sentence on exactly one device


def test_every_process_derives_the_same_shares_from_the_seed(data_file: str) -> None:
    one = load_device_examples(DeviceData(source=data_file, partition_id=17,
                                          num_partitions=500, seed=3))
    fleet_shares.cache_clear()  # as a fresh process would
    two = load_device_examples(DeviceData(source=data_file, partition_id=17,
                                          num_partitions=500, seed=3))

    assert one[0].texts == two[0].texts and one[1].texts == two[1].texts


def test_shares_are_read_only_so_no_device_can_change_anothers(data_file: str) -> None:
    _, parts = fleet_shares(data_file, 50, 0.5, 0)

    with pytest.raises(ValueError):
        parts[0][0] = 1
