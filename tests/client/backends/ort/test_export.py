"""What the exporter refuses, and the command line around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from seedfed.client.backends.ort.bundle import BundleError, Manifest
from seedfed.client.backends.ort.export import export_bundle
from seedfed.shared.protocol.task import TaskSpec
from typer.testing import CliRunner

from seedfed.cli import app
from tests.client.backends.ort.conftest import head_spec, make_sentence_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sentence_model(tmp_path_factory.mktemp("m") / "model")


def test_a_scope_inside_the_encoder_is_refused_before_any_export(model: Path,
                                                                 tmp_path: Path) -> None:
    body = TaskSpec(model_path=str(model), scope="named",
                    scope_options={"patterns": ["layer.1.output.dense"]}, max_seq_len=16)

    with pytest.raises(BundleError, match="inside the encoder"):
        export_bundle(body, tmp_path / "b")

    assert not (tmp_path / "b").exists()


def test_lora_is_refused(model: Path, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="non-LoRA"):
        export_bundle(TaskSpec(model_path=str(model), scope="lora"), tmp_path / "b")


def test_the_cli_reports_a_refused_export_as_a_bad_parameter(model: Path,
                                                             tmp_path: Path) -> None:
    task = tmp_path / "task.json"
    task.write_text(json.dumps(TaskSpec(model_path=str(model), scope="lora").to_dict()))

    result = CliRunner().invoke(app, ["ort-export", "--task", str(task), "--out",
                                      str(tmp_path / "b")])

    assert result.exit_code == 2 and "non-LoRA" in result.output


def test_the_ort_device_needs_its_bundle() -> None:
    result = CliRunner().invoke(app, ["device", "--url", "http://x", "--task", "t",
                                      "--data", "builtin", "--backend", "ort"])

    assert result.exit_code == 2 and "--model BUNDLE" in result.output


def test_a_manifest_lists_the_heads_tensors_in_canonical_order(
        ort_assets: dict[str, Path]) -> None:
    manifest = Manifest.load(ort_assets["bundle"])

    assert [t.name for t in manifest.tensors] == ["classifier.bias", "classifier.weight"]
    assert [t.shape for t in manifest.tensors] == [(2,), (2, 32)]
    manifest.check_spec(head_spec(ort_assets["model"], lr=3.0))  # hyperparameters are free
