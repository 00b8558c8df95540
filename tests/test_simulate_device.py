"""`seedfed simulate --device`: the virtual devices' torch backend on a chosen torch device.

What CI can prove without a GPU: the stream's torch-ops path (the one a CUDA tensor takes,
`shared.model.stream.torch_stream`) run on the CPU ends a whole simulation on the checksum of
the C-kernel path, and `--device cpu` is the default's run bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from seedfed.shared.model.stream import torch_stream
from typer.testing import CliRunner

from seedfed.cli import app
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _final_checksum(root: Path, name: str, *extra: str) -> str:
    result = CliRunner().invoke(app, [
        "simulate", "--engine", "inprocess", "--devices", "2", "--rounds", "2", "--model",
        str(root / "model"), "--data", str(root / "data.tsv"), "--scope", "lora", "--set",
        "steps=2", "--set", "perturbations=2", "--set", "batch_size=8", "--set",
        "eval_size=20", "--set", "lr=1e-3", "--set", "eps=1e-2", "--out", str(root / name),
        *extra])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return str(json.loads((root / name / "report.json").read_text())["final_checksum"])


def test_the_torch_stream_and_the_cpu_device_end_on_the_default_checksum(
        tmp_path: Path) -> None:
    # Arrange
    make_tiny_bert(tmp_path / "model")
    write_sentiment_tsv(tmp_path / "data.tsv", n=200)

    # Act
    default = _final_checksum(tmp_path, "default")
    cpu = _final_checksum(tmp_path, "cpu", "--device", "cpu")
    with torch_stream():
        torch_ops = _final_checksum(tmp_path, "torch-ops", "--device", "cpu")

    # Assert
    assert cpu == default
    assert torch_ops == default
