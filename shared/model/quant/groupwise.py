"""Group-wise symmetric (absmax) quantization of a weight matrix, and int4 packing.

A weight W of shape (out, in) is cut along its input dimension into groups of `group_size`
consecutive columns. Each group g of row r gets one float32 scale s = max|W[r, g]| / qmax and
integer codes q = clamp(round(W / s), -qmax, qmax), with qmax = 127 for int8 and 7 for int4
(symmetric: -8 is never produced). `torch.round` rounds halves to even. A group of zeros gets
scale 1.0 (its codes are 0, so any scale dequantizes it exactly).

When `group_size` does not divide `in`, the columns are padded with zeros up to the next
multiple; the padding never influences a scale (zeros do not raise an absmax), its codes are 0,
and dequantization drops it again. The caller decides whether padding is allowed.

int4 packing: two codes per byte, each stored as the unsigned nibble q + 8 (0..15). Along the
last dimension, element 2k sits in the LOW nibble of byte k and element 2k+1 in the HIGH nibble
(byte = (q[2k] + 8) | (q[2k+1] + 8) << 4). The last dimension must be even.
"""

from __future__ import annotations

import torch
from seedfed.shared.model.quant.errors import GroupSizeError

BITS: tuple[int, ...] = (4, 8)


def qmax(bits: int) -> int:
    """Largest code magnitude for a bit width (symmetric range)."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return (1 << (bits - 1)) - 1


def padded_width(in_features: int, group_size: int) -> int:
    """Input width after padding to a whole number of groups."""
    if group_size < 2 or group_size % 2:
        raise GroupSizeError(f"group size must be an even integer >= 2, got {group_size}")
    return -(-in_features // group_size) * group_size


def quantize_groups(weight: torch.Tensor, bits: int, group_size: int,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, shape (out, padded_in)) and scales (float32, shape (out, groups)) of W."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    q = qmax(bits)
    out_f, in_f = weight.shape
    width = padded_width(in_f, group_size)
    w = weight.detach().to(torch.float32)
    if width != in_f:
        w = torch.nn.functional.pad(w, (0, width - in_f))
    groups = w.view(out_f, width // group_size, group_size)
    absmax = groups.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / q, torch.ones_like(absmax))
    codes = torch.round(groups / scales.unsqueeze(-1)).clamp_(-q, q).to(torch.int8)
    return codes.view(out_f, width), scales.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """float32 W of shape (out, in_features) from int8 codes (out, padded_in) and scales."""
    out_f, width = codes.shape
    n_groups = scales.shape[-1]
    if width % n_groups or scales.shape[0] != out_f:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} disagree")
    w = codes.view(out_f, n_groups, width // n_groups).to(torch.float32)
    w.mul_(scales.unsqueeze(-1))  # in place on the fresh copy: one temporary per layer, not two
    w = w.view(out_f, width)
    return w if width == in_features else w[:, :in_features]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 bytes holding two int4 codes each (low nibble first), last dimension halved."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < -8 or int(codes.max()) > 7):
        raise ValueError("int4 codes must lie in [-8, 7]")
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 codes from `pack_int4` bytes: the last dimension doubles."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed int4 data must be uint8, got {packed.dtype}")
    lo = (packed & 0x0F).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    out = torch.stack((lo, hi), dim=-1).view(*packed.shape[:-1], packed.shape[-1] * 2)
    return out - 8
