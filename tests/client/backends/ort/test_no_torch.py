"""The ORT backend, the device core and the REST adapter never import torch (nor transformers,
nor peft, nor flwr): a fresh interpreter with those imports blocked builds the REST device's
config for the ORT backend, loads a bundle, loads a snapshot into a `Device`, trains a plan and
scores, and its scalars are the torch backend's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.sync import state_bytes
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum
from seedfed.shared.protocol.wire import RoundPlan

from tests.client.backends.ort.conftest import head_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCKED = ("torch", "transformers", "peft", "flwr")

SCRIPT = r"""
import importlib.abc, json, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the ORT device must not import it")
        return None

sys.meta_path.insert(0, Block())
args = json.loads(sys.argv[2])
import seedfed.cli  # the command line module itself must not pull torch either
from pathlib import Path
from seedfed.client.backends.base import BackendConfig
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.http_device import DeviceConfig, HttpDevice
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

spec = TaskSpec.from_dict(args["spec"])
rest = HttpDevice(DeviceConfig(url="http://127.0.0.1:9", task_id="t",
                               state_dir=Path(args["state_dir"]), backend="ort",
                               model=args["bundle"], threads=1))
rest._build_device(args["spec"])  # the adapter builds its Device on the ORT backend
dev = Device(spec, "t", backend=BackendConfig(kind="ort", model=args["bundle"], threads=1))
dev.load_snapshot(open(args["snapshot"], "rb").read(), 0, args["checksum"])
data = DeviceData(**args["data"])
train, held = load_device_examples(data)
out = dev.train(RoundPlan.model_validate(args["plan"]), train, data)
print(json.dumps({"scalars": out.scalars.tolist(), "eval": dev.evaluate(held),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
"""


def test_the_ort_device_trains_in_a_process_without_torch(ort_assets: dict[str, Path],
                                                           tmp_path: Path) -> None:
    spec = head_spec(ort_assets["model"])
    v0 = build_model(spec, initialize=True)
    snapshot = tmp_path / "v0.safetensors"
    snapshot.write_bytes(state_bytes(v0.scope))
    plan = RoundPlan(task_id="t", round=1, version=0, seeds=[[1, 2], [3, 4]], lr=0.1,
                     eps=1e-2, batch_size=8, scope="named")
    data = DeviceData(source=str(ort_assets["data"]), partition_id=1, num_partitions=2)
    args = {"spec": spec.to_dict(), "bundle": str(ort_assets["bundle"]),
            "snapshot": str(snapshot), "checksum": checksum(v0.scope), "plan": plan.model_dump(),
            "data": {"source": data.source, "partition_id": 1, "num_partitions": 2},
            "state_dir": str(tmp_path / "rest")}

    run = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BLOCKED), json.dumps(args)],
                         capture_output=True, text=True, timeout=300)
    torch_dev = Device(spec, "t")
    torch_dev.load_snapshot(snapshot.read_bytes(), 0, checksum(v0.scope))
    train, held = load_device_examples(data)
    want = torch_dev.train(plan, train, data)

    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["loaded"] == []
    assert (tmp_path / "rest" / "task.json").is_file()  # the REST adapter built its device
    np.testing.assert_allclose(np.array(got["scalars"], dtype=np.float32), want.scalars,
                               rtol=1e-4, atol=5e-5)
    assert got["eval"][0] == torch_dev.evaluate(held)[0]
