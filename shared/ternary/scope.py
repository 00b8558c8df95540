"""The `ternary` scope (TerMeZO): masked latent weights of a BitLinear model.

z covers, for each BitLinear (canonical name `<module path>.weight`, in name order), the masked
elements of its latent matrix: sorted flat indices, z for element i taken at position i of the
whole matrix's stream. Both sides express the same elements differently:

- coordinator (latent form): the full fp32 latent matrix plus its indices;
- device (packed form): a compact fp32 tensor of just the masked latents, `compact=True`.

Values, checksums and replayed bits are identical on both (the compact tensor is the gathered
subset, and each element sees the same float32 additions). Masks are chosen at the start of a
mask epoch by `start_mask_epoch` (coordinator), which also refreshes gamma; within an epoch
gamma and the mask are frozen, so the device's ternarize(latent, gamma) equals the
coordinator's for every element.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import ScopeError
from ..scopes import Scope, ScopedTensor, register_scope
from .bitlinear import bitlinear_modules, convert_to_bitlinear
from .mask import MaskConfig, choose_mask


class TernaryScope(Scope):
    """Masked latents of every BitLinear; `config` and `epoch` say how the masks were chosen."""

    kind = "ternary"

    def __init__(self, model: nn.Module, tensors: list[ScopedTensor], config: MaskConfig,
                 epoch: int) -> None:
        super().__init__(model, tensors)
        self.config = config
        self.epoch = epoch

    def device_bytes(self) -> dict[str, int]:
        """Bytes a device holds per part: packed codes, gammas, mask indices, masked latents."""
        parts = {"packed": 0, "gamma": 0, "mask": 0, "latent": 0}
        for _, m in bitlinear_modules(self.model):
            numel = m.in_features * m.out_features
            parts["packed"] += -(-numel // 4)
            parts["gamma"] += 4
            covered = numel if m.mask is None else m.mask.numel()
            parts["mask"] += 0 if m.mask is None else 4 * covered
            parts["latent"] += 4 * covered
        return parts


def start_mask_epoch(model: nn.Module, config: MaskConfig, epoch: int) -> TernaryScope:
    """Coordinator: refresh gamma (if configured) and re-choose every mask; returns the scope.

    Needs the latent form (the full fp32 latents). Call it at the rounds where
    `config.starts_epoch(round)`, then publish a snapshot: devices re-sync from it, because
    both the mask and (with `refresh_gamma`) every code may have changed.
    """
    layers = bitlinear_modules(model)
    if not layers:
        raise ScopeError(f"{type(model).__name__} has no BitLinear layers; convert it first")
    for name, m in layers:
        if m.weight is None:
            raise ScopeError(f"{name} is packed: only the coordinator (latent form) picks masks")
        if config.refresh_gamma:
            m.refresh_gamma()
        m.set_mask(choose_mask(config, m.weight, m.gamma, f"{name}.weight", epoch))
        m.mask_epoch = epoch
    return _scope(model, config, epoch)


def _scope(model: nn.Module, config: MaskConfig, epoch: int) -> TernaryScope:
    tensors = []
    for name, m in bitlinear_modules(model):
        canonical = f"{name}.weight"
        if m.latent is not None:
            tensors.append(ScopedTensor(canonical, m.latent, m.mask, compact=True))
        elif m.weight is not None:
            tensors.append(ScopedTensor(canonical, m.weight, m.mask))
    if not tensors:
        raise ScopeError(f"scope 'ternary': {type(model).__name__} holds no latents "
                         "(an inference-only packed model); load a snapshot with latents")
    return TernaryScope(model, tensors, config, epoch)


@register_scope("ternary")
def build_ternary_scope(model: nn.Module, epoch: int = 0, convert: bool = True,
                        act_bits: int | None = 8, **mask_options: Any) -> TernaryScope:
    """The ternary scope of `model`.

    A model without BitLinear layers is converted in place (Linear -> BitLinear, LM head kept)
    when `convert`. Latent-form layers that have no mask yet get one from `mask_options`
    (MaskConfig fields) for mask epoch `epoch` -- a function of the latents and gamma only, so
    any holder of the same latents derives the same mask. Packed layers use the mask their
    snapshot carried.
    """
    config = MaskConfig(**mask_options)
    if not bitlinear_modules(model):
        if not convert:
            raise ScopeError(f"{type(model).__name__} has no BitLinear layers (convert=False)")
        convert_to_bitlinear(model, act_bits=act_bits)
    for name, m in bitlinear_modules(model):
        if m.weight is not None and getattr(m, "mask_epoch", None) is None:
            m.set_mask(choose_mask(config, m.weight, m.gamma, f"{name}.weight", epoch))
            m.mask_epoch = epoch
    return _scope(model, config, epoch)
