"""Which model a personal state belongs to (client/personal.py, `model_fingerprint`): the exact
bits of the model files, so a device restarted under another thread count keeps its personal
part; a state of another model is still refused, and a state written with the earlier rounded
fingerprint is kept when it is this model's (and rewritten with the exact one)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from seedfed.client.personal import (
    IDENTITY,
    Head,
    PersonalConfig,
    PersonalPart,
    PersonalStateError,
    head_module,
    model_fingerprint,
    shared_head,
    state_metadata,
)
from seedfed.shared.model.factory import ModelBundle

from tests.client.personal_helpers import build_assets, bundle_of, flipped, trained

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return build_assets(tmp_path_factory.mktemp("identity"))


# -- a restart under another thread count --------------------------------------------------------
_DEVICE = """
import json, sys
from pathlib import Path
import numpy as np, torch
torch.set_num_threads(int(sys.argv[1]))
from seedfed.client.personal import PersonalConfig, PersonalPart
from tests.client.personal_helpers import bundle_of, flipped, trained
model, data, state = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
bundle = bundle_of(model)
if not state.exists():  # first start: train the personal part and store it
    state.write_bytes(trained(bundle, flipped(data)[0], rounds=2).to_bytes())
    part = PersonalPart(PersonalConfig(), bundle, "task-a")
else:  # restart: bring the stored part back
    part = PersonalPart(PersonalConfig(), bundle, "task-a")
    part.restore(state.read_bytes())
print(json.dumps({"refused": part.refused, "rounds": part.rounds,
                  "fingerprint": part.fingerprint,
                  "prototype": part.prototype.theta.numpy().tobytes().hex()}))
