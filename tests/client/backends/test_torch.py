"""The torch backend: where it runs the model (`torch_device`) changes no bit of an upload or a
checksum, a device this machine lacks is a one-line error, and its replay-rate calibration
measures what it claims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from seedfed.client.backends.base import BackendConfig, Trained
from seedfed.client.backends.torch import TorchBackend, calibrate_replay_rate, resolve_torch_device
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.sync import state_bytes
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.stream import torch_stream
from seedfed.shared.protocol.errors import UserError
from seedfed.shared.protocol.npzo import LogEntry, update_coefficients
from seedfed.shared.protocol.task import Hyper, TaskSpec
from seedfed.shared.protocol.wire import RoundPlan
from typer.testing import CliRunner

from seedfed.cli import app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _round(spec: TaskSpec, data: DeviceData, backend: BackendConfig,
           ) -> tuple[Trained, str, str]:
    """One device from v0: a round's upload, then the checksum after replaying two entries,
    and the v0 checksum it loaded."""
    v0 = build_model(spec, initialize=True)
    device = Device(spec, "t", backend=backend)
    device.load_snapshot(state_bytes(v0.scope), 0, checksum(v0.scope))
    plan = RoundPlan(task_id="t", round=1, version=0, seeds=[[1, 2, 3], [4, 5, 6]], lr=1e-3,
                     eps=1e-2, batch_size=8, scope=spec.scope)
    trained = device.train(plan, load_device_examples(data)[0], data)
    coefs = [tuple(float(c) for c in update_coefficients(trained.scalars[i], 1e-3, 3))
             for i in range(2)]
    entries = [LogEntry("t", v, (7 + v, 9 + v, 11 + v), coefs[v]) for v in range(2)]
    synced = device.sync(2, entries=entries)
    assert synced.method == "replay"
    return trained, synced.checksum, checksum(v0.scope)


@pytest.fixture(scope="module")
def spec_and_data(fleet_assets: tuple[Path, Path]) -> tuple[TaskSpec, DeviceData]:
    model, data = fleet_assets
    spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"), max_seq_len=16,
                    hyper=Hyper(lr=1e-3, eps=1e-2, steps=2, perturbations=3, batch_size=8))
    return spec, DeviceData(source=str(data), partition_id=0, num_partitions=2, alpha=1.0)


def test_cpu_and_the_torch_ops_stream_give_the_defaults_upload_bits_and_checksums(
        spec_and_data: tuple[TaskSpec, DeviceData]) -> None:
    spec, data = spec_and_data
    default = _round(spec, data, BackendConfig())

    on_cpu = _round(spec, data, BackendConfig(torch_device="cpu"))
    auto = _round(spec, data, BackendConfig(torch_device="auto"))
    with torch_stream():  # SEEDFED_STREAM=torch: the stream in torch integer ops
        torch_ops = _round(spec, data, BackendConfig(torch_device="cpu"))

    assert np.abs(default[0].scalars).max() > 0
    for other in (on_cpu, auto, torch_ops):
        assert other[0].scalars.tobytes() == default[0].scalars.tobytes()
        assert other[0].loss == default[0].loss
        assert other[1:] == default[1:]


def test_the_backend_runs_where_it_was_told(spec_and_data: tuple[TaskSpec, DeviceData]) -> None:
    backend = TorchBackend(spec_and_data[0], torch_device="cpu")

    assert backend.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in backend.bundle.model.parameters())


@NO_CUDA
def test_auto_is_the_cpu_without_cuda_and_cuda_is_a_user_error() -> None:
    assert resolve_torch_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="no CUDA device.*--device cpu"):
        resolve_torch_device("cuda")


def test_a_ternary_task_runs_on_the_cpu() -> None:
    assert resolve_torch_device("auto", ternary=True) == torch.device("cpu")
    with pytest.raises(UserError, match="--device cpu"):
        resolve_torch_device("cuda:0", ternary=True)


@NO_CUDA
def test_seedfed_device_on_cuda_without_cuda_is_one_line_saying_what_to_do(
        tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["device", "--url", "http://127.0.0.1:9", "--task", "t",
                                 "--data", "builtin", "--state-dir", str(tmp_path / "d"),
                                 "--device", "cuda"])

    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device: ")
    assert "no CUDA device" in lines[0] and "--device cpu" in lines[0]
    assert not (tmp_path / "d").exists()  # nothing contacted, nothing written


def test_an_unknown_device_name_is_refused() -> None:
    with pytest.raises(ValueError, match="torch_device"):
        BackendConfig(torch_device="tpu")


def test_calibration_measures_a_plausible_replay_rate_on_this_cpu() -> None:
    one = calibrate_replay_rate([("w", 1 << 16)])
    many = calibrate_replay_rate([(f"t{i}", 256) for i in range(256)])  # same size, 256 tensors

    assert 1e5 < one < 1e12 and 1e4 < many < 1e12
    with pytest.raises(ValueError, match="at least one"):
        calibrate_replay_rate([])
