"""`seedfed simulate --format ternary` end to end (in-process grid), then `seedfed evaluate
--run DIR --version V` on what it stored; and the TerMeZO variant the recipe replaced
(alternate mask epochs) through the same round code.

A tiny sentence-transformers BERT, 3 devices, 6 rounds. The recipe's run trains the float head
on the packed ternary encoder: the devices hold the packed model, their final checksums must be
the coordinator's, the encoder must stay the base, and the version scores the CLI reads back
must be the ones the run reported. The alternate run crosses one mask epoch start (epochs of 5
versions: v5 starts the first latent epoch), where every device loads the published snapshot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load as load_safetensors
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.protocol.recipes import RECIPES, TERNARY_HYPER
from seedfed.shared.protocol.task import TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.simulate.config import SimulationConfig
from seedfed.simulate.driver import run
from tests.fleet_helpers import make_tiny_sentence_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

DEVICES, ROUNDS, EVAL = 3, 6, 40
#: the TerMeZO variant: even epochs the head alone at the recipe's lr and seeds, odd epochs
#: the threshold mask's latents at 2 seeds a step
ALTERNATE: dict[str, Any] = {"selection": "threshold", "fraction": 0.05, "epoch_rounds": 5,
                             "alternate": True, "head_lr": TERNARY_HYPER.lr,
                             "head_perturbations": TERNARY_HYPER.perturbations}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sim-ternary-inputs")
    return (make_tiny_sentence_bert(root / "model"),
            write_sentiment_tsv(root / "data.tsv", n=400))


@pytest.fixture(scope="module")
def run_dir(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, data = inputs
    out = tmp_path_factory.mktemp("sim-ternary") / "run"
    result = CliRunner().invoke(app, [
        "simulate", "--devices", str(DEVICES), "--rounds", str(ROUNDS), "--model", str(model),
        "--data", str(data), "--format", "ternary", "--engine", "inprocess", "--set",
        "personal=off", "--set", f"eval_size={EVAL}", "--set", "perturbations=8", "--out",
        str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    (out / "cli.txt").write_text(result.output)
    return out


@pytest.fixture(scope="module")
def alternate_dir(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, data = inputs
    out = tmp_path_factory.mktemp("sim-ternary-alternate") / "run"
    # sync_every=1: every round's sync bytes
    run(SimulationConfig(out=out, devices=DEVICES, rounds=ROUNDS, model=str(model),
                         data=str(data), format="ternary", engine="inprocess", personal="off",
                         eval_size=EVAL, sync_every=1, overrides=(
                             ("hyper.lr", 3.3e-4), ("hyper.perturbations", 2),
                             ("hyper.batch_size", 8),
                             *((f"scope_options.{k}", v) for k, v in ALTERNATE.items()))))
    return out


def _open(run_dir: Path) -> Coordinator:
    return Coordinator.open(Settings(database_url=f"sqlite:///{run_dir / 'coordinator.db'}",
                                     store_dir=run_dir / "store"))


def _score(run_dir: Path, *args: str) -> float:
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run_dir), "--limit", str(EVAL),
                                      *args])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return float(result.output.strip().splitlines()[-1].split(":")[1])


def test_without_rounds_the_ternary_recipe_sets_rounds_and_devices_per_round() -> None:
    fleet = RECIPES["ternary"].fleet

    ternary = SimulationConfig(out=Path("unused"), data="train.tsv", model="unused",
                               format="ternary")
    head = SimulationConfig(out=Path("unused"), data="train.tsv", format="fp32")

    assert ternary.recipe == "ternary"
    assert (ternary.rounds, ternary.devices_per_round) == (fleet.rounds, fleet.devices_per_round)
    assert (head.rounds, head.devices_per_round) == (300, 20)  # the SST-2 head recipe's


def test_the_recipe_trains_the_head_of_a_ternary_classifier_on_packed_devices(
        run_dir: Path) -> None:
    report = json.loads((run_dir / "report.json").read_text())
    spec = TaskSpec.from_dict(json.loads((run_dir / "task.json").read_text()))
    coord = _open(run_dir)
    try:
        first, last = (load_safetensors(coord.snapshot(report["task_id"], v, "ternary")[0])
                       for v in (0, ROUNDS))
    finally:
        coord.close()

    assert spec.scope == "ternary" and spec.model_kind == "seq_cls"
    assert "expected duration" in (run_dir / "cli.txt").read_text()
    assert [r["version"] for r in report["rounds"]] == list(range(1, ROUNDS + 1))
    # every device replayed its way to the coordinator's final state, bit for bit
    assert set(report["device_checksums"].values()) == {report["final_checksum"]}
    moved = {k for k in first if not first[k].equal(last[k])}
    assert moved and all("classifier" in k for k in moved), moved  # the encoder is the base's


def test_alternate_mask_epochs_ship_the_epoch_start_snapshot(alternate_dir: Path) -> None:
    report = json.loads((alternate_dir / "report.json").read_text())
    down = [r["download_bytes"] for r in report["rounds"]]
    coord = _open(alternate_dir)
    try:
        snapshot_v5 = len(coord.snapshot(report["task_id"], 5, "ternary")[0])
    finally:
        coord.close()

    assert set(report["device_checksums"].values()) == {report["final_checksum"]}
    # rounds 4 and 5 plan alike (head epoch, the recipe's seeds); round 5's sync is a snapshot
    # per device instead of round 4's log entries (fewer bytes than the snapshots at this size)
    assert down[4] - down[3] > 0.25 * DEVICES * snapshot_v5, (down, snapshot_v5)
    assert down[5] < down[3] / 4, "v6 (a latent epoch) plans 2 seeds and replays"


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
