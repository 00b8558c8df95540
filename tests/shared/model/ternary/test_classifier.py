"""Ternary classifier tasks: a mean-pooled BitLinear encoder + float head, coordinator vs device.

The coordinator builds the task's model from the fp32 directory (Linear -> BitLinear, prototype
head on the ternary forward); a device builds the packed model without the fp32 matrices and
takes codes, masks, latents and the head from the published snapshot. The two must compute the
same logits bit for bit, and agree on the checksum, with and without the head in the scope.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from seedfed.client.data import tokenize
from seedfed.client.sync import read_snapshot
from seedfed.shared.model.classifier import MeanPoolClassifier
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.ternary import (
    TernaryFormatError,
    TernaryScope,
    bitlinear_modules,
    build_packed_model,
    load_published_ternary,
    publish_ternary,
)
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.scope_options import MaskConfig, TernaryOptions
from seedfed.shared.protocol.task import TaskSpec

from tests.fleet_helpers import make_tiny_sentence_bert, ternary_cls_spec

TEXTS = ["the film was good", "a sad grim day", "it is very lovely", "quite dull food"]


@pytest.fixture(scope="module")
def st_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_sentence_bert(tmp_path_factory.mktemp("stbert") / "model")


def _mask(spec: TaskSpec) -> MaskConfig:
    assert isinstance(spec.scope_options, TernaryOptions)
    return spec.scope_options.mask


def _device(spec: TaskSpec) -> tuple[torch.nn.Module, ModelBundle, TernaryScope]:
    """(a device's packed model loaded from the coordinator's published snapshot of v0, the
    coordinator's bundle, the device's scope)."""
    coord = build_model(spec, initialize=True)
    tensors = publish_ternary(coord.scope.read(), coord.scope)
    model = build_packed_model(spec.model_path, model_kind="seq_cls", num_labels=2)
    scope = load_published_ternary(model, tensors, config=_mask(spec), epoch=0,
                                   expected_checksum=checksum(coord.scope))
    return model, coord, scope


def test_a_ternary_seq_cls_task_is_accepted_and_train_head_is_refused_for_causal_lms(
        st_bert: Path) -> None:
    spec = ternary_cls_spec(st_bert, train_head=True)

    assert spec.scope == "ternary" and spec.model_kind == "seq_cls"
    with pytest.raises(ValueError, match="train_head"):
        TaskSpec(model_path=str(st_bert), model_kind="causal_lm", scope="ternary",
                 scope_options={"train_head": True})


@pytest.mark.parametrize("train_head", [False, True], ids=["latents", "latents+head"])
def test_device_and_coordinator_compute_the_same_logits_and_checksum(st_bert: Path,
                                                                    train_head: bool) -> None:
    spec = ternary_cls_spec(st_bert, train_head=train_head)
    model, coord, scope = _device(spec)
    batch = tokenize(coord.tokenizer, TEXTS, None, 16)

    with torch.no_grad():
        want = coord.model(**batch).logits
        got = model(**batch).logits

    assert torch.equal(got, want)
    assert checksum(scope) == checksum(coord.scope)
    assert ("classifier.weight" in scope.names) is train_head
    assert want.abs().sum() > 0  # the prototype head separates the texts


def test_the_coordinator_sets_the_prototype_head_on_the_ternary_forward(st_bert: Path) -> None:
    bundle = build_model(ternary_cls_spec(st_bert), initialize=True)
    model = bundle.model
    assert isinstance(model, MeanPoolClassifier)

    # the head stays float; every encoder Linear is BitLinear
    assert type(model.classifier) is torch.nn.Linear
    assert len(bitlinear_modules(model)) == 12
    norms = model.classifier.weight.norm(dim=1)
    assert torch.allclose(norms, torch.full_like(norms, 20.0), atol=1e-3)


def test_the_device_never_holds_the_fp32_ternary_matrices(st_bert: Path) -> None:
    spec = ternary_cls_spec(st_bert)
    model, _, scope = _device(spec)

    layers = bitlinear_modules(model)
    assert all(m.weight is None and m.packed is not None for _, m in layers)
    total = sum(m.in_features * m.out_features for _, m in layers)
    assert 0 < scope.numel <= 0.06 * total
    assert not any(p.is_meta for p in model.parameters())


def test_a_snapshot_without_the_head_is_refused_before_the_model_changes(st_bert: Path) -> None:
    spec = ternary_cls_spec(st_bert)
    coord = build_model(spec, initialize=True)
    tensors = publish_ternary(coord.scope.read(), coord.scope)
    del tensors["classifier.weight"]
    model = build_packed_model(spec.model_path, model_kind="seq_cls", num_labels=2)

    with pytest.raises(TernaryFormatError, match="classification head"):
        load_published_ternary(model, tensors, config=_mask(spec), epoch=0)
    assert all(m.packed is None for _, m in bitlinear_modules(model))


def test_the_coordinators_snapshot_bytes_load_on_a_device(st_bert: Path, tmp_path: Path) -> None:
    from seedfed.client.ternary import PackedTernary
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings

    spec = ternary_cls_spec(st_bert, train_head=True)
    with Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                   store_dir=tmp_path / "store")) as coord:
        task = coord.create_task(spec)
        data, chk = coord.snapshot(task, 0, "ternary")
    device = PackedTernary(spec)

    device.load_snapshot(data, 0, chk)

    assert device.scope is not None and checksum(device.scope) == chk
    assert "classifier.bias" in read_snapshot(data)


def test_a_trained_head_survives_the_coordinators_master_state(st_bert: Path) -> None:
    spec = ternary_cls_spec(st_bert, train_head=True)
    before = build_model(spec, initialize=True)
    assert isinstance(before.scope, TernaryScope) and isinstance(before.model, MeanPoolClassifier)
    with torch.no_grad():
        before.model.classifier.weight.add_(0.5)  # as if rounds had trained it
    state = {k: v.clone() for k, v in before.scope.master_state().items()}
    after = build_model(spec, initialize=True)
    assert isinstance(after.scope, TernaryScope) and isinstance(after.model, MeanPoolClassifier)

    after.scope.load_master_state(state)

    assert torch.equal(after.model.classifier.weight, before.model.classifier.weight)
    assert checksum(after.scope) == checksum(before.scope)


def test_selection_none_trains_the_head_alone(st_bert: Path) -> None:
    spec = ternary_cls_spec(st_bert, selection="none", train_head=True)
    model, coord, scope = _device(spec)

    assert scope.names == ["classifier.bias", "classifier.weight"]
    assert coord.scope.names == scope.names
    assert all(m.latent is not None and m.latent.numel() == 0
               for _, m in bitlinear_modules(model))


def test_alternate_epochs_keep_the_trained_head_in_the_master_state_of_a_latent_epoch(
        st_bert: Path) -> None:
    # Arrange: epoch 0 trains the head alone, epoch 1 the latents alone
    spec = ternary_cls_spec(st_bert, train_head=True, alternate=True)
    before = build_model(spec, initialize=True)
    assert isinstance(before.scope, TernaryScope) and isinstance(before.model, MeanPoolClassifier)
    head_epoch = before.scope.names
    with torch.no_grad():
        before.model.classifier.weight.add_(0.5)  # as if the head epoch had trained it
    before.scope.start_epoch(1)
    state = {k: v.clone() for k, v in before.scope.master_state().items()}
    after = build_model(spec, initialize=True)
    assert isinstance(after.scope, TernaryScope) and isinstance(after.model, MeanPoolClassifier)

    # Act
    after.scope.load_master_state(state)

    # Assert
    assert head_epoch == ["classifier.bias", "classifier.weight"]
    assert not any(n.startswith("classifier") for n in before.scope.names)
    assert torch.equal(after.model.classifier.weight, before.model.classifier.weight)
    assert after.scope.names == before.scope.names and after.scope.epoch == 1
    assert checksum(after.scope) == checksum(before.scope)


def test_a_step_scale_of_the_head_is_accepted_in_a_latent_epoch_and_a_typo_is_not(
        st_bert: Path) -> None:
    # Arrange
    spec = ternary_cls_spec(st_bert, train_head=True, alternate=True)
    bundle = build_model(spec, initialize=True)
    assert isinstance(bundle.scope, TernaryScope)
    bundle.scope.start_epoch(1)

    # Act
    bundle.scope.set_step_scales((("classifier.bias", 0.1),))
    bundle.scope.start_epoch(2)

    # Assert
    assert {t.name: t.step_scale for t in bundle.scope}["classifier.bias"] == pytest.approx(0.1)
    with pytest.raises(ScopeError, match="matches no tensor"):
        bundle.scope.set_step_scales((("clasifier", 0.1),))


def test_a_head_epoch_masks_no_latent_even_when_the_selection_is_full(st_bert: Path) -> None:
    # Arrange
    spec = ternary_cls_spec(st_bert, selection="full", train_head=True, alternate=True)

    # Act
    bundle = build_model(spec, initialize=True)

    # Assert
    assert bundle.scope.names == ["classifier.bias", "classifier.weight"]
