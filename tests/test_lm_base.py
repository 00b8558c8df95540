"""`seedfed lm-base`: a small Llama pretrained on a data file's sentences, cached by its
settings, and usable as a ternary distillation's teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seedfed.cli import app
from tests.fleet_helpers import write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_base_is_made_once_and_then_reused(tmp_path: Path) -> None:
    # Arrange
    data = write_sentiment_tsv(tmp_path / "data.tsv", n=120)
    out = tmp_path / "base"
    args = ["lm-base", "--data", str(data), "--out", str(out), "--sentences", "64",
            "--epochs", "1", "--threads", "1"]
    # Act
    first = CliRunner().invoke(app, args)
    made = (out / "model.safetensors").stat().st_mtime_ns
    second = CliRunner().invoke(app, args)
    # Assert
    assert first.exit_code == 0, first.output
    assert second.exit_code == 0, second.output
    assert (out / "model.safetensors").stat().st_mtime_ns == made  # reused, not rebuilt
    meta = json.loads((out / "lm_base.json").read_text())
    assert meta["model_kind"] == "causal_lm" and meta["sentences"] == 64
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_a_ternary_twin_distils_from_the_base_and_a_missing_teacher_is_refused(
        tmp_path: Path) -> None:
    # Arrange
    data = write_sentiment_tsv(tmp_path / "data.tsv", n=120)
    base = tmp_path / "base"
    made = CliRunner().invoke(app, ["lm-base", "--data", str(data), "--out", str(base),
                                    "--sentences", "64", "--epochs", "1"])
    assert made.exit_code == 0, made.output
    ternarize = ["ternarize", "--model-kind", "causal_lm", "--data", str(data), "--out",
                 str(tmp_path / "t"), "--threads", "1"]
    # Act
    twin = CliRunner().invoke(app, [*ternarize, "--teacher", str(base), "--epochs", "1"])
    missing = CliRunner().invoke(app, [*ternarize, "--teacher", str(tmp_path / "missing")])
    # Assert
    assert twin.exit_code == 0, twin.output
    meta = json.loads((tmp_path / "t" / "ternary.json").read_text())
    assert meta["config"]["sentences"] == 64 and "pretrain_seconds" in meta
    assert missing.exit_code == 2
    assert "lm-base" in missing.output
