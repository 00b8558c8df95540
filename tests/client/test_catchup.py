"""Catch-up by real cost: the decision is a pure function of the device's own measured rates,
the meters measure what they claim, and a device's choice follows its rates, not a constant."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from seedfed.client.catchup import (
    PRIOR_BANDWIDTH,
    LinkMeter,
    RateMeter,
    choose_catchup,
    crossover_versions,
)
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import DeviceConfig, HttpDevice
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import Hyper, TaskSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A full-MiniLM-sized scope, an SST-2-recipe entry (64 seeds), its fp32 snapshot.
NUMEL, SEEDS, ENTRY_BYTES = 22_700_000, 64, 1_900
SNAPSHOT = 4 * NUMEL


def costs(k: int, **over: float) -> dict[str, float]:
    base: dict[str, float] = dict(versions_behind=k, replay_bytes=k * ENTRY_BYTES,
                                  replay_seeds=k * SEEDS, scope_numel=NUMEL,
                                  download_bytes=SNAPSHOT, bandwidth=1e6, latency=0.05,
                                  replay_rate=1e9, load_rate=2e8)
    base.update(over)
    return base


def test_nothing_to_do_at_zero_versions_behind() -> None:
    assert choose_catchup(**costs(0)).action == "none"  # type: ignore[arg-type]


def test_the_choice_flips_at_the_computed_crossover() -> None:
    # Arrange
    k_star = crossover_versions(entry_bytes=ENTRY_BYTES, seeds_per_entry=SEEDS,
                                scope_numel=NUMEL, download_bytes=SNAPSHOT, bandwidth=1e6,
                                replay_rate=1e9, load_rate=2e8)

    # Act
    below = choose_catchup(**costs(math.floor(k_star)))  # type: ignore[arg-type]
    above = choose_catchup(**costs(math.ceil(k_star)))  # type: ignore[arg-type]

    # Assert: ~91 s of download at 1 MB/s against ~1.5 s of replay per entry
    assert 50 < k_star < 70
    assert below.action == "replay" and below.replay_seconds <= below.download_seconds
    assert above.action == "download" and above.replay_seconds > above.download_seconds


def test_a_faster_link_or_a_slower_cpu_moves_the_crossover_down() -> None:
    kw = dict(entry_bytes=ENTRY_BYTES, seeds_per_entry=SEEDS, scope_numel=NUMEL,
              download_bytes=SNAPSHOT, load_rate=2e8)
    slow_link = crossover_versions(bandwidth=1e6, replay_rate=1e9, **kw)  # type: ignore[arg-type]
    lan = crossover_versions(bandwidth=1e8, replay_rate=1e9, **kw)  # type: ignore[arg-type]
    pi = crossover_versions(bandwidth=1e6, replay_rate=5e7, **kw)  # type: ignore[arg-type]

    assert lan < slow_link / 10 and pi < slow_link / 10


def test_a_forced_reason_downloads_and_bad_rates_are_refused() -> None:
    forced = choose_catchup(**costs(1), forced="mask epoch start")  # type: ignore[arg-type]

    assert (forced.action, forced.reason) == ("download", "mask epoch start")
    with pytest.raises(ValueError, match="replay_rate"):
        choose_catchup(**costs(1, replay_rate=0.0))  # type: ignore[arg-type]


def test_the_link_meter_separates_latency_from_bandwidth() -> None:
    # Arrange: t = 0.05 s + bytes / 1 MB/s
    meter = LinkMeter()
    prior = meter.bandwidth

    # Act
    for n in (200, 500, 2_000_000, 5_000_000):
        meter.observe(n, 0.05 + n / 1e6)

    # Assert
    assert prior == PRIOR_BANDWIDTH
    assert meter.latency == pytest.approx(0.0502)
    assert meter.bandwidth == pytest.approx(1e6, rel=1e-3)


def test_the_rate_meter_starts_at_its_prior_then_follows_the_work() -> None:
    meter = RateMeter(prior=123.0)
    assert meter.rate == 123.0

    meter.observe(1000, 2.0)
    meter.observe(3000, 2.0)

    assert meter.rate == 1000.0


@pytest.fixture
def behind(fleet_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[HttpDevice]:
    """A device at v0 of a task that has moved on to v2."""
    model, data = fleet_assets
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"),
                    hyper=Hyper(lr=1e-3, eps=1e-2, steps=1, perturbations=2, batch_size=8),
                    max_seq_len=16)
    task_id, join = coord.create_task_with_token(spec, quorum=50)
    with TestClient(create_app(runtime=coord.rt)) as client:
        def device(i: int) -> HttpDevice:
            return HttpDevice(DeviceConfig(
                url="http://testserver", task_id=task_id, join_token=join,
                state_dir=tmp_path / f"dev{i}", model=str(model),
                data=DeviceData(source=str(data), partition_id=i, num_partitions=2)),
                client=client)

        lagging, active = device(0), device(1)
        lagging.enroll()
        active.enroll()
        lagging.sync()
        for _ in range(2):
            active.train_and_upload(coord.open_round(task_id))
            coord.close_round(task_id)
        yield lagging
    coord.close()


def test_a_device_with_a_slow_cpu_downloads_and_one_with_a_slow_link_replays(
        behind: HttpDevice) -> None:
    # Arrange: the same device state, two sets of its own measurements
    behind.meters.replay = RateMeter(prior=1.0)  # a CPU replaying 1 element-seed per second
    slow_cpu = behind.sync()
    assert behind.device is not None
    behind.device.invalidate()  # trust nothing: the next sync loads v0's snapshot
    behind.sync(0)
    behind.meters.replay = RateMeter(prior=1e12)
    behind.meters.link = LinkMeter(bandwidth=10.0)  # 10 bytes/s: the snapshot would take ages

    # Act
    slow_link = behind.sync()

    # Assert: each followed its own costs, and both ended on the coordinator's checksum
    assert slow_cpu.method == "snapshot" and slow_link.method == "replay"
    assert slow_cpu.checksum == slow_link.checksum
    assert behind.meters.last is not None and behind.meters.last.action == "replay"
