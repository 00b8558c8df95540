"""`seedfed simulate --recipe NAME --set key=value` and `seedfed recipes`: what the command line
turns into a SimulationConfig, and the one-line refusals, without running a fleet."""

from __future__ import annotations

from pathlib import Path

import pytest
from seedfed.shared.protocol.recipes import RECIPES
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.simulate.config import SimulationConfig


def _configured(monkeypatch: pytest.MonkeyPatch, *args: str) -> SimulationConfig:
    seen: list[SimulationConfig] = []
    monkeypatch.setattr("seedfed.simulate.progress.run_with_progress", seen.append)
    result = CliRunner().invoke(app, ["simulate", *args])
    assert result.exit_code == 0, result.output
    (config,) = seen
    return config


def test_a_recipe_and_its_settings_become_the_config(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    config = _configured(monkeypatch, "--recipe", "preference", "--data", "builtin", "--rounds",
                         "3", "--set", "lr=2", "--set", "eval_size=7", "--set", "personal=off",
                         "--out", str(tmp_path / "run"))

    assert (config.recipe, config.rounds, config.devices, config.devices_per_round) == (
        "preference", 3, 10, 5)
    assert (config.eval_size, config.personal) == (7, "off")
    assert config.overrides == (("hyper.lr", 2.0),)


def test_without_a_recipe_the_data_names_it(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    tastes = _configured(monkeypatch, "--out", str(tmp_path / "a"))
    builtin = _configured(monkeypatch, "--data", "builtin", "--out", str(tmp_path / "b"))

    assert (tastes.recipe, builtin.recipe) == ("tastes", "preference")


@pytest.mark.parametrize("args, words", [
    (["--scope", "sst2"], "say --recipe sst2"),
    (["--scope", "body"], "say --recipe body"),
    (["--set", "nonsense=1"], "no key 'nonsense'"),
    (["--set", "steps=two"], "--set steps: expected an integer"),
    (["--recipe", "imagenet"], "no recipe 'imagenet'"),
    (["--set", "lr=-1"], "hyper.lr must be in"),
])
def test_a_bad_recipe_scope_or_setting_is_one_line(args: list[str], words: str) -> None:
    result = CliRunner().invoke(app, ["simulate", *args])

    assert result.exit_code == 2
    assert words in result.output and len(result.output.strip().splitlines()) == 1


def test_seedfed_recipes_lists_every_recipe() -> None:
    result = CliRunner().invoke(app, ["recipes"])

    assert result.exit_code == 0
    assert all(name in result.output for name in RECIPES)


def test_a_recipe_brings_its_built_in_data_and_a_file_recipe_asks_for_one(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    preference = _configured(monkeypatch, "--recipe", "preference", "--out", str(tmp_path))

    result = CliRunner().invoke(app, ["simulate", "--recipe", "sst2"])

    assert preference.data == "builtin"
    assert result.exit_code == 2 and "--data" in result.output


def test_the_device_option_reaches_the_config(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    config = _configured(monkeypatch, "--device", "cpu", "--out", str(tmp_path / "run"))

    assert config.device == "cpu"


@pytest.mark.parametrize("name, words", [("gpu", "must be auto, cpu, cuda or cuda:N"),
                                         ("cuda", "torch sees no CUDA device")])
def test_a_device_this_machine_lacks_is_one_line(name: str, words: str) -> None:
    import torch

    if name == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(app, ["simulate", "--device", name])

    assert result.exit_code == 2
    assert words in result.output and "--device" in result.output
    assert len(result.output.strip().splitlines()) == 1
