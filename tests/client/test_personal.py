"""The personal part (client/personal.py): its forms, its ZO training, its stored state and the
refusal of a state that does not belong to this device's task and model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from seedfed.client import data as data_mod
from seedfed.client.personal import (
    PersonalConfig,
    PersonalPart,
    PersonalStateError,
    features,
)

from tests.client.personal_helpers import build_assets, bundle_of, flipped, trained

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return build_assets(tmp_path_factory.mktemp("personal"))


def test_an_untrained_residual_part_scores_exactly_the_shared_model(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    part = PersonalPart(PersonalConfig(), bundle, "task-a")
    _, held = flipped(data)
    # Act
    scores = part.score(held)
    # Assert
    assert scores is not None
    assert scores.personal == scores.shared and scores.local is None
    assert scores.examples == len(held)


@pytest.mark.parametrize("method", ["residual", "ditto", "fedper"])
def test_zo_training_fits_a_device_whose_taste_the_shared_model_gets_wrong(
        assets: tuple[Path, Path, Path], method: str) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    train, held = flipped(data)
    before = PersonalPart(PersonalConfig(method=method), bundle, "task-a").score(held)
    # Act
    part = trained(bundle, train, rounds=40, method=method, lr=4.0, decay=0.0)
    after = part.score(held)
    # Assert
    assert before is not None and after is not None
    assert after.shared == before.shared  # the shared model is never changed
    assert after.personal >= after.shared + 0.2, (before, after)
    assert after.local is not None and after.local > 0.5  # the reference trained too


def test_the_personal_state_round_trips_and_scores_the_same(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    train, held = flipped(data)
    part = trained(bundle, train, rounds=3)
    fresh = PersonalPart(PersonalConfig(), bundle, "task-a")
    # Act
    fresh.load_bytes(part.to_bytes())
    # Assert
    assert fresh.score(held) == part.score(held)
    assert fresh.rounds == 3


def test_a_reset_part_stores_an_empty_state_that_loads_as_untrained(
        assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    part = trained(bundle, flipped(data)[0], rounds=1)
    # Act
    part.reset()
    fresh = PersonalPart(PersonalConfig(), bundle, "task-a")
    fresh.load_bytes(part.to_bytes())
    # Assert
    assert fresh.personal is None and fresh.local is None


@pytest.mark.parametrize("case", ["other task", "other model", "other method", "corrupt",
                                  "not finite"])
def test_a_state_that_does_not_belong_is_refused_and_rebuilt(
        assets: tuple[Path, Path, Path], case: str) -> None:
    # Arrange
    model, other, data = assets
    train, held = flipped(data)
    good = trained(bundle_of(model), train, rounds=2)
    blob = good.to_bytes()
    target = PersonalPart(PersonalConfig(), bundle_of(model), "task-a")
    if case == "other task":
        target = PersonalPart(PersonalConfig(), bundle_of(model), "task-b")
    elif case == "other model":
        target = PersonalPart(PersonalConfig(), bundle_of(other), "task-a")
    elif case == "other method":
        target = PersonalPart(PersonalConfig(method="fedper"), bundle_of(model), "task-a")
    elif case == "corrupt":
        blob = blob[: len(blob) // 2]
    else:
        assert good.personal is not None
        good.personal.theta[0] = float("nan")
        blob = good.to_bytes()
    # Act
    with pytest.raises(PersonalStateError) as refused:
        target.load_bytes(blob)
    target.restore(blob)
    # Assert
    assert str(refused.value)  # a message that says why
    assert target.refused == str(refused.value)
    assert target.personal is None  # never applied: rebuilt from scratch
    scores = target.score(held)
    assert scores is not None and scores.personal == scores.shared


def test_features_come_one_batch_at_a_time_in_order(assets: tuple[Path, Path, Path]) -> None:
    # Arrange
    model, _, data = assets
    bundle = bundle_of(model)
    examples = data_mod.load_labelled(data).subset(range(50))
    # Act
    parts = list(features(bundle, examples, batch_size=16))
    # Assert
    assert [f.shape[0] for f, _ in parts] == [16, 16, 16, 2]
    assert np.array_equal(np.concatenate([y.numpy() for _, y in parts]), examples.labels)


def test_config_refuses_unknown_methods_and_bad_numbers() -> None:
    # Arrange / Act / Assert
    with pytest.raises(ValueError, match="method"):
        PersonalConfig(method="lora")
    with pytest.raises(ValueError, match="lr"):
        PersonalConfig(lr=0.0)
    with pytest.raises(ValueError, match="decay"):
        PersonalConfig(decay=-1.0)
    with pytest.raises(ValueError, match="bias_scale"):
        PersonalConfig(bias_scale=0.0)
    assert not PersonalConfig(method="off").enabled


def test_a_bias_scale_probes_and_steps_the_bias_in_phi_units(
        assets: tuple[Path, Path, Path]) -> None:
    """theta = c phi on the bias: its probes are eps c z and its step c x the phi step; the
    weights' entries are as at c = 1 (the same SPSA on the scaled directions)."""
    # Arrange
    import torch

    model, _, data = assets
    bundle = bundle_of(model)
    train, _ = flipped(data)
    parts = list(features(bundle, train.subset(range(16))))
    feats, labels = torch.cat([f for f, _ in parts]), torch.cat([y for _, y in parts])
    c = 0.1
    part = PersonalPart(PersonalConfig(bias_scale=c, lr=2.0, eps=1e-2, perturbations=4),
                        bundle, "task-a")
    head = part._start(part.prototype)
    z = torch.from_numpy(np.random.default_rng(0).integers(0, 2, size=(4, head.theta.numel()))
                         .astype(np.float32) * 2 - 1)
    scaled = z.clone()
    scaled[:, -2:] *= c
    theta0 = head.theta.clone()
    losses = part._loss(torch.cat([theta0 + 1e-2 * scaled, theta0 - 1e-2 * scaled]), feats,
                        labels, None, None)
    g = (losses[:4] - losses[4:]) / (2 * 1e-2)
    # Act
    part._step(head, feats, labels, z, None, None)
    # Assert
    torch.testing.assert_close(head.theta, theta0 - 2.0 * (g[:, None] * scaled).mean(dim=0))
    assert torch.equal(z[:, -2:].abs(), torch.ones(4, 2))  # the caller's z is left alone
