"""`QuantLinear`: a Linear layer stored as group-wise integer codes + float32 scales.

The forward dequantizes this layer's weight into a temporary, multiplies, and drops it, so the
full-precision matrix exists for one layer at a time, never for the whole model. The scales are
an `nn.Parameter` (float32, requires_grad False) read by the forward at call time: a scope over
them is perturbed by the generic `Perturber` in copy mode (in place) and in virtual mode (the
pre-hook swaps `scales.data`) without anything special here. Codes are a buffer, frozen.
"""

from __future__ import annotations

import torch
from seedfed.shared.model.quant.groupwise import (
    dequantize,
    pack_int4,
    padded_width,
    qmax,
    quantize_groups,
    unpack_int4,
)
from torch import nn
from torch.nn import functional as F


class QuantLinear(nn.Module):
    """y = x W^T + b with W = dequantize(codes, scales); int8 codes, or int4 packed in uint8."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int,
                 bias: bool = True, device: torch.device | str | None = None,
                 bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        qmax(bits)  # validates bits
        width = padded_width(in_features, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        shape = (out_features, width) if bits == 8 else (out_features, width // 2)
        self.register_buffer(
            "codes", torch.zeros(shape, dtype=torch.int8 if bits == 8 else torch.uint8,
                                 device=device))
        self.scales = nn.Parameter(
            torch.ones(out_features, width // group_size, dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                         requires_grad=False) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int,
                    weight: torch.Tensor | None = None) -> QuantLinear:
        """Quantize `linear` (or `weight`, standing in for a meta-device linear's weight)."""
        w = linear.weight if weight is None else weight
        has_bias = linear.bias is not None
        bias_dtype = linear.bias.dtype if has_bias else torch.float32
        layer = cls(linear.in_features, linear.out_features, bits, group_size, bias=has_bias,
                    bias_dtype=bias_dtype)
        codes, scales = quantize_groups(w, bits, group_size)
        layer.codes = codes if bits == 8 else pack_int4(codes)
        layer.scales.data = scales
        if has_bias and layer.bias is not None:
            b = linear.bias
            layer.bias.data = (torch.zeros_like(layer.bias) if b is None or b.is_meta
                               else b.detach().clone())
        return layer

    def int_codes(self) -> torch.Tensor:
        """int8 codes of shape (out, padded_in), unpacked for int4."""
        codes: torch.Tensor = self.codes  # type: ignore[assignment]
        return codes if self.bits == 8 else unpack_int4(codes)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight (out, in) this layer currently represents."""
        return dequantize(self.int_codes(), self.scales, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized_weight()
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        b = self.bias
        if b is not None and b.dtype != x.dtype:
            b = b.to(x.dtype)  # type: ignore[assignment]
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}")
