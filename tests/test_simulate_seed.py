"""`seedfed simulate --seed S` repeats: same seed, same final checksum; another seed, another.

Three short runs of a tiny sentence-transformers model (head scope, so the devices' feature
cache and the run's shared feature store are on) through Flower's Simulation Engine, whose Ray
actors serve the virtual devices in whatever order their timing gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seedfed.cli import app
from seedfed.features import RUN_DIR_NAME
from seedfed.simulate.config import simulation_secret
from tests.fleet_helpers import make_tiny_sentence_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # 2-10 min on the loaded 2 cores


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("seeded")
    return (root, make_tiny_sentence_bert(root / "model"),
            write_sentiment_tsv(root / "data.tsv", n=300))


def _final(inputs: tuple[Path, Path, Path], name: str, seed: int, cache: str = "run") -> dict:
    root, model, data = inputs
    out = root / name
    result = CliRunner().invoke(app, [
        "simulate", "--devices", "3", "--rounds", "3", "--model", str(model),
        "--data", str(data), "--scope", "head", "--set", "steps=2", "--set", "perturbations=4",
        "--set", "batch_size=8", "--set", "eval_size=30", "--set", "eval_every=3", "--set",
        "cpus=2", "--seed", str(seed), "--out", str(out), "--set", f"feature_cache={cache}"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    report = json.loads((out / "report.json").read_text())
    if cache == "run":  # the run shared its features through its own store
        assert (out / RUN_DIR_NAME).is_dir()
    return report


def _segments(store: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in store.rglob("*.seg")}


def test_the_same_seed_gives_the_same_final_checksum_and_another_seed_another(
        inputs: tuple[Path, Path, Path]) -> None:
    # Arrange / Act: the second run of seed 7 reads every row from the first run's store
    first = _final(inputs, "a", seed=7)
    store = inputs[0] / "a" / RUN_DIR_NAME
    encoded = _segments(store)
    again = _final(inputs, "b", seed=7, cache=str(store))
    other = _final(inputs, "c", seed=8)

    # Assert: a warm store encodes nothing and changes no bit of the run
    assert encoded and _segments(store) == encoded
    assert first["final_version"] == again["final_version"] == 3
    assert first["final_checksum"] == again["final_checksum"]
    assert other["final_checksum"] != first["final_checksum"]


def test_a_simulation_secret_is_a_task_secret_derived_from_the_seed_alone() -> None:
    secret = simulation_secret(7)

    assert secret == simulation_secret(7) != simulation_secret(8)
    # a benchmark's repeats of one fleet: one secret per training run
    assert len({secret, simulation_secret(7, 1), simulation_secret(7, 2)}) == 3
    assert len(secret) == 32 and all(c in "0123456789abcdef" for c in secret)
