"""The evidence gate (client/personal_gate.py): where a personal part applies, and how a device
stores it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load, save
from seedfed.client import data as data_mod
from seedfed.client.personal import (
    PersonalConfig,
    PersonalPart,
    PersonalStateError,
    _logits,
    features,
    shared_head,
    state_metadata,
)
from seedfed.client.personal_gate import MAX_ANCHORS, EvidenceGate, gated

from tests.client.personal_helpers import build_assets, bundle_of, flipped, trained

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return build_assets(tmp_path_factory.mktemp("gate"))


def _clusters() -> torch.Tensor:
    """Two tight clusters of 4 around orthogonal directions of R^8."""
    g = torch.Generator().manual_seed(0)
    centres = torch.eye(8)[:2]
    return torch.cat([c + 0.05 * torch.randn(4, 8, generator=g) for c in centres])


def test_the_radius_is_the_least_typical_anchors_similarity_to_its_nearest_other() -> None:
    # Arrange
    feats = _clusters()
    unit = torch.nn.functional.normalize(feats, dim=-1)
    sims = unit @ unit.T
    sims.fill_diagonal_(-2.0)
    # Act
    gate = EvidenceGate.of(feats)
    # Assert
    assert gate is not None
    assert gate.radius == pytest.approx(float(sims.max(dim=1).values.min()), abs=1e-6)
    assert 0.9 < gate.radius < 1.0  # the clusters are tight


def test_inputs_near_an_anchor_are_covered_and_others_are_not() -> None:
    # Arrange
    gate = EvidenceGate.of(_clusters())
    assert gate is not None
    inputs = torch.stack([torch.eye(8)[0] * 3.0, torch.eye(8)[1], torch.eye(8)[5],
                          torch.eye(8)[0] + torch.eye(8)[1]])
    # Act
    covered = gate.covers(inputs)
    # Assert: the scale of a feature does not matter, only its direction
    assert covered.tolist() == [True, True, False, False]
    assert bool(gate.covers(_clusters()).all())  # every anchor covers itself


def test_uncovered_inputs_get_the_shared_logits_unchanged() -> None:
    # Arrange
    gate = EvidenceGate.of(_clusters())
    feats = torch.stack([torch.eye(8)[0], torch.eye(8)[5]])
    personal, shared = torch.tensor([[5.0, -5.0], [5.0, -5.0]]), torch.tensor([[0.1, 0.2],
                                                                              [0.3, 0.4]])
    # Act
    out = gated(personal, shared, gate, feats)
    # Assert
    assert torch.equal(out[0], personal[0]) and torch.equal(out[1], shared[1])
    assert torch.equal(gated(personal, shared, None, feats), personal)


def test_a_gate_needs_two_examples_and_keeps_at_most_max_anchors() -> None:
    # Arrange
    many = torch.randn(MAX_ANCHORS + 37, 8, generator=torch.Generator().manual_seed(1))
    # Act / Assert
    assert EvidenceGate.of(torch.ones(1, 8)) is None
    gate = EvidenceGate.of(many)
    assert gate is not None and gate.anchors.shape == (MAX_ANCHORS, 8)
    with pytest.raises(ValueError, match="radius"):
        EvidenceGate(gate.anchors, 1.5)
    with pytest.raises(ValueError, match="anchors"):
        EvidenceGate(gate.anchors[:1], 0.5)


def _far(examples: data_mod.Examples) -> data_mod.Examples:
    """Sentences of words the device's owner never used."""
    return data_mod.Examples(tuple(f"zebra quantum {i} xylophone" for i in range(len(examples))),
                             examples.labels)


def test_a_trained_part_leaves_the_shared_model_alone_outside_its_evidence(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    train, held = flipped(data)
    part = trained(bundle, train, rounds=5, lr=4.0)
    assert part.gate is not None
    own = torch.cat([f for f, _ in features(bundle, held)])
    far = torch.cat([f for f, _ in features(bundle, _far(held))])
    feats = torch.cat([own, far])
    covered = part.gate.covers(feats)
    # Act
    ungated = PersonalPart(PersonalConfig(lr=4.0, gate=False), bundle, "task-a")
    ungated.load_bytes(part.to_bytes())
    scores, free = part.score(held), ungated.score(held)
    # Assert: the owner's own kind of sentence is covered; the gate only changes scoring
    assert covered[: len(own)].float().mean() > 0.5
    assert not bool(covered[len(own):].all())  # some sentences lie outside the evidence
    assert scores is not None and free is not None and scores.shared == free.shared
    shared = shared_head(bundle.model)
    base = _logits(shared.theta, feats, 2)
    mixed = part.personal_logits(feats, shared)
    assert torch.equal(mixed[~covered], base[~covered])
    assert torch.equal(mixed[covered], ungated.personal_logits(feats, shared)[covered])


def test_the_gate_round_trips_in_the_personal_state_and_a_state_without_one_still_loads(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    train, _ = flipped(data)
    part = trained(bundle, train, rounds=2)
    stored = part.to_bytes()
    tensors = load(stored)
    meta = {k: v for k, v in state_metadata(stored).items() if k != "radius"}
    without = save({k: v for k, v in tensors.items() if k != "anchors"}, metadata=meta)
    # Act
    fresh = PersonalPart(PersonalConfig(), bundle, "task-a")
    fresh.load_bytes(stored)
    old = PersonalPart(PersonalConfig(), bundle, "task-a")
    old.load_bytes(without)
    # Assert
    assert fresh.gate is not None and part.gate is not None
    assert torch.equal(fresh.gate.anchors, part.gate.anchors)
    assert fresh.gate.radius == part.gate.radius
    assert old.gate is None and old.personal is not None  # a state from before the gate


@pytest.mark.parametrize("damage", ["no radius", "nan anchors", "narrow anchors"])
def test_a_corrupt_gate_is_refused(assets: tuple[Path, Path, Path],
                                   damage: str) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    train, _ = flipped(data)
    stored = trained(bundle, train, rounds=1).to_bytes()
    tensors, meta = dict(load(stored)), dict(state_metadata(stored))
    if damage == "no radius":
        del meta["radius"]
    elif damage == "nan anchors":
        tensors["anchors"][0, 0] = float("nan")
    else:
        tensors["anchors"] = tensors["anchors"][:, :3].contiguous()
    # Act / Assert
    with pytest.raises(PersonalStateError, match="evidence gate"):
        PersonalPart(PersonalConfig(), bundle, "task-a").load_bytes(save(tensors, metadata=meta))


def test_the_gate_does_not_change_what_a_part_learns(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    train, _ = flipped(data)
    # Act
    on = trained(bundle, train, rounds=3)
    off = trained(bundle, train, rounds=3, gate=False)
    # Assert
    assert on.personal is not None and off.personal is not None
    assert torch.equal(on.personal.theta, off.personal.theta)
    assert np.isfinite(on.gate.radius if on.gate else 0.0)
