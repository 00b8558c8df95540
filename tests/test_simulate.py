"""`seedfed simulate` end to end with a tiny model, on both engines.

One short simulation (3 devices, 2 rounds) through the command line, on Flower's Simulation
Engine (Ray) with the fp32 format and on the in-process grid with an int8 shared model, then
checks of what it left in the run directory against the coordinator's own records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from seedfed.client.evaluate import evaluate
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

DEVICES, ROUNDS, STEPS, PERTURBATIONS = 3, 2, 2, 2


#: (engine, published format, scope): LoRA on the fp32 model through Ray; the head on an int8
#: shared model in process.
RUNS = [("flower", "fp32", "lora"), ("inprocess", "int8", "head")]


@pytest.fixture(scope="module", params=RUNS, ids=["-".join(r) for r in RUNS])
def run_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine, fmt, scope = request.param
    root = tmp_path_factory.mktemp(f"sim-{engine}")
    model = make_tiny_bert(root / "model")
    data = write_sentiment_tsv(root / "data.tsv", n=400)
    out = root / "run"
    result = CliRunner().invoke(app, [
        "simulate", "--devices", str(DEVICES), "--rounds", str(ROUNDS), "--set",
        f"steps={STEPS}", "--set", f"perturbations={PERTURBATIONS}", "--model", str(model),
        "--data", str(data), "--set", "run.alpha=1.0", "--scope", scope, "--set", "eval_size=40",
        "--set", "batch_size=8", "--set", "lr=1e-3", "--set", "eps=1e-2", "--engine", engine,
        "--format", fmt, "--out", str(out), "--set", "eval_every=1"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "seedfed simulate" in result.output  # the summary table was printed
    assert "expected duration" in result.output  # measured before the first round
    return out


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def test_report_has_the_per_round_and_top_level_figures(run_dir: Path) -> None:
    report = _report(run_dir)

    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert [r["version"] for r in rounds] == list(range(1, ROUNDS + 1))
    for r in rounds:
        assert r["participants"] == DEVICES
        assert r["loss"] > 0 and 0 <= r["accuracy"] <= 1
        assert r["upload_bytes"] > 0 and r["download_bytes"] > 0
    assert report["fedavg_bytes_per_round"] == 2 * 4 * report["scope_numel"] * DEVICES
    assert len(report["final_checksum"]) == 64


def test_upload_per_device_stays_within_four_bytes_per_scalar_plus_256(run_dir: Path) -> None:
    report = _report(run_dir)

    budget = 4 * STEPS * PERTURBATIONS + 256
    assert report["upload_budget_bytes_per_device"] == budget
    assert all(r["upload_bytes_per_device"] <= budget for r in report["rounds"])
    assert report["upload_ratio_to_fedavg"] < 1


def test_final_state_matches_the_coordinator_and_every_device(run_dir: Path) -> None:
    report = _report(run_dir)
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{run_dir / 'coordinator.db'}",
                                      store_dir=run_dir / "store"))
    try:
        status = coord.task_status(report["task_id"])
        data, chk = coord.snapshot(report["task_id"], status.version)
    finally:
        coord.close()

    snap = run_dir / "snapshots" / f"v{ROUNDS}.safetensors"
    assert status.version == report["final_version"] == ROUNDS
    assert chk == status.checksum == report["final_checksum"]
    assert hashlib.sha256(snap.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert set(report["device_checksums"].values()) == {status.checksum}
    assert len(report["device_checksums"]) == DEVICES


def test_run_directory_is_scored_by_seedfed_evaluate(run_dir: Path) -> None:
    spec = TaskSpec.from_dict(json.loads((run_dir / "task.json").read_text()))

    score = evaluate(run_dir / "test.tsv", run=run_dir, limit=50)

    config = json.loads((run_dir / "report.json").read_text())["config"]
    assert spec.format == config["format"]
    assert spec.scope == ("named" if config["scope"] == "head" else config["scope"])
    assert score.examples == 50 and 0 <= score.accuracy <= 1


def test_plot_is_a_png(run_dir: Path) -> None:
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- personalization: the per-device taste task, with and without personal parts ------------
@pytest.fixture(scope="module")
def taste_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Two in-process runs of the per-device taste task on the tiny model, the same seeds:
    every device with a residual personal part, and none."""
    from seedfed.simulate.config import SimulationConfig
    from seedfed.simulate.driver import run

    root = tmp_path_factory.mktemp("sim-tastes")
    model = make_tiny_bert(root / "model")
    reports = {}
    for personal in ("residual", "off"):
        config = SimulationConfig(out=root / personal, devices=DEVICES, rounds=ROUNDS,
                                  overrides=(("hyper.steps", STEPS),
                                             ("hyper.perturbations", PERTURBATIONS),
                                             ("hyper.batch_size", 8)), model=str(model),
                                  eval_size=40, engine="inprocess",
                                  eval_every=1, personal=personal)
        reports[personal] = run(config).to_dict()
        reports[personal]["png"] = (root / personal / "report.png").read_bytes()[:8]
    return reports


