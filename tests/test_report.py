"""report.png (seedfed/simulate/report.py): short ranked device labels, legends clear of the
data, a linear upload scale with the FedAvg ratio written on it, at any fleet and scope size."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pytest

from seedfed.personal_report import DeviceRow
from seedfed.simulate.report import Report, RoundRow, _ratio, _upload, plot, plot_devices

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def _report(devices: int, scope_numel: int = 770, personal: bool = True) -> Report:
    rng = np.random.default_rng(0)
    rounds = [RoundRow(round=r, version=r, participants=20, loss=0.7 - r / 100,
                       accuracy=0.75 + r / 200 if r % 10 == 0 else None, upload_bytes=20 * 2292,
                       download_bytes=1000, upload_bytes_per_device=2292.0,
                       local_accuracy=None, seconds=1.0) for r in range(1, 31)]
    # Flower's node ids are 19-20 digit numbers
    rows = [DeviceRow(int(rng.integers(10**18, 9 * 10**18)), float(rng.random()),
                      float(rng.random()) if personal else None,
                      float(rng.random()) if personal else None) for _ in range(devices)]
    return Report(config={}, task_id="t", scope_numel=scope_numel, scalars_per_device=512,
                  fedavg_bytes_per_round=0, upload_budget_bytes_per_device=2304,
                  rounds=rounds, initial_accuracy=0.74, devices=rows)


@pytest.mark.parametrize("devices", [0, 20, 2_000])
def test_the_report_is_a_png_at_any_fleet_size(devices: int, tmp_path: Path) -> None:
    plot(_report(devices), tmp_path / "report.png")

    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_devices_are_ranked_by_shared_accuracy_with_short_labels_and_the_legend_below(
        ) -> None:
    # Arrange
    report = _report(100)
    fig, ax = plt.subplots()
    # Act
    plot_devices(ax, report.devices)
    fig.canvas.draw()
    # Assert
    shared = np.asarray(ax.lines[0].get_ydata())
    assert shared.tolist() == sorted(d.shared_accuracy for d in report.devices)
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and all(len(t) <= 4 for t in labels)  # ranks, not node ids
    legend = ax.get_legend()
    assert legend is not None
    box = legend.get_window_extent()
    assert box.y1 < ax.get_window_extent().y0  # entirely below the data
    plt.close(fig)


@pytest.mark.parametrize("numel, words", [(770, "0.744 x"), (22_713_216, "1/39,639 x")])
def test_the_upload_panel_is_linear_and_names_the_ratio(numel: int, words: str) -> None:
    fig, ax = plt.subplots()

    _upload(ax, _report(20, scope_numel=numel))

    assert ax.get_xscale() == "linear"
    assert any(f"seedfed = {words} FedAvg" == t.get_text() for t in ax.texts)
    plt.close(fig)


def test_ratios_read_as_a_factor_or_a_fraction() -> None:
    assert (_ratio(0.7442), _ratio(0.1), _ratio(1 / 4000)) == ("0.744 x", "0.100 x", "1/4,000 x")
