"""`seedfed simulate` at fleet sizes beyond a demo, with the recipe a labelled file names, and
stopping with the first error when every device of a round fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from seedfed.shared.protocol.recipes import RECIPES
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.simulate.config import SimulationConfig
from tests.fleet_helpers import make_tiny_sentence_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fleet")
    return make_tiny_sentence_bert(root / "m"), write_sentiment_tsv(root / "d.tsv", n=12_000)


def _simulate(model: Path, data: Path, out: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, [
        "simulate", "--model", str(model), "--data", str(data), "--engine", "inprocess",
        "--set", "perturbations=4", "--set", "eval_size=50", "--set", "feature_cache=run", "--out",
        str(out), *extra])


def test_a_labelled_file_runs_the_sst2_recipe_whose_figure_the_readme_quotes(
        assets: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: capture the configuration the command builds instead of running it
    model, data = assets
    seen: list[SimulationConfig] = []
    monkeypatch.setattr("seedfed.simulate.progress.run_with_progress", seen.append)
    fleet = RECIPES["sst2"].fleet
    # Act
    result = CliRunner().invoke(app, ["simulate", "--data", str(data), "--model", str(model)])
    # Assert
    assert result.exit_code == 0, result.output
    (config,) = seen
    assert config.recipe == "sst2"
    assert (config.rounds, config.devices, config.devices_per_round) == (
        fleet.rounds, fleet.devices, fleet.devices_per_round) == (300, 20, 20)


def test_a_thousand_devices_train_with_a_hundred_a_round(assets: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    model, data = assets

    result = _simulate(model, data, tmp_path / "run", "--devices", "1000",
                       "--set", "devices_per_round=100", "--rounds", "2")

    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["final_version"] == 2
    assert [r["participants"] for r in report["rounds"]] == [100, 100]
    # the last round's devices were synced and scored, not every device ever sampled
    assert 0 < len(report["devices"]) <= 100


def test_when_every_device_of_a_round_fails_simulate_stops_with_the_first_error(
        assets: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: every device's training raises
    model, data = assets

    def broken(*_args: object, **_kwargs: object) -> None:
        raise OSError("disk full on the device")

    monkeypatch.setattr("seedfed.client.flower_app.train", broken)
    # Act
    result = _simulate(model, data, tmp_path / "run", "--devices", "30",
                       "--set", "devices_per_round=5", "--rounds", "3")
    # Assert
    assert result.exit_code != 0
    said = result.output + repr(result.exception)
    assert "all 5 sampled devices failed" in said and "OSError: disk full on the device" in said