def test_the_default_task_is_the_per_device_taste_task() -> None:
    from seedfed.simulate.config import SimulationConfig

    config = SimulationConfig(out=Path("unused"))

    assert (config.data, config.personal, config.recipe) == ("tastes", "residual", "tastes")


def test_the_taste_task_takes_its_recipe_and_fleet_the_single_taste_demo_its_own() -> None:
    from seedfed.shared.protocol import recipes

    from seedfed.simulate.config import SimulationConfig, task_spec_for

    tastes = SimulationConfig(out=Path("unused"))
    builtin = SimulationConfig(out=Path("unused"), data="builtin")

    assert task_spec_for(tastes, ("no", "yes")).hyper == recipes.TASTES_HYPER
    assert task_spec_for(tastes, ("no", "yes")).step_scales == recipes.HEAD_STEP_SCALES
    builtin_spec = task_spec_for(builtin, ("no", "yes"))
    assert builtin_spec.hyper == recipes.PREFERENCE_HYPER and builtin_spec.step_scales == ()
    assert (tastes.rounds, tastes.devices, tastes.devices_per_round) == (30, 20, 20)
    assert (builtin.recipe, builtin.devices, builtin.devices_per_round) == ("preference", 10, 5)


def test_the_report_lists_every_device_shared_personal_and_local_accuracy(
        taste_runs: dict[str, dict]) -> None:
    report = taste_runs["residual"]

    devices = report["devices"]
    assert len(devices) == DEVICES
    for d in devices:
        assert set(d) == {"device", "shared_accuracy", "personal_accuracy", "local_accuracy"}
        assert all(0 <= d[k] <= 1 for k in d if k != "device")
    summary = report["personalization"]
    assert summary["devices"] == DEVICES
    assert 0 <= summary["personal_accuracy_worst_decile"] <= summary["personal_accuracy_mean"]
    assert report["rounds"][-1]["personal_accuracy_mean"] == pytest.approx(
        summary["personal_accuracy_mean"])
    assert report["png"] == b"\x89PNG\r\n\x1a\n"


def test_personalization_leaves_the_upload_bytes_unchanged(
        taste_runs: dict[str, dict]) -> None:
    personal, plain = taste_runs["residual"], taste_runs["off"]

    # (each run's task has its own secret, so seeds and the shared model's values differ
    # run to run; tests/client/test_personal_device.py shows the scalars are identical)
    assert [r["upload_bytes"] for r in personal["rounds"]] == [
        r["upload_bytes"] for r in plain["rounds"]]
    assert [r["upload_bytes_per_device"] for r in personal["rounds"]] == [
        r["upload_bytes_per_device"] for r in plain["rounds"]]
    assert plain["personalization"] is None
    assert all(d["personal_accuracy"] is None for d in plain["devices"])


@pytest.mark.parametrize("ratio, words", [
    (0.745, "ratio 0.745 (1.3x less)"), (1.95e-5, "ratio 1.95e-05 (51,282x less)"),
    (2.5, "ratio 2.5 (2.5x more)"), (1.0, "ratio 1 (the same)"), (0.05, "ratio 0.05 (20x less)"),
])
def test_the_upload_ratio_is_printed_as_a_person_reads_it(ratio: float, words: str) -> None:
    from seedfed.simulate.progress import ratio_words

    assert ratio_words(ratio) == words
