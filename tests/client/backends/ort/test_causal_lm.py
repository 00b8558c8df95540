"""A causal LM's LoRA scope on the ORT backend (`lm.onnx`, the adapters as graph inputs)
against the torch backend, each in a `Device`, for both causal-LM objectives: the same token
ids, the same scalars from the same snapshot and data, the same checksum after replaying the
round's log entry, and a device round in a process without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors
from seedfed.client.backends.base import BackendConfig
from seedfed.client.backends.ort.backend import OrtBackend
from seedfed.client.backends.ort.bundle import CAUSAL_LM_LORA, BundleError, Manifest
from seedfed.client.backends.ort.runtime import OrtLM, OrtModel, open_model
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.objective_batches import task_batches
from seedfed.client.sync import state_bytes
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.hf import load_tokenizer
from seedfed.shared.protocol.aggregate import build_entry
from seedfed.shared.protocol.npzo import np_checksum, step_probes
from seedfed.shared.protocol.task import Hyper, TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

from tests.client.backends.ort.test_no_torch import BLOCKED
from tests.fleet_helpers import write_sentiment_tsv, write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

OBJECTIVES = ("label_words", "next_token")
SEEDS = [[11, 12, 13], [2**53 - 1, 5, 7]]
#: The engines' losses of one probe agree to a few float32 ulps (measured: <= 2, LOSS_RTOL
#: is ~10). A scalar is a difference of two losses over 2 eps, so each ulp of the loss moves
#: it by ulp(L) / (2 eps): 2.4e-5 for the next-token loss (~4.6) at eps 1e-2, while the tiny
#: model's scalars are ~1e-3. Scalars are compared to LOSS_ULPS of that (measured: <= 3),
#: plus RTOL.
LOSS_RTOL, LOSS_ULPS, RTOL = 1e-6, 6, 1e-4


def assert_scalars_agree(got: np.ndarray, want: np.ndarray, loss: float, eps: float) -> None:
    atol = LOSS_ULPS * float(np.spacing(np.float32(loss))) / (2 * eps)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol)


def lm_spec(model: Path, objective: str, **hyper: object) -> TaskSpec:
    settings = {"lr": 0.05, "eps": 1e-2, "steps": 2, "perturbations": 3, "batch_size": 4,
                **hyper}
    return TaskSpec(model_path=str(model), model_kind="causal_lm", scope="lora",
                    objective={"kind": objective},  # type: ignore[arg-type]
                    hyper=Hyper(**settings),  # type: ignore[arg-type]
                    max_seq_len=24)


def _plan(one_sided: bool = False, clip: float | None = None) -> RoundPlan:
    return RoundPlan(task_id="t", round=1, version=0, seeds=SEEDS, lr=0.05, eps=1e-2,
                     batch_size=4, scope="lora", one_sided=one_sided, clip=clip)


@pytest.fixture(scope="module")
def lm_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{model, data, label_words, next_token}: a tiny Llama with its character tokenizer and
    one LoRA bundle per objective (exported once: ~10 s each with dynamo)."""
    import torch
    from seedfed.client.backends.ort.export import export_bundle

    root = tmp_path_factory.mktemp("ort-lm")
    model = write_tiny_llama(root / "model", tokenizer=True)
    assets = {"model": model, "data": write_sentiment_tsv(root / "data.tsv")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for objective in OBJECTIVES:
            export_bundle(lm_spec(model, objective), root / objective)
            assets[objective] = root / objective
    finally:
        torch.set_num_threads(threads)
    return assets


def _snapshot(spec: TaskSpec) -> tuple[bytes, str]:
    """Version 0's adapters moved off B = 0 (every tensor then carries signal), as a
    snapshot and its checksum."""
    raw = load_safetensors(state_bytes(build_model(spec, initialize=True).scope))
    rng = np.random.default_rng(7)
    state = {k: (raw[k] + 0.05 * rng.standard_normal(raw[k].shape)).astype(np.float32)
             for k in sorted(raw)}  # safetensors' load order is not fixed
    return save_safetensors(state), np_checksum({k: v.reshape(-1) for k, v in state.items()})


@pytest.fixture(params=OBJECTIVES)
def pair(request: pytest.FixtureRequest, lm_assets: dict[str, Path]) -> dict:
    """A torch device and an ORT device of one causal-LM LoRA task, both at one snapshot."""
    spec = lm_spec(lm_assets["model"], request.param)
    snap, chk = _snapshot(spec)
    torch_dev = Device(spec, "t")
    torch_dev.load_snapshot(snap, 0, chk)
    ort_dev = Device(spec, "t", backend=BackendConfig(kind="ort",
                                                      model=str(lm_assets[request.param]),
                                                      threads=1))
    ort_dev.load_snapshot(snap, 0, chk)
    data = DeviceData(source=str(lm_assets["data"]), partition_id=0, num_partitions=2,
                      alpha=1.0)
    train, held = load_device_examples(data)
    return {"spec": spec, "torch": torch_dev, "ort": ort_dev, "data": data, "train": train,
            "held": held, "snap": snap, "chk": chk}


def test_the_bundle_batches_are_the_torch_devices_token_ids(pair: dict) -> None:
    texts = list(pair["held"].texts[:5]) + ["the film was " * 6 + "good", "GREAT, Sunny day!",
                                            "ok"]
    labels = np.arange(len(texts)) % 2
    want = task_batches(pair["spec"], load_tokenizer(Path(pair["spec"].model_path)), texts,
                        labels)

    got = pair["ort"].backend.model.batch(texts, labels)

    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value.numpy(), err_msg=key)


