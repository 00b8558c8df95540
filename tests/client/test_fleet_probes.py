"""A fleet's head steps in one batched computation (`client.fleet_probes.HeadFleet`): each
device's scalars equal its own engine step's to float tolerance, and given the scalars its
state after the step is bit for bit its own step's and a replay's; devices stay apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from seedfed.client.fleet_probes import HeadFleet, copies_of, head_features
from seedfed.client.probes import ProbeEngine, engine_step, stacked_copies
from seedfed.shared.model.classifier import MeanPoolClassifier, prime_features
from seedfed.shared.model.estimator import ZOConfig, spsa_step
from seedfed.shared.model.objectives import classification_loss, classification_losses
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.model.scopes import Scope, build_scope
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.npzo import LogEntry, step_probes, update_coefficients
from transformers import BertConfig, BertModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDS = [101, 202, 303, 404, 505, 606]
#: As in test_probes: batched copies round the loss by a few float32 ulps; g divides the
#: loss difference by 2 eps.
G_TOL = 2e-3
TASK = "fleet"


def _head_model() -> tuple[MeanPoolClassifier, Scope]:
    """A mean-pooled BERT whose head trains on cached pooled rows (the SST-2 recipe's shape:
    the bias steps at 0.1 of the weight)."""
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32)
    torch.manual_seed(0)  # only for the random BERT init
    model = MeanPoolClassifier(BertModel(cfg, add_pooling_layer=False), 2, normalize=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.frozen_prefix = model.num_layers  # the pooled-row cache of the head recipe
    scope = build_scope("named", model, patterns=("classifier",))
    scope.set_step_scales((("classifier.bias", 0.1),))
    return model.eval(), scope


def _batch(seed: int, rows: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (rows, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # a right-padded sentence
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(0, 2, (rows,), generator=gen)}


def _states(scope: Scope, n: int) -> list[dict[str, torch.Tensor]]:
    """n different head states around the scope's own."""
    base = scope.read()
    gen = torch.Generator().manual_seed(9)
    return [{k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
            for _ in range(n)]


def _engine_step(model: MeanPoolClassifier, scope: Scope, state: dict[str, torch.Tensor],
                 batch: dict[str, torch.Tensor], config: ZOConfig,
                 ) -> tuple[np.ndarray, dict[str, torch.Tensor], str]:
    """One device's own step (the batched ProbeEngine): its scalars, state and checksum."""
    scope.write(state)
    prime_features(model, batch)
    engine = ProbeEngine(model, scope, classification_loss, classification_losses)
    g = engine_step(engine, batch, SEEDS, config).g
    return g, scope.read(), checksum(scope)


def _sequential_g(model: MeanPoolClassifier, scope: Scope, state: dict[str, torch.Tensor],
                  batch: dict[str, torch.Tensor], config: ZOConfig) -> np.ndarray:
    scope.write(state)

    def loss_fn() -> float:
        with torch.no_grad():
            return float(classification_loss(model, batch))

    return spsa_step(scope, loss_fn, SEEDS, config).g


@pytest.mark.parametrize("one_sided", [False, True])
def test_fleet_scalars_equal_each_devices_own_step(one_sided: bool) -> None:
    # Arrange: 3 devices, each its own state and batch (one of them shorter)
    model, scope = _head_model()
    states = _states(scope, 3)
    batches = [_batch(1), _batch(2), _batch(3, rows=4)]
    config = ZOConfig(lr=0.5, eps=1e-3, perturbations=len(SEEDS), one_sided=one_sided)
    fleet = HeadFleet(model, scope, states)

    # Act
    results = fleet.step([head_features(model, b) for b in batches],
                         [b["labels"] for b in batches], SEEDS, config)

    # Assert: each device's scalars are its engine step's and the sequential estimator's
    for d, (state, batch) in enumerate(zip(states, batches, strict=True)):
        own, _, _ = _engine_step(model, scope, state, batch, config)
        np.testing.assert_allclose(results[d].g, own, atol=G_TOL, rtol=1e-3)
        np.testing.assert_allclose(results[d].g, _sequential_g(model, scope, state, batch, config),
                                   atol=G_TOL, rtol=1e-3)
        assert results[d].forwards == (len(SEEDS) + 1 if one_sided else 2 * len(SEEDS))


def test_given_the_scalars_the_update_is_bit_for_bit_the_devices_own() -> None:
    # Arrange: each device's own engine step (its scalars, state and checksum after it)
    model, scope = _head_model()
    states = _states(scope, 2)
    batches = [_batch(4), _batch(5)]
    config = ZOConfig(lr=0.5, eps=1e-3, perturbations=len(SEEDS))
    own = [_engine_step(model, scope, s, b, config) for s, b in zip(states, batches, strict=True)]
    fleet = HeadFleet(model, scope, states)

    # Act: the fleet applies each device's scalars
    for d, (g, _, _) in enumerate(own):
        fleet.update(d, g, SEEDS, config)

    # Assert: the states are the engine step's bits, and its checksum
    for d, (_, state, chk) in enumerate(own):
        after = fleet.state(d)
        assert all(torch.equal(after[k], state[k]) for k in state)
        assert fleet.checksum(d) == chk != checksum(HeadFleet(model, scope, [states[d]]).scopes[0])


def test_a_fleet_step_replays_from_its_upload() -> None:
    # Arrange
    model, scope = _head_model()
    states = _states(scope, 2)
    batches = [_batch(6), _batch(7)]
    config = ZOConfig(lr=0.5, eps=1e-3, perturbations=len(SEEDS))
    fleet = HeadFleet(model, scope, states)

    # Act: one fleet step; each device's upload as a log entry with its checksum
    results = fleet.step([head_features(model, b) for b in batches],
                         [b["labels"] for b in batches], SEEDS, config)

    # Assert: replaying the entry on the device's starting state verifies the checksum
    for d, res in enumerate(results):
        coefs = update_coefficients(res.g, config.lr, config.perturbations)
        entry = LogEntry(TASK, 0, tuple(SEEDS), tuple(float(c) for c in coefs),
                         fleet.checksum(d))
        scope.write(states[d])
        assert replay(scope, [entry], task_id=TASK, version=0) == 1  # raises on a mismatch
        assert checksum(scope) == fleet.checksum(d)


def test_devices_with_different_data_get_different_scalars() -> None:
    # Arrange: three devices at one state; devices 0 and 2 share a batch, device 1 does not
    model, scope = _head_model()
    state = _states(scope, 1)[0]
    batches = [_batch(8), _batch(9), _batch(8)]
    config = ZOConfig(lr=0.5, eps=1e-3, perturbations=len(SEEDS))
    fleet = HeadFleet(model, scope, [state] * 3)

    # Act
    results = fleet.step([head_features(model, b) for b in batches],
                         [b["labels"] for b in batches], SEEDS, config)

    # Assert: the same data gives the same bits, other data other scalars and states
    assert np.array_equal(results[0].g, results[2].g)
    assert fleet.checksum(0) == fleet.checksum(2)
    assert not np.allclose(results[0].g, results[1].g, atol=G_TOL, rtol=1e-3)
    assert fleet.checksum(0) != fleet.checksum(1)


@pytest.mark.parametrize("one_sided", [False, True])
def test_the_perturbed_heads_are_the_batched_engines_bits(one_sided: bool) -> None:
    # Arrange: the weight and the step-scaled bias of a head
    _, scope = _head_model()
    probes = step_probes(SEEDS, 1e-3, one_sided)

    for t in scope:
        out = torch.empty((len(probes), *t.tensor.shape))
        # Act
        copies_of(t, probes, out)
        # Assert: bit for bit what the engine's fused head stacks
        assert torch.equal(out, stacked_copies(t, probes))
        assert not torch.equal(out[-1], t.tensor)  # the last probe is perturbed


def test_a_small_weight_budget_runs_devices_in_groups_with_the_losses() -> None:
    model, scope = _head_model()
    states = _states(scope, 3)
    feats = [head_features(model, _batch(10 + d)) for d in range(3)]
    labels = [_batch(10 + d)["labels"] for d in range(3)]
    probes = [(s, 1e-3) for s in SEEDS]

    together = HeadFleet(model, scope, states).losses(feats, labels, probes)
    one_by_one = HeadFleet(model, scope, states, max_bytes=1).losses(feats, labels, probes)

    torch.testing.assert_close(together, one_by_one, atol=1e-6, rtol=1e-6)


def test_a_scope_beyond_the_head_is_refused() -> None:
    model, _ = _head_model()
    scope = build_scope("named", model, patterns=("layer.1.output.dense", "classifier"))

    with pytest.raises(ScopeError, match="one at a time"):
        HeadFleet(model, scope, [scope.read()])
