from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from seedfed.shared.model.ternary import (
    BitLinear,
    absmean_gamma,
    bitlinear_modules,
    convert_to_bitlinear,
    quantize_activations,
    ternarize,
    threshold_mask,
)
from seedfed.shared.protocol.errors import ScopeError
from torch import nn


def _linear(seed: int = 0, bias: bool = True) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(24, 20, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(20, 24, generator=gen) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(20, generator=gen) * 0.01)
    return lin


def test_forward_is_gamma_times_ternary_matmul_of_quantized_activations() -> None:
    # Arrange
    lin = _linear()
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))
    gamma = absmean_gamma(lin.weight)
    ref = F.linear(quantize_activations(x, 8), ternarize(lin.weight, gamma).float()) * gamma
    ref = ref + lin.bias
    # Act
    with torch.no_grad():
        y = BitLinear.from_linear(lin, act_bits=8)(x)
    # Assert
    assert torch.allclose(y, ref, atol=1e-6)


def test_packed_form_computes_the_same_bits_as_the_latent_form() -> None:
    lin = _linear()
    x = torch.randn(2, 24, generator=torch.Generator().manual_seed(1))
    latent = BitLinear.from_linear(lin)
    packed = BitLinear.from_linear(_linear())
    packed.to_packed()
    with torch.no_grad():
        assert torch.equal(latent(x), packed(x))
    assert packed.is_packed and packed.weight is None


def test_masked_latents_override_the_packed_codes() -> None:
    # Arrange: a packed layer holding latents for 3 elements
    lin = _linear(bias=False)
    m = BitLinear.from_linear(lin)
    gamma = m.gamma.clone()
    mask = torch.tensor([0, 5, 17], dtype=torch.int32)
    m.set_mask(mask)
    m.to_packed()
    before = m.codes().clone()
    # Act: push the three latents far positive
    assert m.latent is not None
    with torch.no_grad():
        m.latent.fill_(10 * float(gamma))
    after = m.codes()
    # Assert: exactly those positions now read +1, everything else unchanged
    assert after.reshape(-1)[mask.long()].tolist() == [1, 1, 1]
    keep = torch.ones(after.numel(), dtype=torch.bool)
    keep[mask.long()] = False
    assert torch.equal(after.reshape(-1)[keep], before.reshape(-1)[keep])


def test_load_packed_checks_its_inputs() -> None:
    m = BitLinear(8, 4)
    with pytest.raises(ValueError, match="needs 8 uint8 codes"):
        m.load_packed(torch.zeros(3, dtype=torch.uint8), torch.tensor(1.0))
    with pytest.raises(ValueError, match="both or neither"):
        m.load_packed(torch.zeros(8, dtype=torch.uint8), torch.tensor(1.0),
                      mask=torch.tensor([1], dtype=torch.int32))


def test_packed_layer_cannot_recompute_gamma_or_pick_a_mask() -> None:
    m = BitLinear.from_linear(_linear())
    m.to_packed()
    with pytest.raises(ScopeError, match="gamma"):
        m.refresh_gamma()
    with pytest.raises(ScopeError, match="mask"):
        m.set_mask(None)


def test_straight_through_gradients_reach_the_latents() -> None:
    m = BitLinear.from_linear(_linear())
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(2))
    m(x).pow(2).sum().backward()
    assert m.weight is not None and m.weight.grad is not None
    assert float(m.weight.grad.abs().sum()) > 0


def test_convert_llama_replaces_every_linear_but_the_head(llama: nn.Module) -> None:
    n_linear = sum(isinstance(m, nn.Linear) for m in llama.modules())
    converted = convert_to_bitlinear(llama)
    assert len(converted) == n_linear - 1
    assert isinstance(llama.lm_head, nn.Linear)
    assert [n for n, _ in bitlinear_modules(llama)] == converted


def test_convert_bitnet_for_causal_lm(bitnet: nn.Module, tokens: torch.Tensor) -> None:
    convert_to_bitlinear(bitnet)
    with torch.no_grad():
        logits = bitnet(input_ids=tokens).logits
    assert len(bitlinear_modules(bitnet)) == 14
    assert torch.isfinite(logits).all()


def test_convert_refuses_a_model_without_linear_layers() -> None:
    with pytest.raises(ScopeError, match="no Linear layers"):
        convert_to_bitlinear(nn.Sequential(nn.Embedding(4, 4), nn.LayerNorm(4)))


def test_transformers_packed_bitlinear_is_imported_with_gamma_from_weight_scale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' BitNet helpers are torch.compile'd: run them eagerly
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    from transformers.integrations.bitnet import BitLinear as HFBitLinear
    from transformers.integrations.bitnet import pack_weights

    # Arrange: an offline-quantized transformers layer, W = q / weight_scale
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-1, 2, (16, 12), generator=gen).to(torch.float32)
    hf = HFBitLinear(12, 16, bias=False, dtype=torch.float32)
    hf.weight.copy_(pack_weights(q.clone()))
    hf.weight_scale.fill_(4.0)
    x = torch.randn(3, 12, generator=gen)
    model = nn.Sequential(hf)
    # Act
    convert_to_bitlinear(model, skip=())
    ours = model[0]
    # Assert
    assert isinstance(ours, BitLinear)
    assert torch.equal(ours.codes(), q.to(torch.int8))
    assert float(ours.gamma) == 0.25
    with torch.no_grad():
        assert torch.allclose(ours(x), hf(x), rtol=1e-5, atol=1e-6)


def test_row_blocked_forward_matches_across_forms_with_moved_masked_latents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: blocks of 4 rows (24 inputs, 100 weights per block), 20% of latents masked
    monkeypatch.setattr("seedfed.shared.model.ternary.bitlinear.FORWARD_CHUNK_ELEMENTS", 100)
    coord = BitLinear.from_linear(_linear(3))
    assert coord.weight is not None
    coord.set_mask(threshold_mask(coord.weight, coord.gamma, 0.2))
    dev = BitLinear.from_linear(_linear(3))
    dev.set_mask(coord.mask)
    dev.to_packed()
    assert dev.latent is not None and coord.mask is not None
    # Act: the same move of the masked latents on both sides
    with torch.no_grad():
        dev.latent.add_(0.03)
        coord.weight.view(-1)[coord.mask.long()] += 0.03
        x = torch.randn(3, 24, generator=torch.Generator().manual_seed(8))
        y_dev, y_coord = dev(x), coord(x)
    # Assert
    assert torch.equal(dev.codes(), coord.codes())
    assert torch.equal(y_dev, y_coord)
