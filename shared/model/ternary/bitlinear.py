"""BitLinear: a Linear layer whose forward uses gamma * ternarize(latent), in two storage forms.

- latent form (the coordinator, and full-latent MeZO): `weight` holds the fp32 latents of the
  whole matrix; `mask` (optional, int32 flat indices) marks the trainable ones.
- packed form (a device): `packed` holds the 2-bit codes of every weight; `mask` and `latent`
  hold the fp32 latents of the masked elements only. The forward unpacks the codes of one layer
  at a time and overrides the masked positions with ternarize(latent, gamma).

`gamma` is a float32 buffer that both forms take from the coordinator and keep fixed for a mask
epoch: a device cannot recompute mean |W| without the full latents, and letting it drift with
the latents would make the two sides ternarize differently. Within an epoch, then, both sides
compute the same codes from the same latents, bit for bit.

Activations are fake-quantized per token to `act_bits` (8 in BitNet b1.58; None turns it off).
With gradients enabled on the latent form (first-order pretraining), rounding passes gradients
straight through (STE), as in BitNet training.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from seedfed.shared.model.ternary.quantize import (
    absmean_gamma,
    pack_ternary,
    quantize_activations,
    ternarize,
    unpack_ternary,
)
from seedfed.shared.protocol.errors import ScopeError
from torch import nn

#: Weights unpacked at a time in a forward (one row block); 2^21 float32 weights = 8 MiB.
FORWARD_CHUNK_ELEMENTS = 1 << 21


class BitLinear(nn.Module):
    weight: nn.Parameter | None
    latent: nn.Parameter | None
    packed: torch.Tensor | None
    mask: torch.Tensor | None
    gamma: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 act_bits: int | None = 8) -> None:
        super().__init__()
        if act_bits is not None and not 2 <= act_bits <= 16:
            raise ValueError(f"act_bits must lie in [2, 16] or be None, got {act_bits}")
        self.in_features, self.out_features, self.act_bits = in_features, out_features, act_bits
        self.register_parameter("weight", None)
        self.register_parameter("latent", None)
        self.register_buffer("packed", None)
        self.register_buffer("mask", None)
        self.register_buffer("gamma", torch.ones((), dtype=torch.float32))
        #: The mask epoch whose mask this layer holds (None: no mask chosen yet).
        self.mask_epoch: int | None = None
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_bits: int | None = 8) -> BitLinear:
        """Latent form sharing the Linear's weight as latents (cast to float32 if needed)."""
        m = cls(linear.in_features, linear.out_features, bias=False, act_bits=act_bits)
        w = linear.weight
        latent = w if w.dtype == torch.float32 else nn.Parameter(w.detach().float())
        m.weight = latent  # type: ignore[assignment]
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().float())
        if not w.is_meta:
            m.gamma = absmean_gamma(latent)
        return m

    def load_packed(self, packed: torch.Tensor, gamma: torch.Tensor,
                    mask: torch.Tensor | None = None, latent: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> None:
        """Switch to the packed form with the given codes, gamma and optional masked latents."""
        numel = self.in_features * self.out_features
        if packed.dtype != torch.uint8 or packed.numel() != -(-numel // 4):
            raise ValueError(f"{self.out_features}x{self.in_features} needs {-(-numel // 4)} "
                             f"uint8 codes, got {packed.numel()} {packed.dtype}")
        if (mask is None) != (latent is None):
            raise ValueError("mask and latent come together (both or neither)")
        if mask is not None and latent is not None and mask.numel() != latent.numel():
            raise ValueError(f"{mask.numel()} mask indices but {latent.numel()} latents")
        self.weight = None
        self.packed = packed.reshape(-1)
        self.gamma = gamma.reshape(()).to(torch.float32)
        self.mask = None if mask is None else mask.reshape(-1).to(torch.int32)
        self.latent = None if latent is None else nn.Parameter(
            latent.reshape(-1).to(torch.float32), requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias.float(), requires_grad=False)

    def to_packed(self, keep_latents: bool = True) -> None:
        """Latent form -> packed form: pack the codes, keep only the masked latents (if any)."""
        if self.weight is None:
            return
        packed = pack_ternary(self.codes())
        mask = self.mask
        latent = self.weight.detach().reshape(-1)[mask].clone() if (
            keep_latents and mask is not None) else None
        self.load_packed(packed, self.gamma, mask if latent is not None else None, latent)

    # -- state --------------------------------------------------------------------------------

    @property
    def is_packed(self) -> bool:
        return self.weight is None

    def refresh_gamma(self) -> None:
        """gamma = mean |W| of the current latents (coordinator only: needs every latent)."""
        if self.weight is None:
            raise ScopeError("a packed BitLinear holds too few latents to recompute gamma; "
                             "gamma comes from the coordinator's snapshot")
        self.gamma = absmean_gamma(self.weight)

    def set_mask(self, mask: torch.Tensor | None) -> None:
        """Mark the trainable latents of the latent form (None: all of them)."""
        if self.weight is None:
            raise ScopeError("a packed BitLinear takes its mask from a snapshot")
        self.mask = None if mask is None else mask.reshape(-1).to(torch.int32)

    def codes(self) -> torch.Tensor:
        """The ternary weights the forward uses, int8 (out, in)."""
        return self.ternary_values(torch.int8)

    def ternary_values(self, dtype: torch.dtype) -> torch.Tensor:
        return self.ternary_rows(0, self.out_features, dtype)

    def ternary_rows(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [r0, r1) of the ternary matrix, as `dtype`: only their codes are unpacked."""
        n_in = self.in_features
        if self.weight is not None:
            return ternarize(self.weight[r0:r1], self.gamma).to(dtype)
        if self.packed is None:
            raise ScopeError("this BitLinear holds neither latents nor packed codes (a device's "
                             "layer before its first snapshot): load a snapshot first")
        start, stop = r0 * n_in, r1 * n_in
        b0, b1 = start // 4, -(-stop // 4)
        w = unpack_ternary(self.packed[b0:b1], 4 * (b1 - b0), dtype)[start - 4 * b0:stop - 4 * b0]
        if self.latent is not None and self.mask is not None:
            bounds = torch.tensor([start, stop], dtype=self.mask.dtype)
            i0, i1 = (int(i) for i in torch.searchsorted(self.mask, bounds))
            if i1 > i0:
                w[(self.mask[i0:i1] - start).long()] = ternarize(
                    self.latent[i0:i1], self.gamma).to(dtype)
        return w.view(r1 - r0, n_in)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ste = torch.is_grad_enabled() and self.weight is not None and self.weight.requires_grad
        if self.act_bits is not None:
            xq = quantize_activations(x, self.act_bits)
            x = x + (xq - x).detach() if ste else xq
        if ste:
            assert self.weight is not None
            s = self.weight / self.gamma
            w = s + (torch.clamp(torch.round(s), -1, 1) - s).detach()
            y = F.linear(x, w.to(x.dtype))
        else:
            # Row blocks of at most FORWARD_CHUNK_ELEMENTS weights: the unpacked float matrix
            # never exists whole, so a forward's transient memory stays a few MiB per layer.
            # Both forms use the same blocks, so they compute the same bits.
            rows = max(1, FORWARD_CHUNK_ELEMENTS // self.in_features)
            parts = [F.linear(x, self.ternary_rows(r, min(r + rows, self.out_features), x.dtype))
                     for r in range(0, self.out_features, rows)]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        y = y * self.gamma.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        form = "packed" if self.is_packed else "latent"
        masked = "" if self.mask is None else f", masked={self.mask.numel()}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"form={form}{masked}, act_bits={self.act_bits}")


def bitlinear_modules(model: nn.Module) -> list[tuple[str, BitLinear]]:
    """Every BitLinear of the model with its module path, sorted by path."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, BitLinear)]
    return sorted(found, key=lambda nm: nm[0])


def _hf_bitlinear_type() -> type | None:
    try:
        from transformers.integrations.bitnet import BitLinear as HFBitLinear
    except ImportError:  # an older transformers without BitNet support
        return None
    return HFBitLinear


def _unpack_hf(packed: torch.Tensor) -> torch.Tensor:
    """transformers' BitNet layout: stored row r holds rows r + i * R at bits 2i (i = 0..3)."""
    rows = packed.shape[0]
    parts = [((packed >> (2 * i)) & 3).to(torch.int8) - 1 for i in range(4)]
    return torch.cat(parts, dim=0)[: rows * 4]


def from_hf_bitlinear(module: Any, act_bits: int | None = 8) -> BitLinear:
    """Packed BitLinear from transformers' offline-quantized BitLinear (y = W q / weight_scale,
    so gamma = 1 / weight_scale); latents start at gamma * q."""
    if getattr(module, "rms_norm", None) is not None:
        raise ScopeError("transformers BitLinear with use_rms_norm is not supported")
    q = _unpack_hf(module.weight)[: module.out_features]
    gamma = (1.0 / module.weight_scale.detach().to(torch.float64)).to(torch.float32)
    m = BitLinear(module.in_features, module.out_features, bias=False, act_bits=act_bits)
    m.weight = nn.Parameter(q.to(torch.float32) * gamma)
    m.gamma = gamma.reshape(())
    if module.bias is not None:
        m.bias = nn.Parameter(module.bias.detach().float())
    return m


#: Output heads that stay in full precision when a model is ternarized (BitNet keeps the LM
#: head so; a classifier's head is a few hundred weights that the prototypes initialize).
HEAD_NAMES: tuple[str, ...] = ("lm_head", "classifier", "score")


def convert_to_bitlinear(model: nn.Module, skip: tuple[str, ...] = HEAD_NAMES,
                         act_bits: int | None = 8) -> list[str]:
    """Replace every Linear (and transformers BitNet BitLinear/AutoBitLinear) by a latent-form
    BitLinear, in place; returns the converted module paths. Layers whose last name component
    is in `skip` stay in full precision (BitNet keeps the LM head and embeddings so)."""
    hf_packed = _hf_bitlinear_type()
    converted: list[str] = []
    for name, module in list(model.named_modules()):
        if not name or name.rsplit(".", 1)[-1] in skip or isinstance(module, BitLinear):
            continue
        if isinstance(module, nn.Linear):
            if getattr(module, "rms_norm", None) is not None:
                raise ScopeError(f"{name}: AutoBitLinear with use_rms_norm is not supported")
            new: nn.Module = BitLinear.from_linear(module, act_bits)
        elif hf_packed is not None and isinstance(module, hf_packed):
            new = from_hf_bitlinear(module, act_bits)
        else:
            continue
        model.set_submodule(name, new)
        converted.append(name)
    if not converted:
        raise ScopeError(
            f"{type(model).__name__} has no Linear layers to ternarize (skipping {list(skip)})"
        )
    return sorted(converted)
