from __future__ import annotations

import pytest
import torch
from seedfed.shared.model.quant import QuantLinear, dequantize, quantize_groups
from torch import nn
from torch.nn import functional as F


def _linear(inp: int, out: int, bias: bool = True) -> nn.Linear:
    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, inp, generator=gen) * 0.1)
        if bias:
            layer.bias.copy_(torch.randn(out, generator=gen))
    return layer


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("inp", [64, 72])  # 72: padded to 96 with group size 32
def test_forward_equals_reference_dequantize_then_matmul(bits: int, inp: int) -> None:
    linear = _linear(inp, 24)
    x = torch.randn(3, 5, inp, generator=torch.Generator().manual_seed(4))
    codes, scales = quantize_groups(linear.weight, bits, 32)
    reference = F.linear(x, dequantize(codes, scales, inp), linear.bias)

    q = QuantLinear.from_linear(linear, bits, 32)

    with torch.no_grad():
        assert torch.equal(q(x), reference)
    assert torch.equal(q.int_codes(), codes)
    assert q.codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert q.codes.numel() == codes.numel() * bits // 8


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.3)])
def test_forward_stays_close_to_the_float_layer(bits: int, tol: float) -> None:
    linear = _linear(128, 32)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(5))

    q = QuantLinear.from_linear(linear, bits, 64)

    with torch.no_grad():
        err = (q(x) - linear(x)).abs().max() / linear(x).abs().max()
    assert err < tol


def test_forward_follows_the_input_dtype_and_reads_scales_at_call_time() -> None:
    q = QuantLinear.from_linear(_linear(64, 8, bias=False), 8, 32)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))

    with torch.no_grad():
        y = q(x)
        y16 = q(x.to(torch.bfloat16))
        q.scales.mul_(2.0)
        doubled = q(x)

    assert y16.dtype == torch.bfloat16
    assert torch.allclose(doubled, 2 * y)
    assert q.scales.dtype == torch.float32 and not q.scales.requires_grad
