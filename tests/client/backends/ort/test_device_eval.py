"""`seedfed evaluate --device DIR` on an ORT device's state directory (client/device_eval.py):
its shared state scored on its bundle, as the device scores it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from seedfed.client.data import load_labelled
from seedfed.client.device_data import DeviceData
from seedfed.client.device_eval import evaluate_device
from seedfed.client.http_device import META_FILE, TASK_FILE, DeviceConfig, HttpDevice
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.protocol.errors import ChecksumMismatchError
from typer.testing import CliRunner

from seedfed.cli import app
from tests.client.backends.ort.conftest import head_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained_dir(ort_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                ) -> tuple[Path, float]:
    """An ORT device's state directory after two rounds, and its own score of the data."""
    root = tmp_path_factory.mktemp("ort-eval")
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{root / 'c.db'}",
                                      store_dir=root / "store"))
    task, join = coord.create_task_with_token(head_spec(ort_assets["model"]), quorum=50)
    with TestClient(create_app(runtime=coord.rt)) as client:
        dev = HttpDevice(DeviceConfig(
            url="http://testserver", task_id=task, join_token=join, state_dir=root / "o",
            backend="ort", model=str(ort_assets["bundle"]),
            data=DeviceData(source=str(ort_assets["data"])), threads=1), client=client)
        dev.enroll()
        for _ in range(2):
            dev.train_and_upload(coord.open_round(task))
            coord.close_round(task)
        dev.sync()
        own, _ = dev.load_device().evaluate(load_labelled(ort_assets["data"]))
    coord.close()
    return root / "o", own


def test_an_ort_devices_directory_scores_as_the_device_does(
        trained_dir: tuple[Path, float], ort_assets: dict[str, Path]) -> None:
    state_dir, own = trained_dir

    result = evaluate_device(state_dir, ort_assets["data"])

    assert (state_dir / TASK_FILE).is_file()
    assert result.version == 2
    assert result.scores.shared == result.scores.personal == pytest.approx(own)
    assert not result.personal_trained and result.scores.local is None


def test_a_directory_without_task_json_or_bundle_names_the_option(
        trained_dir: tuple[Path, float], ort_assets: dict[str, Path], tmp_path: Path) -> None:
    # Arrange: the directory as an ORT device that did not record its bundle left it
    state_dir, own = trained_dir
    old = tmp_path / "old"
    old.mkdir()
    meta = json.loads((state_dir / META_FILE).read_text())
    (old / META_FILE).write_text(json.dumps({k: v for k, v in meta.items()
                                             if k not in ("backend", "bundle")}))
    (old / "state.safetensors").write_bytes((state_dir / "state.safetensors").read_bytes())
    # Act / Assert
    with pytest.raises(FileNotFoundError, match="--model BUNDLE"):
        evaluate_device(old, ort_assets["data"])
    named = evaluate_device(old, ort_assets["data"], model=str(ort_assets["bundle"]))
    assert named.scores.shared == pytest.approx(own)


def test_a_state_that_does_not_match_its_checksum_is_refused(
        trained_dir: tuple[Path, float], ort_assets: dict[str, Path], tmp_path: Path) -> None:
    state_dir, _ = trained_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    meta = json.loads((state_dir / META_FILE).read_text())
    (bad / META_FILE).write_text(json.dumps({**meta, "checksum": "0" * 64}))
    (bad / "state.safetensors").write_bytes((state_dir / "state.safetensors").read_bytes())

    with pytest.raises(ChecksumMismatchError, match="does not hash"):
        evaluate_device(bad, ort_assets["data"])


def test_the_evaluate_command_scores_an_ort_device(
        trained_dir: tuple[Path, float], ort_assets: dict[str, Path]) -> None:
    state_dir, own = trained_dir

    result = CliRunner().invoke(app, ["evaluate", "--device", str(state_dir), "--data",
                                      str(ort_assets["data"])])

    assert result.exit_code == 0, result.output
    assert "device at v2" in result.output
    assert result.output.strip().splitlines()[-1] == f"accuracy: {own:.4f}"
