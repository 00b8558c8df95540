"""`seedfed simulate --format ternary` end to end (in-process grid), then `seedfed evaluate
--run DIR --version V` on what it stored.

A tiny sentence-transformers BERT, 3 devices, 6 rounds (mask epochs every 5 versions, so the
devices cross one epoch start, from the recipe's head epoch to its latent epoch, and load the
published snapshot there), the ternary recipe otherwise. The devices hold the packed model;
their final checksums must be the coordinator's, and the version scores the CLI reads back
must be the ones the run reported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from seedfed.client.recipes import ternary_recipe
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.task import TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.simulate import recipe_fleet
from tests.fleet_helpers import make_tiny_sentence_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

DEVICES, ROUNDS, EVAL = 3, 6, 40


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sim-ternary")
    model = make_tiny_sentence_bert(root / "model")
    data = write_sentiment_tsv(root / "data.tsv", n=400)
    out = root / "run"
    result = CliRunner().invoke(app, [
        "simulate", "--devices", str(DEVICES), "--rounds", str(ROUNDS), "--model", str(model),
        "--data", str(data), "--format", "ternary", "--engine", "inprocess", "--personal", "off",
        "--eval-size", str(EVAL), "--perturbations", "2", "--out", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return out


def _score(run_dir: Path, *args: str) -> float:
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run_dir), "--limit", str(EVAL),
                                      *args])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return float(result.output.strip().splitlines()[-1].split(":")[1])


def test_without_rounds_the_ternary_recipe_sets_rounds_and_devices_per_round() -> None:
    recipe = ternary_recipe("unused", sst2=True)

    assert recipe_fleet("train.tsv", "unused", "ternary") == (recipe.rounds, recipe.per_round)
    assert recipe_fleet("train.tsv", None, "fp32") == (30, None)


def test_the_run_trains_a_ternary_classifier_with_packed_devices(run_dir: Path) -> None:
    report = json.loads((run_dir / "report.json").read_text())
    spec = TaskSpec.from_dict(json.loads((run_dir / "task.json").read_text()))

    assert spec.scope == "ternary" and spec.model_kind == "seq_cls"
    assert [r["version"] for r in report["rounds"]] == list(range(1, ROUNDS + 1))
    # every device replayed (or loaded) its way to the coordinator's final state, bit for bit
    assert set(report["device_checksums"].values()) == {report["final_checksum"]}
    # the epoch start at v5 ships every device the snapshot, as joining did in round 1 (inside
    # an epoch a device replays, unless its catch-up rates make a snapshot cheaper)
    down = [r["download_bytes"] for r in report["rounds"]]
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{run_dir / 'coordinator.db'}",
                                      store_dir=run_dir / "store"))
    try:
        snapshot_v5 = len(coord.snapshot(report["task_id"], 5, "ternary")[0])
    finally:
        coord.close()
    # rounds 4 and 5 plan alike (head epoch, 512 seeds); round 5's sync is a snapshot per
    # device instead of round 4's log entries (fewer bytes than the snapshots at this size)
    assert down[4] - down[3] > 0.25 * DEVICES * snapshot_v5, (down, snapshot_v5)
    assert down[5] < down[3] / 4, "v6 (a latent epoch) plans 4 seeds and replays"


def test_evaluate_scores_version_zero_and_the_last_version_as_the_run_did(run_dir: Path) -> None:
    report = json.loads((run_dir / "report.json").read_text())

    v0 = _score(run_dir, "--version", "0")
    last = _score(run_dir, "--version", str(report["final_version"]))
    latest_snapshot = _score(run_dir)  # snapshots/v6.safetensors: the packed snapshot

    assert v0 == pytest.approx(report["initial_accuracy"])
    assert last == pytest.approx(report["rounds"][-1]["accuracy"])
    assert latest_snapshot == pytest.approx(last)


def test_evaluate_refuses_a_version_the_run_never_made(run_dir: Path) -> None:
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run_dir), "--version", "99"])

    assert result.exit_code != 0 and "not in 0..6" in result.output