@pytest.mark.parametrize(("one_sided", "clip"), [(False, None), (True, None), (False, 0.05)])
def test_the_ort_device_uploads_the_torch_devices_scalars(pair: dict, one_sided: bool,
                                                          clip: float | None) -> None:
    plan = _plan(one_sided=one_sided, clip=clip)

    want = pair["torch"].train(plan, pair["train"], pair["data"])
    got = pair["ort"].train(plan, pair["train"], pair["data"])

    assert_scalars_agree(got.scalars, want.scalars, want.loss, plan.eps)
    assert np.abs(want.scalars).max() > 1e-3  # the scalars carry signal, not zeros
    assert got.num_examples == want.num_examples
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert got.runs == 2  # every probe of a step in one lm.onnx run
    assert pair["ort"].checksum == pair["chk"]  # local steps did not move the shared state


def test_each_probes_loss_is_the_torch_devices_to_a_few_ulps(pair: dict) -> None:
    texts, labels = list(pair["train"].texts[:4]), pair["train"].labels[:4]
    probes = step_probes(SEEDS[0], 1e-2, True)
    torch_backend = pair["torch"].backend
    engine = torch_backend.model.trainer.engine
    want = np.array(engine.losses(task_batches(pair["spec"], torch_backend.bundle.tokenizer,
                                               texts, labels), probes), dtype=np.float32)
    ort_backend: OrtBackend = pair["ort"].backend
    assert ort_backend.state is not None

    got, runs = ort_backend.probe_losses(ort_backend.state, texts, labels, probes)

    assert runs == 1
    np.testing.assert_allclose(np.array(got, dtype=np.float32), want, rtol=LOSS_RTOL, atol=0)


def test_probes_one_per_run_give_the_scalars_of_all_in_one_run(pair: dict) -> None:
    backend: OrtBackend = pair["ort"].backend
    batched = pair["ort"].train(_plan(), pair["train"], pair["data"])
    backend.spec = lm_spec(Path(pair["spec"].model_path), pair["spec"].objective.kind,
                           probe_copies=1)

    single = pair["ort"].train(_plan(), pair["train"], pair["data"])

    assert batched.runs == 2 and single.runs == 2 * 6
    np.testing.assert_allclose(single.scalars, batched.scalars, rtol=1e-5, atol=1e-6)


def test_replaying_the_rounds_entry_ends_both_devices_on_the_coordinators_checksum(
        pair: dict) -> None:
    plan = _plan()
    scalars = pair["ort"].train(plan, pair["train"], pair["data"]).scalars
    entry = build_entry("t", 0, [s for row in plan.seeds for s in row], scalars.reshape(1, -1),
                        np.ones(1), plan.lr, plan.perturbations)
    coordinator = Device(pair["spec"], "t")  # the coordinator's replay is the torch one
    coordinator.load_snapshot(pair["snap"], 0, pair["chk"])
    published = coordinator.backend.replay(task_id="t", entries=[entry], target=1).checksum
    signed = [type(entry)(entry.task_id, 0, entry.seeds, entry.coefs, checksum=published)]

    torch_sync = pair["torch"].sync(1, entries=signed)
    ort_sync = pair["ort"].sync(1, entries=signed)

    assert published != pair["chk"]  # the entry moved the adapters
    assert ort_sync.method == "replay" and torch_sync.method == "replay"
    assert ort_sync.checksum == torch_sync.checksum == published
    assert pair["ort"].backend.state_bytes() == pair["torch"].backend.stored("t").state


def test_evaluation_matches_the_torch_device(pair: dict) -> None:
    acc_t, loss_t = pair["torch"].evaluate(pair["held"])
    acc_o, loss_o = pair["ort"].evaluate(pair["held"])

    assert acc_o == pytest.approx(acc_t, abs=1e-9) and loss_o == pytest.approx(loss_t, rel=1e-5)
    assert loss_o > 0


