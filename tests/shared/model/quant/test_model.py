from __future__ import annotations

import pytest
import torch
from seedfed.shared.model.quant import (
    GroupSizeError,
    NoQuantizableLayersError,
    QuantConfig,
    QuantLinear,
    build_quantized,
    quant_layers,
    quantize_model,
)
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM


def _llama(config: LlamaConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)  # transformers' own init uses the global RNG; pin it for the test
    return LlamaForCausalLM(config).eval()


def test_quantize_model_replaces_linears_and_keeps_lm_head_float(
        tiny_llama_config: LlamaConfig, token_batch: dict[str, torch.Tensor]) -> None:
    model = _llama(tiny_llama_config)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    with torch.no_grad():
        before = model(**token_batch).logits

    quantize_model(model, QuantConfig(bits=8, group_size=32))

    assert len(quant_layers(model)) == n_linear - 1
    assert type(model.lm_head) is nn.Linear
    with torch.no_grad():
        after = model(**token_batch).logits
    assert (after - before).abs().max() < 0.05 * before.abs().max()


def test_bert_classifier_stays_float() -> None:
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)

    quantize_model(model, QuantConfig(bits=4, group_size=32))

    assert type(model.classifier) is nn.Linear
    assert isinstance(model.bert.encoder.layer[0].attention.self.query, QuantLinear)


def test_model_without_linear_layers_is_refused() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8))

    with pytest.raises(NoQuantizableLayersError, match="no nn.Linear"):
        quantize_model(model, QuantConfig())


def test_only_skipped_linears_count_as_none() -> None:
    model = nn.ModuleDict({"lm_head": nn.Linear(8, 8)})

    with pytest.raises(NoQuantizableLayersError, match="lm_head"):
        quantize_model(model, QuantConfig())


def test_indivisible_width_is_refused_without_padding_and_nothing_changes() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 40), nn.Linear(40, 4))

    with pytest.raises(GroupSizeError, match=r"does not divide.*2 \(40\)"):
        quantize_model(model, QuantConfig(group_size=32, pad=False))
    assert all(type(m) is nn.Linear for m in model)


def test_indivisible_width_is_padded_by_default() -> None:
    model = nn.Sequential(nn.Linear(40, 4))
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)

    quantize_model(model, QuantConfig(group_size=32))

    assert model[0].scales.shape == (4, 2)
    with torch.no_grad():
        assert torch.allclose(model(x), before, atol=0.02)


@pytest.mark.parametrize("bad", [{"bits": 3}, {"group_size": 33}, {"group_size": 0}])
def test_config_validation_names_the_bad_value(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=str(next(iter(bad.values())))):
        QuantConfig(**bad)


def test_build_quantized_never_materializes_float_linears(
        tiny_llama_config: LlamaConfig, token_batch: dict[str, torch.Tensor]) -> None:
    seen: list[str] = []
    original = QuantLinear.from_linear.__func__  # type: ignore[attr-defined]

    def spy(cls: type, linear: nn.Linear, bits: int, group_size: int,
            weight: torch.Tensor | None = None) -> QuantLinear:
        seen.append("meta" if linear.weight.is_meta else "float")
        return original(cls, linear, bits, group_size, weight)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(QuantLinear, "from_linear", classmethod(spy))
        model = build_quantized(tiny_llama_config, QuantConfig(bits=4, group_size=32), seed=1)

    assert seen and set(seen) == {"meta"}
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    with torch.no_grad():
        logits = model(**token_batch).logits
    assert torch.isfinite(logits).all()


def test_build_quantized_is_deterministic_per_seed(tiny_llama_config: LlamaConfig) -> None:
    a = build_quantized(tiny_llama_config, QuantConfig(bits=4, group_size=32), seed=5)
    b = build_quantized(tiny_llama_config, QuantConfig(bits=4, group_size=32), seed=5)
    c = build_quantized(tiny_llama_config, QuantConfig(bits=4, group_size=32), seed=6)

    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.codes"],
                           sc["model.layers.0.mlp.up_proj.codes"])
