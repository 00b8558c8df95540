from __future__ import annotations

import pytest
import torch
from seedfed.shared.model.quant import (
    QuantConfig,
    build_quantized,
    publish_int4,
    publish_int8,
    read_published,
)
from seedfed.shared.model.scopes import build_scope
from torch import nn
from transformers import LlamaConfig


def _float_model() -> nn.Module:
    gen = torch.Generator().manual_seed(8)
    model = nn.Sequential(nn.Linear(96, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("bits,publisher,tol", [(8, publish_int8, 0.002), (4, publish_int4, 0.03)])
def test_float_scope_publishes_wide_matrices_quantized_and_reads_back(bits, publisher, tol) -> None:
    scope = build_scope("full", _float_model())
    state = scope.read()

    published = publisher(state, scope)
    back = read_published(published, scope, bits)

    assert published["0.weight.codes"].numel() == 16 * 128 * bits // 8  # 96 padded to 128
    assert "2.weight" in published and "2.weight.codes" not in published  # 16 < one group
    assert torch.equal(back["1.weight"], state["1.weight"])
    assert (back["0.weight"] - state["0.weight"]).abs().max() < tol
    scope.write(back)  # shapes and names match the scope


def test_scales_scope_publishes_the_scales_unchanged(tiny_llama_config: LlamaConfig) -> None:
    model = build_quantized(tiny_llama_config, QuantConfig(bits=4, group_size=32))
    scope = build_scope("scales", model)
    state = scope.read()

    published = publish_int4(state, scope)

    assert set(published) == set(state)
    assert all(torch.equal(published[k], state[k]) for k in state)
    assert all(torch.equal(v, state[k]) for k, v in read_published(published, scope, 4).items())
