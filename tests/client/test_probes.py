"""The device's probe engine: a shared prefix gives the sequential scalars bit for bit, batched
copies give them to float tolerance, for LoRA, named and quantized scopes on a causal LM and a
mean-pooled BERT classifier; memory limits lower copies per forward, never the scalars."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from seedfed.client import probes
from seedfed.client.probes import ProbeEngine, engine_step, repeat_batch, step_probes
from seedfed.shared.model.classifier import MeanPoolClassifier
from seedfed.shared.model.estimator import ZOConfig, spsa_step
from seedfed.shared.model.lora import apply_lora
from seedfed.shared.model.objectives import (
    causal_lm_loss,
    causal_lm_losses,
    classification_loss,
    classification_losses,
)
from seedfed.shared.model.probe_check import ACTIVATION_FACTOR
from seedfed.shared.model.quant.model import QuantConfig, quantize_model
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.scopes import Scope, build_scope
from seedfed.shared.protocol.task import LoraOptions
from torch import nn
from transformers import BertConfig, BertModel

from tests.shared.conftest import lora_llama, tiny_llama
from tests.shared.devices import DEVICES, host_stream, torch_stream

SEEDS = [11, 12, 13, 14]
#: |g| is O(1) here; batched forwards round matmuls and loss means differently, and g divides
#: the loss difference by 2 eps, so a few float32 ulps of the loss show up as ~1e-4 in g.
G_TOL = 2e-3


def _lm_batch(seed: int = 7, rows: int = 3, length: int = 10) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _sequential(scope: Scope, model: nn.Module, batch: dict, config: ZOConfig,
                loss=causal_lm_loss) -> np.ndarray:  # noqa: ANN001
    def loss_fn() -> float:
        with torch.no_grad():
            return float(loss(model, batch))

    state = scope.read()
    g = spsa_step(scope, loss_fn, SEEDS, config).g
    scope.write(state)
    return g


def _engine(scope: Scope, engine: ProbeEngine, batch: dict, config: ZOConfig) -> np.ndarray:
    state = scope.read()
    g = engine_step(engine, batch, SEEDS, config).g
    scope.write(state)
    return g


@pytest.mark.parametrize("targets", [("layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"),
                                     ("q_proj", "v_proj"), ("layers.1.mlp.down_proj",)])
def test_shared_prefix_gives_the_sequential_scalars_bit_for_bit(targets) -> None:  # noqa: ANN001
    model, scope = lora_llama(targets)
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, causal_lm_loss)

    g = _engine(scope, engine, batch, config)

    assert np.array_equal(g, _sequential(scope, model, batch, config))
    assert engine.stats.shared_modules > 0 and engine.stats.model_calls == 2 * len(SEEDS)


@pytest.mark.parametrize("one_sided", [False, True])
@pytest.mark.parametrize("targets", [("layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"),
                                     ("q_proj", "v_proj")])
def test_batched_copies_give_the_sequential_scalars(targets, one_sided) -> None:  # noqa: ANN001
    model, scope = lora_llama(targets)
    batch = _lm_batch()
    config = ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS), one_sided=one_sided)
    engine = ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses)

    g = _engine(scope, engine, batch, config)

    ref = _sequential(scope, model, batch, config)
    np.testing.assert_allclose(g, ref, atol=G_TOL, rtol=1e-3)
    assert engine.stats.copies_per_forward == len(step_probes(SEEDS, config)) - 1
    assert engine.stats.model_calls == 2  # the recording probe, then every other one at once


def test_linear_copies_run_as_one_batched_matmul_with_the_per_copy_scalars(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, scope = lora_llama(("q_proj", "v_proj"))
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    fused = []
    real = probes._fused_linear
    monkeypatch.setattr(probes, "_fused_linear", lambda *a: fused.append(1) or real(*a))
    g = _engine(scope, ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses), batch,
                config)
    monkeypatch.setattr(probes, "FUSED_WEIGHT_BYTES", 0)  # every copy in turn, as before

    per_copy = _engine(scope, ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses),
                       batch, config)

    assert fused, "the LoRA matrices (plain nn.Linear) took the fused path"
    np.testing.assert_allclose(g, per_copy, atol=G_TOL, rtol=1e-3)


def test_engine_step_updates_theta_with_the_replay_arithmetic() -> None:
    model, scope = lora_llama(("q_proj", "v_proj"))
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    start = scope.read()
    engine_step(ProbeEngine(model, scope, causal_lm_loss), batch, SEEDS, config)
    after_engine = checksum(scope)
    scope.write(start)

    with torch.no_grad():
        spsa_step(scope, lambda: float(causal_lm_loss(model, batch)), SEEDS, config)

    assert checksum(scope) == after_engine != checksum(lora_llama(("q_proj", "v_proj"))[1])


def test_full_scope_with_tied_embeddings_batches_per_copy() -> None:
    model = tiny_llama()
    scope = build_scope("full", model)
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses)

    g = _engine(scope, engine, batch, config)

    np.testing.assert_allclose(g, _sequential(scope, model, batch, config), atol=G_TOL, rtol=1e-3)


def test_quantized_scales_batch_per_copy() -> None:
    model = quantize_model(tiny_llama(), QuantConfig(bits=8, group_size=16))
    scope = build_scope("scales", model, layers=("layers.1.",))
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses)

    g = _engine(scope, engine, batch, config)

    np.testing.assert_allclose(g, _sequential(scope, model, batch, config), atol=G_TOL, rtol=1e-3)
    assert engine.stats.shared_modules > 0  # embeddings and layer 0 ran once


def _pooled_bert() -> MeanPoolClassifier:
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32)
    torch.manual_seed(0)  # only for the random BERT init; nothing under test draws from it
    model = MeanPoolClassifier(BertModel(cfg, add_pooling_layer=False), 2, normalize=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _cls_batch(rows: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 60, (rows, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # a right-padded sentence
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1] * (rows // 2))}


def test_top_output_projection_shares_everything_below_its_input() -> None:
    model = _pooled_bert()
    scope = build_scope("named", model, patterns=("layer.1.output.dense", "classifier"))
    names = {id(m): n for n, m in model.named_modules()}
    batch, config = _cls_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, classification_loss, classification_losses)
    recorded = []
    original = engine._recorder._plan

    def spy(calls, batch_bytes):  # noqa: ANN001, ANN202
        plan = original(calls, batch_bytes)
        recorded.extend(names[id(c.module)] for c in plan.shared)
        return plan

    engine._recorder._plan = spy  # type: ignore[method-assign]

    g = _engine(scope, engine, batch, config)

    assert {"encoder.encoder.layer.1.attention", "encoder.encoder.layer.1.intermediate",
            "encoder.encoder.layer.0", "encoder.embeddings"} <= set(recorded)
    ref = _sequential(scope, model, batch, config, classification_loss)
    np.testing.assert_allclose(g, ref, atol=G_TOL, rtol=1e-3)


def test_groups_of_copies_stack_each_shared_output_once_per_group_size(monkeypatch) -> None:  # noqa: ANN001
    # Arrange: LoRA on the top output projection (its input, the FFN activations, is shared
    # and also passes through LoRA's Identity dropout); 8 probes: the recording pass, then
    # groups of 3, 3 and 1 (a single copy runs unstacked)
    model = apply_lora(_pooled_bert(), LoraOptions(r=4, target_modules=("1.output.dense",)),
                       "seq_cls")
    scope = build_scope("lora", model)
    batch, config = _cls_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, classification_loss, classification_losses, max_copies=3)
    repeats: list[tuple[int, int]] = []
    real = probes._repeat

    def counted(obj, rows, n):  # noqa: ANN001, ANN202
        repeats.append((id(obj), n))
        return real(obj, rows, n)

    monkeypatch.setattr(probes, "_repeat", counted)
    fused = probes._fused_linear
    read_once: list[bool] = []

    def spied(module, entries, group, x, shared_x=None):  # noqa: ANN001, ANN202
        read_once.append(shared_x is not None)
        return fused(module, entries, group, x, shared_x)

    monkeypatch.setattr(probes, "_fused_linear", spied)

    # Act
    g = _engine(scope, engine, batch, config)

    # Assert: the second group of 3 reuses the first one's stacked outputs, and an output two
    # shared modules recorded (the Identity's) is stacked once; the scalars are the sequential
    # ones
    assert engine.stats.copies_per_forward == 3 and repeats
    assert len(set(repeats)) == len(repeats) and {n for _, n in repeats} == {3}
    assert any(read_once)  # LoRA-A read the shared activations once for all copies
    ref = _sequential(scope, model, batch, config, classification_loss)
    np.testing.assert_allclose(g, ref, atol=G_TOL, rtol=1e-3)


def test_feature_cache_and_engine_agree_with_the_uncached_model() -> None:
    model = _pooled_bert()
    scope = build_scope("named", model, patterns=("layer.1.attention.self.query", "classifier"))
    batch, config = _cls_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    ref = _sequential(scope, model, batch, config, classification_loss)
    model.frozen_prefix = 1  # the per-sentence cache of the states entering layer 1

    shared = _engine(scope, ProbeEngine(model, scope, classification_loss), batch, config)
    batched = _engine(scope, ProbeEngine(model, scope, classification_loss,
                                         classification_losses), batch, config)

    np.testing.assert_allclose(shared, ref, atol=1e-4)
    np.testing.assert_allclose(batched, ref, atol=G_TOL, rtol=1e-3)


def test_a_small_budget_lowers_copies_per_forward_and_says_so(caplog) -> None:  # noqa: ANN001
    model, scope = lora_llama(("q_proj", "v_proj"))
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    full = _engine(scope, ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses), batch,
                   config)
    engine = ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses, max_copies=8,
                         budget_mb=0.0)

    with caplog.at_level(logging.WARNING, logger="seedfed.client.probes"):
        g = _engine(scope, engine, batch, config)

    assert engine.stats.limited and engine.stats.copies_per_forward == 1
    assert "fit" in caplog.text
    np.testing.assert_allclose(g, full, atol=G_TOL, rtol=1e-3)


def test_a_head_on_an_uncached_encoder_shares_the_pooled_embedding() -> None:
    # Arrange: only the head trains, the encoder runs (no feature cache); the sentence
    # embedding is a module call, so its output is what every stacked copy repeats
    model = _pooled_bert()
    scope = build_scope("named", model, patterns=("classifier",))
    batch, config = _cls_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, classification_loss, classification_losses)
    hidden = model.encoder.config.hidden_size
    states = 4 * batch["input_ids"].numel() * hidden  # float32 token states of the batch
    pooled = 4 * batch["input_ids"].shape[0] * hidden

    # Act
    g = _engine(scope, engine, batch, config)

    # Assert: one shared module (the embedding; the encoder ran inside it), and a copy holds
    # pooled rows and its batch, not the token states (what it repeated before)
    assert engine.stats.shared_modules == 1
    assert engine.stats.shared_mb * 2**20 == pooled
    assert engine.stats.per_copy_mb * 2**20 < ACTIVATION_FACTOR * states
    np.testing.assert_allclose(g, _sequential(scope, model, batch, config, classification_loss),
                               atol=G_TOL, rtol=1e-3)


def test_a_scope_inside_the_encoder_is_never_shared_through_the_embedding() -> None:
    # Arrange: the sentence-embedding module owns no tensor, but its output depends on the
    # encoder's, which the scope perturbs: shared, every probe would see the same loss
    model = _pooled_bert()
    scope = build_scope("named", model, patterns=("encoder.encoder.layer.1.",))
    batch, config = _cls_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, classification_loss, classification_losses)
    want = _sequential(scope, model, batch, config, classification_loss)

    g = _engine(scope, engine, batch, config)

    assert np.abs(want).max() > 5 * G_TOL  # the layer moves the loss
    np.testing.assert_allclose(g, want, atol=G_TOL, rtol=1e-3)


def test_out_of_memory_halves_copies_per_forward_with_the_same_scalars(caplog) -> None:  # noqa: ANN001
    # Arrange: a device whose allocator fails above 2 stacked copies
    model, scope = lora_llama(("q_proj", "v_proj"))
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    rows = batch["input_ids"].shape[0]

    def tight_losses(model, stacked, copies):  # noqa: ANN001, ANN202
        if copies > 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 1073741824 bytes")
        assert stacked["input_ids"].shape[0] == copies * rows
        return causal_lm_losses(model, stacked, copies)

    engine = ProbeEngine(model, scope, causal_lm_loss, tight_losses, max_copies=7)

    # Act
    with caplog.at_level(logging.WARNING, logger="seedfed.client.probes"):
        g = _engine(scope, engine, batch, config)

    # Assert: the engine halved until a group ran (7 -> 3 -> 1), said so, and the scalars are
    # the sequential ones; the next step starts at what fitted, without failing again
    assert engine.stats.limited and engine.stats.copies_per_forward == 1
    assert "out of memory" in caplog.text
    np.testing.assert_allclose(g, _sequential(scope, model, batch, config), atol=G_TOL, rtol=1e-3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seedfed.client.probes"):
        again = _engine(scope, engine, batch, config)
    assert "out of memory" not in caplog.text
    np.testing.assert_allclose(again, g, atol=G_TOL, rtol=1e-3)


def test_an_error_that_is_not_memory_still_propagates() -> None:
    model, scope = lora_llama(("q_proj", "v_proj"))
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))

    def broken(model, stacked, copies):  # noqa: ANN001, ANN202
        raise RuntimeError("shape mismatch")

    engine = ProbeEngine(model, scope, causal_lm_loss, broken, max_copies=4)

    with pytest.raises(RuntimeError, match="shape mismatch"):
        _engine(scope, engine, batch, config)


def test_max_copies_groups_the_probes() -> None:
    model, scope = lora_llama(("q_proj", "v_proj"))
    batch, config = _lm_batch(), ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    engine = ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses, max_copies=3)

    g = _engine(scope, engine, batch, config)

    assert engine.stats.copies_per_forward == 3 and engine.stats.model_calls == 1 + 3  # 7 = 3+3+1
    np.testing.assert_allclose(g, _sequential(scope, model, batch, config), atol=G_TOL, rtol=1e-3)


def test_probes_leave_theta_untouched() -> None:
    model, scope = lora_llama(("q_proj", "v_proj"))
    before = checksum(scope)
    engine = ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses)

    engine.losses(_lm_batch(), [(1, 1e-3), (1, -1e-3), (2, 1e-3), None])

    assert checksum(scope) == before
    assert not any("forward" in vars(m) for m in model.modules())  # every patch undone


def test_repeat_batch_is_copy_major() -> None:
    batch = {"input_ids": torch.tensor([[1, 2], [3, 4]])}

    out = repeat_batch(batch, 3)

    assert out["input_ids"][:, 0].tolist() == [1, 3, 1, 3, 1, 3]


def test_budget_and_copies_are_validated() -> None:
    model, scope = lora_llama(("q_proj",))
    with pytest.raises(ValueError, match="max_copies"):
        ProbeEngine(model, scope, causal_lm_loss, max_copies=0)
    with pytest.raises(ValueError, match="budget"):
        ProbeEngine(model, scope, causal_lm_loss, budget_mb=float("nan"))


class _WritesInPlace(nn.Module):
    """Builds its weight by writing a scoped tensor into a fresh one (like a packed ternary
    layer unpacking codes and overwriting the masked latents)."""

    def __init__(self) -> None:
        super().__init__()
        self.latent = nn.Parameter(torch.full((3,), 0.5), requires_grad=False)
        self.register_buffer("codes", torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.codes.clone()
        w[0, :3] = self.latent
        return x @ w


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.packed = _WritesInPlace()
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(self.pre(x))


def _square_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"]).square().mean()


def test_a_tensor_written_in_place_still_counts_as_perturbed() -> None:
    model = _Net().eval()
    scope = build_scope("named", model, patterns=("packed.latent",))
    batch = {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(0))}
    engine = ProbeEngine(model, scope, _square_loss)

    plus, minus = engine.losses(batch, [(5, 0.1), (5, -0.1)])

    assert plus != minus and engine.reaches_loss
    assert engine.stats.shared_modules == 1  # `pre` only: `packed` reads the latent


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("layers.1.mlp.down_proj",)])
def test_torch_path_engine_step_gives_the_kernel_paths_bits(device, targets) -> None:  # noqa: ANN001
    # Arrange: batched copies (fused LoRA matmuls fed by `perturbed_pairs`, per-copy swaps
    # fed by `perturbed_pair`) on the kernel path on the host and the torch path on `device`
    host, h_scope = lora_llama(targets)
    moved, d_scope = lora_llama(targets)
    moved.to(device)
    batch = _lm_batch()
    config = ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    h_engine = ProbeEngine(host, h_scope, causal_lm_loss, causal_lm_losses)
    d_engine = ProbeEngine(moved, d_scope, causal_lm_loss, causal_lm_losses)
    # Act
    with host_stream():
        h_result = engine_step(h_engine, batch, SEEDS, config)
    with torch_stream():
        d_result = engine_step(d_engine, {k: v.to(device) for k, v in batch.items()}, SEEDS,
                               config)
    # Assert: one arithmetic on the CPU; elsewhere matmuls may round differently
    assert d_engine.stats.copies_per_forward == h_engine.stats.copies_per_forward > 1
    if device == "cpu":
        assert np.array_equal(d_result.g, h_result.g)
        assert checksum(d_scope) == checksum(h_scope)
    else:
        np.testing.assert_allclose(d_result.g, h_result.g, atol=G_TOL, rtol=1e-3)