def test_the_manifest_names_the_kind_the_adapters_and_the_objective(
        lm_assets: dict[str, Path]) -> None:
    manifest = Manifest.load(lm_assets["label_words"])
    scope = build_model(lm_spec(lm_assets["model"], "label_words"), initialize=False).scope

    assert manifest.kind == CAUSAL_LM_LORA and manifest.lm is not None
    assert [(t.name, t.shape) for t in manifest.tensors] == [
        (t.name, tuple(t.tensor.shape)) for t in scope]
    assert manifest.lm.objective == "label_words" and len(manifest.lm.word_ids) == 2
    assert isinstance(open_model(lm_assets["next_token"], threads=1), OrtLM)


def test_a_bundle_of_the_other_kind_or_task_is_refused(lm_assets: dict[str, Path],
                                                       tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="is a causal_lm_lora bundle, this needs a head"):
        OrtModel(lm_assets["next_token"])
    with pytest.raises(BundleError, match="objective"):
        OrtBackend(lm_spec(lm_assets["model"], "label_words"),
                   OrtLM(lm_assets["next_token"], threads=1))


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
from seedfed.client.backends.base import BackendConfig
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

spec = TaskSpec.from_dict(args["spec"])
dev = Device(spec, "t", backend=BackendConfig(kind="ort", model=args["bundle"], threads=1))
dev.load_snapshot(open(args["snapshot"], "rb").read(), 0, args["checksum"])
data = DeviceData(**args["data"])
train, held = load_device_examples(data)
out = dev.train(RoundPlan.model_validate(args["plan"]), train, data)
print(json.dumps({"scalars": out.scalars.tolist(), "eval": dev.evaluate(held),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
"""


def test_the_ort_device_trains_a_causal_lm_in_a_process_without_torch(
        pair: dict, lm_assets: dict[str, Path], tmp_path: Path) -> None:
    snapshot = tmp_path / "v0.safetensors"
    snapshot.write_bytes(pair["snap"])
    plan = _plan()
    data: DeviceData = pair["data"]
    args = {"spec": pair["spec"].to_dict(),
            "bundle": str(lm_assets[pair["spec"].objective.kind]), "snapshot": str(snapshot),
            "checksum": pair["chk"], "plan": plan.model_dump(),
            "data": {"source": data.source, "partition_id": data.partition_id,
                     "num_partitions": data.num_partitions, "alpha": data.alpha}}

    run = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BLOCKED), json.dumps(args)],
                         capture_output=True, text=True, timeout=300)
    want = pair["torch"].train(plan, pair["train"], data)

    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["loaded"] == []
    assert_scalars_agree(np.array(got["scalars"], dtype=np.float32), want.scalars, want.loss,
                         plan.eps)
    assert got["eval"][0] == pytest.approx(pair["torch"].evaluate(pair["held"])[0])


def test_an_ort_lm_device_trains_beside_a_torch_device_and_ends_on_the_coordinators_checksum(
        lm_assets: dict[str, Path], tmp_path: Path) -> None:
    from fastapi.testclient import TestClient
    from seedfed.client.http_device import DeviceConfig, HttpDevice
    from seedfed.server.app import create_app
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings

    from tests.fleet_helpers import replay_when_allowed

    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    task, join = coord.create_task_with_token(lm_spec(lm_assets["model"], "label_words"),
                                              quorum=50)

    def data(i: int) -> DeviceData:
        return DeviceData(source=str(lm_assets["data"]), partition_id=i, num_partitions=2)

    with TestClient(create_app(runtime=coord.rt)) as client:
        ort_dev = replay_when_allowed(HttpDevice(DeviceConfig(
            url="http://testserver", task_id=task, join_token=join, state_dir=tmp_path / "o",
            backend="ort", model=str(lm_assets["label_words"]), data=data(0), threads=1),
            client=client))
        torch_dev = replay_when_allowed(HttpDevice(DeviceConfig(
            url="http://testserver", task_id=task, join_token=join, state_dir=tmp_path / "t",
            model=str(lm_assets["model"]), data=data(1)), client=client))
        ort_dev.enroll()
        torch_dev.enroll()
        outcomes = []
        for _ in range(2):
            plan = coord.open_round(task)
            outcomes.append([d.train_and_upload(plan) for d in (ort_dev, torch_dev)])
            coord.close_round(task)
        synced = [d.sync() for d in (ort_dev, torch_dev)]
    status = coord.task_status(task)
    coord.close()

    assert status.version == 2
    assert [o.sync for o in outcomes[1]] == ["replay", "replay"]
    assert [s.method for s in synced] == ["replay", "replay"]
    assert [s.checksum for s in synced] == [status.checksum] * 2
