"""The ORT backend against the torch backend, each in a `Device`, on the same task, state, plan
and data."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from seedfed.client.backends.ort.backend import OrtBackend
from seedfed.client.backends.ort.bundle import BundleError
from seedfed.client.backends.ort.runtime import OrtModel
from seedfed.client.device import Device
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.sync import state_bytes
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.hf import load_tokenizer
from seedfed.shared.model.replay import checksum
from seedfed.shared.protocol.errors import ChecksumMismatchError
from seedfed.shared.protocol.npzo import LogEntry, update_coefficients
from seedfed.shared.protocol.wire import RoundPlan

from tests.client.backends.ort.conftest import head_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDS = [[11, 12, 13, 14], [15, 16, 17, 18], [2**53 - 1, 3, 5, 7]]


def _plan(version: int = 0, one_sided: bool = False, clip: float | None = None) -> RoundPlan:
    return RoundPlan(task_id="t", round=version + 1, version=version, seeds=SEEDS, lr=0.1,
                     eps=1e-2, batch_size=8, scope="named", one_sided=one_sided, clip=clip)


#: the SST-2 recipe's kind of step scales: the bias at 0.1, and the weights at 2 (c != 1 on
#: every tensor, so a rule applied to the wrong tensor shows)
STEP_SCALES = (("classifier.bias", 0.1), ("classifier.weight", 2.0))


@pytest.fixture(params=[(), STEP_SCALES], ids=["unscaled", "step_scales"])
def pair(request: pytest.FixtureRequest, ort_assets: dict[str, Path]) -> dict:
    """A torch device and an ORT device of one task, both at the coordinator's v0; the task
    with and without per-tensor step scales."""
    spec = replace(head_spec(ort_assets["model"]), step_scales=request.param)
    v0 = build_model(spec, initialize=True)
    snap, chk = state_bytes(v0.scope), checksum(v0.scope)
    torch_dev = Device(spec, "t")
    torch_dev.load_snapshot(snap, 0, chk)
    ort_dev = Device(spec, "t", backend=OrtBackend(spec, OrtModel(ort_assets["bundle"],
                                                                threads=1)))
    ort_dev.load_snapshot(snap, 0, chk)
    data = DeviceData(source=str(ort_assets["data"]), partition_id=0, num_partitions=2,
                      alpha=1.0)
    train, held = load_device_examples(data)
    return {"spec": spec, "torch": torch_dev, "ort": ort_dev, "data": data, "train": train,
            "held": held, "snap": snap, "chk": chk}


@pytest.mark.parametrize(("one_sided", "clip"), [(False, None), (True, None), (False, 0.3)])
def test_the_ort_device_uploads_the_torch_devices_scalars(pair: dict, one_sided: bool,
                                                          clip: float | None) -> None:
    plan = _plan(one_sided=one_sided, clip=clip)

    want = pair["torch"].train(plan, pair["train"], pair["data"])
    got = pair["ort"].train(plan, pair["train"], pair["data"])

    np.testing.assert_allclose(got.scalars, want.scalars, rtol=1e-4, atol=5e-5)
    assert np.abs(want.scalars).max() > 1e-3  # the scalars carry signal, not zeros
    assert got.num_examples == want.num_examples
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert pair["ort"].checksum == pair["chk"]  # local steps did not move the shared state


def test_probes_batched_per_run_give_the_scalars_of_one_probe_per_run(pair: dict) -> None:
    ort_dev: Device = pair["ort"]
    batched = ort_dev.train(_plan(), pair["train"], pair["data"])
    ort_dev.backend.spec = replace(head_spec(Path(pair["spec"].model_path), probe_copies=1),
                           step_scales=pair["spec"].step_scales)

    single = ort_dev.train(_plan(), pair["train"], pair["data"])

    assert batched.runs == 3 and single.runs == 3 * 8  # 8 probes a step, all in one run
    np.testing.assert_allclose(single.scalars, batched.scalars, rtol=1e-5, atol=1e-6)


def test_replayed_entries_give_the_torch_devices_checksums(pair: dict) -> None:
    rng = np.random.default_rng(0)
    entries = []
    for v in range(3):
        seeds = tuple(int(s) for s in rng.integers(0, 2**53, size=5))
        coefs = update_coefficients(rng.normal(size=5), 0.5, 5)
        entries.append(LogEntry("t", v, seeds, tuple(float(c) for c in coefs)))
    torch_sync = pair["torch"].sync(3, entries=entries)
    signed = [LogEntry(e.task_id, e.base_version, e.seeds, e.coefs, checksum=None)
              for e in entries[:-1]] + [LogEntry("t", 2, entries[2].seeds, entries[2].coefs,
                                                 checksum=torch_sync.checksum)]

    ort_sync = pair["ort"].sync(3, entries=signed)

    assert ort_sync.method == "replay" and torch_sync.method == "replay"
    assert ort_sync.checksum == torch_sync.checksum
    assert pair["ort"].backend.state_bytes() == state_bytes(pair["torch"].backend.bundle.scope)


def test_a_diverged_replay_falls_back_to_the_snapshot(pair: dict) -> None:
    bad = LogEntry("t", 0, (1,), (0.5,), checksum="0" * 64)
    fetched = []

    def fetch() -> tuple[bytes, str]:
        fetched.append(1)
        return pair["snap"], pair["chk"]

    result = pair["ort"].sync(1, entries=[bad], fetch=fetch)

    assert result.method == "snapshot" and fetched == [1] and result.checksum == pair["chk"]


def test_a_snapshot_that_does_not_hash_to_the_published_checksum_is_refused(pair: dict) -> None:
    with pytest.raises(ChecksumMismatchError):
        pair["ort"].backend.load_snapshot(pair["snap"], 5, "f" * 64)

    assert pair["ort"].backend.version == 0  # what it held stays


def test_evaluation_and_tokenization_match_the_torch_device(pair: dict,
                                                            ort_assets: dict[str, Path]) -> None:
    texts = list(pair["held"].texts[:6]) + ["the film was " * 12 + "good", "GREAT, Sunny day!"]
    hf = load_tokenizer(ort_assets["model"])(texts, padding=True, truncation=True,
                                              max_length=16, return_tensors="np")

    enc = pair["ort"].backend.model.tokenize(texts)
    acc_t, loss_t = pair["torch"].evaluate(pair["held"])
    acc_o, loss_o = pair["ort"].evaluate(pair["held"])

    np.testing.assert_array_equal(enc.input_ids, hf["input_ids"])
    np.testing.assert_array_equal(enc.attention_mask, hf["attention_mask"])
    assert acc_o == acc_t and loss_o == pytest.approx(loss_t, rel=1e-5)


def test_a_bundle_exported_for_another_task_is_refused(ort_assets: dict[str, Path]) -> None:
    other = head_spec(ort_assets["model"])
    other = type(other).from_dict({**other.to_dict(), "max_seq_len": 32})

    with pytest.raises(BundleError, match="max_seq_len"):
        OrtBackend(other, OrtModel(ort_assets["bundle"], threads=1))


def test_a_step_scale_that_names_no_tensor_of_the_bundle_is_refused(
        ort_assets: dict[str, Path]) -> None:
    spec = replace(head_spec(ort_assets["model"]), step_scales=(("classifier.bais", 0.1),))

    with pytest.raises(BundleError, match="classifier.bais"):
        OrtBackend(spec, OrtModel(ort_assets["bundle"], threads=1))