"""


def _device_process(threads: int, model: Path, data: Path, state: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _DEVICE, str(threads), str(model), str(data),
                          str(state)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_device_restarted_under_another_thread_count_keeps_its_personal_part(
        assets: tuple[Path, Path, Path], tmp_path: Path) -> None:
    # Arrange: the first start trains on 1 thread and stores the part
    model, _, data = assets
    state = tmp_path / "personal.safetensors"
    first = _device_process(1, model, data, state)
    # Act: the restart runs on 3 threads
    restarted = _device_process(3, model, data, state)
    # Assert
    assert restarted["refused"] is None
    assert restarted["rounds"] == 2
    assert restarted["fingerprint"] == first["fingerprint"]


def test_float_noise_in_the_prototype_head_does_not_change_the_fingerprint(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange: the prototype head is computed by a forward, so its last bits vary with the
    # kernel; move every value by a relative 1e-6 (which crossed the old 3-digit rounding)
    model, _, _ = assets
    bundle = bundle_of(model)
    before = model_fingerprint(bundle)
    # Act
    with torch.no_grad():
        for p in head_module(bundle.model).parameters():
            p.mul_(1 + 1e-6)
    # Assert
    assert model_fingerprint(bundle) == before


def test_one_bit_of_a_frozen_weight_changes_the_fingerprint(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, _ = assets
    bundle = bundle_of(model)
    before = model_fingerprint(bundle)
    embeddings = next(p for n, p in bundle.model.named_parameters() if "word_embeddings" in n)
    # Act: the next float32 after one value
    with torch.no_grad():
        embeddings.view(-1)[7] = torch.nextafter(embeddings.view(-1)[7], torch.tensor(1e9))
    # Assert
    assert model_fingerprint(bundle) != before


def test_a_new_state_names_its_identity_and_another_models_is_refused(
        assets: tuple[Path, Path, Path]) -> None:
    model, other, data = assets
    blob = trained(bundle_of(model), flipped(data)[0], rounds=1).to_bytes()
    target = PersonalPart(PersonalConfig(), bundle_of(other), "task-a")

    assert state_metadata(blob)["identity"] == IDENTITY
    with pytest.raises(PersonalStateError, match="another model"):
        target.load_bytes(blob)


# -- states written with the earlier, rounded fingerprint ---------------------------------------
def _rounded_fingerprint(bundle: ModelBundle, prototype: Head) -> str:
    """The fingerprint `seedfed-personal/1` states carried before `IDENTITY`: a strided sample
    of each frozen parameter and the prototype head rounded to 3 significant digits."""
    def sample(t: torch.Tensor, n: int = 64) -> str:
        flat = t.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // n)][:n].contiguous()
        return hashlib.sha256(picked.numpy().tobytes()).hexdigest()[:16]

    spec = bundle.spec
    trained_ptrs = {t.tensor.data_ptr() for t in bundle.scope}
    head_ptrs = {p.data_ptr() for p in head_module(bundle.model).parameters()}
    frozen = [[name, list(p.shape), sample(p)] for name, p in bundle.model.named_parameters()
              if p.data_ptr() not in trained_ptrs and p.data_ptr() not in head_ptrs]
    desc = {"model_kind": spec.model_kind, "num_labels": spec.num_labels,
            "label_texts": list(spec.label_texts), "hidden": prototype.hidden,
            "frozen": frozen, "prototype": [float(f"{v:.3g}") for v in prototype.theta.tolist()]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _as_legacy(blob: bytes, fingerprint: str) -> bytes:
    """The same state as an earlier seedfed wrote it: the rounded fingerprint, no identity."""
    meta = {k: v for k, v in state_metadata(blob).items() if k != "identity"}
    return save(load(blob), metadata={**meta, "fingerprint": fingerprint})


def _boundary_bundle(model: Path) -> ModelBundle:
    """The model with one prototype value put on a 3-digit rounding boundary (0.12350001:
    float noise takes it to either side)."""
    bundle = bundle_of(model)
    with torch.no_grad():
        head_module(bundle.model).weight[0, 0] = 0.12350001
    return bundle


def test_a_legacy_state_of_this_model_is_kept_and_migrated(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    part = trained(bundle_of(model), flipped(data)[0], rounds=2)
    legacy = _as_legacy(part.to_bytes(), _rounded_fingerprint(part.bundle, part.prototype))
    target = PersonalPart(PersonalConfig(), bundle_of(model), "task-a")
    # Act
    target.restore(legacy)
    migrated = state_metadata(target.to_bytes())
    # Assert
    assert target.refused is None and target.rounds == 2
    assert target.personal is not None and part.personal is not None
    assert torch.equal(target.personal.theta, part.personal.theta)
    assert (migrated["identity"], migrated["fingerprint"]) == (IDENTITY, target.fingerprint)


def test_a_legacy_state_whose_prototype_rounded_the_other_way_is_kept(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange: written where the boundary value came out as 0.12349999 (rounds to 0.123),
    # read where it is 0.12350001 (0.124): the restart the rounded fingerprint lost
    model, _, data = assets
    writer = _boundary_bundle(model)
    noisy = shared_head(writer.model)
    noisy.theta[0] = 0.12349999
    blob = trained(writer, flipped(data)[0], rounds=1).to_bytes()
    legacy = _as_legacy(blob, _rounded_fingerprint(writer, noisy))
    target = PersonalPart(PersonalConfig(), _boundary_bundle(model), "task-a")
    # Act
    target.restore(legacy)
    # Assert
    assert target.refused is None and target.personal is not None


def test_a_legacy_state_of_another_model_is_still_refused(
        assets: tuple[Path, Path, Path]) -> None:
    model, other, data = assets
    part = trained(bundle_of(other), flipped(data)[0], rounds=1)
    legacy = _as_legacy(part.to_bytes(), _rounded_fingerprint(part.bundle, part.prototype))
    target = PersonalPart(PersonalConfig(), bundle_of(model), "task-a")

    target.restore(legacy)

    assert target.refused is not None and "another model" in target.refused
    assert target.personal is None
