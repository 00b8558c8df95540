"""Absmean ternarization (BitNet b1.58) and the packed 2-bit ternary code.

Ternarization of one weight matrix W with scale gamma:

    q = clamp(round(W / gamma), -1, 1)          round half to even, W / gamma in float32
    gamma = max(mean |W|, GAMMA_FLOOR)           one float32 per matrix

The forward then uses gamma * q. A latent w flips between 0 and +-1 where |w| / gamma crosses
1/2: the rounding threshold is gamma / 2 (the clamp at 3/2 never changes the result).

gamma is computed by the coordinator (from its fp32 latents) and shipped as float32. It is an
exact mean (no summation-order dependence), so anyone holding the same latents derives the same
gamma; given gamma, ternarize is elementwise IEEE arithmetic (one division, one round) and
gives the same codes on every platform.

Packed code (2 bits per weight, 4 weights per byte):

- code = q + 1:  0 -> -1,  1 -> 0,  2 -> +1;  3 is invalid (a corrupt file).
- Element i of the matrix flattened row-major goes to byte i // 4, bits 2 * (i % 4) and
  2 * (i % 4) + 1, least significant pair first. A tail that does not fill the last byte is
  padded with code 1 (zero).

This differs from transformers' BitNet packing (which interleaves rows in blocks); a flat order
keeps element i at a fixed byte, so a masked subset of a matrix addresses its codes directly.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import numpy as np
import torch

#: Lower bound of gamma, so an all-zero matrix ternarizes to zeros instead of dividing by zero.
GAMMA_FLOOR = 1e-5
#: Weights per packed byte.
PER_BYTE = 4
#: Code of a zero weight; also the padding code.
ZERO_CODE = 1
INVALID_CODE = 3


def exact_abs_sum(w: torch.Tensor) -> Fraction:
    """sum |w| over a float32 tensor, exactly (a rational), independent of summation order.

    Each |w| is mantissa * 2^(exponent - 150) with an integer mantissa < 2^24. Mantissas are
    summed per exponent with float64 weights, which is exact while a bucket stays under 2^53
    (chunks of 2^28 elements guarantee it); the buckets are then combined with Python integers.
    """
    a = np.abs(w.detach().reshape(-1).to(torch.float32).cpu().numpy())
    total = 0
    for start in range(0, a.size, 1 << 28):
        bits = a[start:start + (1 << 28)].view(np.uint32)
        exp = bits >> np.uint32(23)
        man = (bits & np.uint32(0x7FFFFF)) | ((exp != 0).astype(np.uint32) << np.uint32(23))
        np.maximum(exp, np.uint32(1), out=exp)  # subnormals: exponent field 0 scales as 1
        buckets = np.bincount(exp, weights=man.astype(np.float64), minlength=256)
        total += sum(int(b) << (k - 1) for k, b in enumerate(buckets) if b)
    return Fraction(total, 1 << 149)


def absmean_gamma(w: torch.Tensor) -> torch.Tensor:
    """gamma = max(mean |W|, GAMMA_FLOOR) as a float32 0-d tensor.

    The mean is exact and rounded once to float64 then once to float32, so gamma is a function
    of the latents' bits alone: any platform holding the same latents gets the same gamma (a
    float reduction would depend on its summation order).
    """
    if w.numel() == 0:
        raise ValueError("cannot compute gamma of an empty matrix")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("latents contain NaN or infinity; cannot compute gamma")
    mean = float(exact_abs_sum(w) / w.numel())
    return torch.tensor(max(mean, GAMMA_FLOOR), dtype=torch.float64).to(torch.float32)


def ternarize(w: torch.Tensor, gamma: torch.Tensor | float) -> torch.Tensor:
    """q = clamp(round(w / gamma), -1, 1) as int8, computed in float32."""
    g = torch.as_tensor(gamma, dtype=torch.float32)
    if not bool(g > 0):
        raise ValueError(f"gamma must be positive, got {float(g)}")
    return torch.clamp(torch.round(w.detach().to(torch.float32) / g), -1, 1).to(torch.int8)


def threshold_distance(w: torch.Tensor, gamma: torch.Tensor | float) -> torch.Tensor:
    """| |w| / gamma - 1/2 |: how far (in units of gamma) each latent is from flipping."""
    g = torch.as_tensor(gamma, dtype=torch.float32)
    return (w.detach().to(torch.float32).abs() / g - 0.5).abs()


def packed_size(numel: int) -> int:
    """Bytes holding `numel` ternary weights."""
    return -(-numel // PER_BYTE)


def pack_ternary(q: torch.Tensor) -> torch.Tensor:
    """Flat uint8 codes of an int8 tensor with values in {-1, 0, 1} (see the module doc)."""
    flat = q.reshape(-1)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) > 1):
        lo, hi = int(flat.min()), int(flat.max())
        raise ValueError(f"ternary values must lie in {{-1, 0, 1}}, got range [{lo}, {hi}]")
    n = flat.numel()
    codes = torch.full((packed_size(n) * PER_BYTE,), ZERO_CODE, dtype=torch.uint8)
    codes[:n] = (flat.to(torch.int16) + 1).to(torch.uint8)
    codes = codes.view(-1, PER_BYTE)
    return codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)


@lru_cache(maxsize=1)
def _value_table() -> torch.Tensor:
    """Row b: the four ternary values byte b encodes (code 3 shows as 2, caught by validation)."""
    b = torch.arange(256, dtype=torch.int16).unsqueeze(1)
    codes = (b >> (2 * torch.arange(PER_BYTE, dtype=torch.int16))) & 3
    return (codes - 1).to(torch.int8)


@lru_cache(maxsize=8)
def _float_table(dtype: torch.dtype) -> torch.Tensor:
    return _value_table().to(dtype)


@lru_cache(maxsize=1)
def _invalid_bytes() -> torch.Tensor:
    return (_value_table() == INVALID_CODE - 1).any(dim=1)


def invalid_code_count(packed: torch.Tensor) -> int:
    """How many bytes of `packed` contain the invalid code 3."""
    return int(_invalid_bytes()[packed.reshape(-1).long()].sum())


def unpack_ternary(packed: torch.Tensor, numel: int,
                   dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """The first `numel` ternary values of flat packed codes, as a flat tensor of `dtype`.

    One table gather: each byte indexes a row of four values, so float weights come out
    directly without an int8 intermediate.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed ternary codes must be uint8, got {packed.dtype}")
    if packed.numel() != packed_size(numel):
        raise ValueError(
            f"{numel} ternary weights need {packed_size(numel)} packed bytes, got {packed.numel()}"
        )
    table = _value_table() if dtype == torch.int8 else _float_table(dtype)
    out = torch.nn.functional.embedding(packed.reshape(-1).long(), table)
    return out.view(-1)[:numel]


def quantize_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """BitNet's per-token absmax fake quantization of activations to `bits`-bit integers."""
    qmax = 2 ** (bits - 1) - 1
    scale = qmax / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-qmax - 1, qmax) / scale
