"""`seedfed simulate` on a causal LM's directory: the model kind from its config, label words
for labelled data by default, the keyboard recipe on Flower's Simulation Engine with personal
parts, and the final state as the devices hold it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seedfed.cli import app
from tests.fleet_helpers import write_sentiment_tsv, write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sim-lm")
    return (write_tiny_llama(root / "llama", tokenizer=True),
            write_sentiment_tsv(root / "data.tsv", n=300))


def _simulate(out: Path, model: Path, data: Path, *extra: str) -> dict:
    result = CliRunner().invoke(app, [
        "simulate", "--model", str(model), "--data", str(data), "--devices", "3", "--rounds",
        "2", "--set", "eval_size=30", "--set", "perturbations=2", "--out", str(out), *extra])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return json.loads((out / "report.json").read_text())


def test_a_causal_lm_on_labelled_data_trains_label_words(inputs: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    # Arrange
    model, data = inputs
    # Act
    report = _simulate(tmp_path / "run", model, data, "--engine", "inprocess")
    # Assert
    task = json.loads((tmp_path / "run" / "task.json").read_text())
    assert task["model_kind"] == "causal_lm"
    assert task["objective"]["kind"] == "label_words"
    assert report["config"]["recipe"] == "lm-labels"
    assert report["final_version"] == 2 and (tmp_path / "run" / "report.png").is_file()


def test_the_keyboard_recipe_runs_on_flower_with_personal_parts(inputs: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    # Arrange
    model, data = inputs
    # Act
    report = _simulate(tmp_path / "run", model, data, "--recipe", "lm-keyboard", "--engine",
                       "flower", "--format", "int4")
    # Assert: every device reported its personalized next-word scores
    task = json.loads((tmp_path / "run" / "task.json").read_text())
    assert (task["objective"]["kind"] if "objective" in task else "next_token") == "next_token"
    assert task["format"] == "int4" and task["scope"] == "lora"
    last = report["rounds"][-1]
    assert last["personal_accuracy_mean"] is not None and report["personalization"]
