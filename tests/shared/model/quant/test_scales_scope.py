from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from seedfed.client.trainer import LocalTrainer
from seedfed.shared.model.objectives import causal_lm_loss
from seedfed.shared.model.quant import (
    DEFAULT_DDC_CLIP,
    QuantConfig,
    build_quantized,
    load_quantized,
    plan_clip,
    quant_layers,
    save_quantized,
)
from seedfed.shared.model.replay import apply_seeds, checksum, replay
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.model.stream import rademacher
from seedfed.shared.protocol.aggregate import build_entry
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.wire import RoundPlan
from torch import nn
from transformers import LlamaConfig

QUANT = QuantConfig(bits=4, group_size=32)


def _plan() -> RoundPlan:
    return RoundPlan(task_id="qzo", round=0, version=0, seeds=[[11, 12], [13, 14]], lr=1e-3,
                     eps=1e-3, batch_size=2, clip=plan_clip("scales", None), scope="scales")


def test_scope_covers_exactly_the_scales(tiny_llama_config: LlamaConfig) -> None:
    model = build_quantized(tiny_llama_config, QUANT)

    scope = build_scope("scales", model)

    layers = quant_layers(model)
    assert scope.names == sorted(f"{n}.scales" for n, _ in layers)
    assert scope.numel == sum(m.scales.numel() for _, m in layers)
    assert all(t.tensor.dtype == torch.float32 for t in scope)


def test_include_adds_named_float_parameters(tiny_llama_config: LlamaConfig) -> None:
    model = build_quantized(tiny_llama_config, QUANT)

    scope = build_scope("scales", model, include=("lm_head",))

    assert "lm_head.weight" in scope.names


def test_layers_restricts_the_scales_to_matching_modules(tiny_llama_config: LlamaConfig,
                                                         ) -> None:
    model = build_quantized(tiny_llama_config, QUANT)

    scope = build_scope("scales", model, layers=("layers.1.",))

    top = [n for n, _ in quant_layers(model) if "layers.1." in n]
    assert top and scope.names == sorted(f"{n}.scales" for n in top)
    with pytest.raises(ScopeError, match="no quantized layer path contains"):
        build_scope("scales", model, layers=("nowhere",))


def test_scope_on_an_unquantized_model_is_refused() -> None:
    with pytest.raises(ScopeError, match="no quantized layers"):
        build_scope("scales", nn.Sequential(nn.Linear(4, 4)))


def test_task_options_must_match_the_quantized_layers(tiny_llama_config: LlamaConfig) -> None:
    model = build_quantized(tiny_llama_config, QUANT)

    build_scope("scales", model, group_size=32, bits=4)
    with pytest.raises(ScopeError, match="group_size=64"):
        build_scope("scales", model, group_size=64)
    with pytest.raises(ScopeError, match="bits=8"):
        build_scope("scales", model, bits=8)


def test_ddc_clip_defaults_to_100_for_scales_only() -> None:
    assert plan_clip("scales", None) == DEFAULT_DDC_CLIP == 100.0
    assert plan_clip("scales", 5.0) == 5.0
    assert plan_clip("full", None) is None


def test_update_clamps_scales_to_the_floor_exactly(tiny_llama_config: LlamaConfig) -> None:
    model = build_quantized(tiny_llama_config, QUANT)
    scope = build_scope("scales", model, floor=1e-4)
    first = next(iter(scope))
    start = first.values()
    coef = -float(start.abs().max()) * 4  # large enough to push about half the scales below 0

    apply_seeds(scope, [21], [coef])

    z = rademacher(21, first.name, first.numel)
    expected = (start + np.float32(coef) * z).clamp(min=1e-4)
    got = first.values()
    assert torch.equal(got, expected)
    assert (got == 1e-4).any() and got.min() == pytest.approx(1e-4)


def _round(model: nn.Module, batch: dict[str, torch.Tensor], mode: str) -> tuple[np.ndarray, str]:
    scope = build_scope("scales", model)
    trainer = LocalTrainer(model, scope, causal_lm_loss, mode=mode)
    before = checksum(scope)
    result = trainer.run(_plan(), iter([batch, batch]))
    assert checksum(scope) == before  # local steps never become shared state
    return result.scalars, before


def test_copy_and_virtual_perturbation_give_the_same_scalars(
        tiny_llama_config: LlamaConfig, token_batch: dict[str, torch.Tensor]) -> None:
    a = build_quantized(tiny_llama_config, QUANT, seed=4)
    b = build_quantized(tiny_llama_config, QUANT, seed=4)

    g_copy, _ = _round(a, token_batch, "copy")
    g_virtual, _ = _round(b, token_batch, "virtual")

    assert np.array_equal(g_copy, g_virtual)
    assert np.abs(g_copy).min() > 0  # the probes really moved the forward


def test_federated_round_replays_bit_exactly_on_device_and_coordinator(
        tmp_path: Path, tiny_llama_config: LlamaConfig,
        token_batch: dict[str, torch.Tensor]) -> None:
    coordinator = build_quantized(tiny_llama_config, QUANT, seed=9)
    save_quantized(coordinator, tmp_path / "v0")
    device = load_quantized(tmp_path / "v0")  # built independently, from the published file
    codes_before = {n: m.codes.clone() for n, m in quant_layers(device)}
    plan = _plan()

    g, v0 = _round(device, token_batch, "auto")
    entry = build_entry(plan.task_id, 0, plan.flat_seeds, g.reshape(1, -1), np.array([4.0]),
                        plan.lr, plan.perturbations)
    coord_scope = build_scope("scales", coordinator)
    assert checksum(coord_scope) == v0
    apply_seeds(coord_scope, entry.seeds, entry.coefs)
    signed = LogEntry(entry.task_id, entry.base_version, entry.seeds, entry.coefs,
                      checksum(coord_scope))
    version = replay(build_scope("scales", device), [signed], task_id="qzo", version=0)

    assert version == 1
    assert checksum(build_scope("scales", device)) == signed.checksum != v0
    assert all(torch.equal(m.codes, codes_before[n]) for n, m in quant_layers(device))
