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

On the coordinator the scope also keeps its own schedule (`enter_version`: a new epoch at every
version v with v % epoch_rounds == 0) and its restart state (`master_state`: the full latents,
gammas, masks and epoch, since the masked values alone cannot rebuild a later epoch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch
from seedfed.shared.model.scopes import Scope, ScopedTensor, register_epochs, register_scope
from seedfed.shared.model.ternary.bitlinear import (
    BitLinear,
    bitlinear_modules,
    convert_to_bitlinear,
)
from seedfed.shared.model.ternary.mask import MaskConfig, choose_mask, mask_config
from seedfed.shared.protocol.errors import MissingTensorError, ScopeError
from seedfed.shared.protocol.scope_options import TernaryOptions
from torch import nn

#: Key of the mask epoch (int64 [1]) in a coordinator's master state. Module paths never
#: start with an underscore pair, so it cannot collide with a layer's tensors.
EPOCH_KEY = "__mask_epoch__"


class TernaryScope(Scope):
    """Masked latents of every BitLinear; `config` and `epoch` say how the masks were chosen."""

    kind = "ternary"

    def __init__(self, model: nn.Module, tensors: list[ScopedTensor], config: MaskConfig,
                 epoch: int) -> None:
        super().__init__(model, tensors)
        self.config = config
        self.epoch = epoch

    # -- coordinator: mask epochs and the master file -----------------------------------------

    def enter_version(self, version: int) -> bool:
        """Start mask epoch version // epoch_rounds when `version` begins one (see Scope)."""
        if version <= 0 or not self.config.starts_epoch(version):
            return False
        self.start_epoch(self.config.epoch_of(version))
        return True

    def start_epoch(self, epoch: int) -> None:
        """`start_mask_epoch` on this scope's model, then cover the new masks in place (the
        coordinator's model bundle keeps holding this object)."""
        start_mask_epoch(self.model, self.config, epoch)
        self._rebind(epoch)

    def master_state(self, values: Mapping[str, torch.Tensor] | None = None,
                     ) -> dict[str, torch.Tensor]:
        """Per BitLinear `<p>`: `<p>.weight` every fp32 latent (out x in), `<p>.gamma` [1],
        `<p>.mask` (absent when every latent trains); and the epoch under EPOCH_KEY. The
        tensors alias the live latents (no copy of a model-sized matrix)."""
        del values  # the masked values are a subset of the latents written here
        out: dict[str, torch.Tensor] = {}
        for name, m in bitlinear_modules(self.model):
            if m.weight is None:
                raise ScopeError(f"{name} is packed: only the coordinator's latent form has a "
                                 "master state")
            out[f"{name}.weight"] = m.weight.detach()
            out[f"{name}.gamma"] = m.gamma.reshape(1)
            if m.mask is not None:
                out[f"{name}.mask"] = m.mask
        for t in self._float_tensors():  # a trained classification head (`train_head`)
            out[t.name] = t.tensor.detach()
        out[EPOCH_KEY] = torch.tensor([self.epoch], dtype=torch.int64)
        return out

    def _float_tensors(self) -> list[ScopedTensor]:
        """The trained float head (`train_head`), whether or not this epoch perturbs it: with
        alternate epochs a latent epoch leaves it out of z, and the master state still needs
        the values the head epochs gave it."""
        if not self.config.train_head:
            return []
        return [ScopedTensor(n, p) for n, p in head_parameters(self.model)]

    def step_scale_names(self) -> list[str]:
        """This epoch's tensors and the trained head: with alternate epochs the head's step
        scale names no tensor of a latent epoch, yet applies in the next head epoch."""
        return sorted({*self.names, *(t.name for t in self._float_tensors())})

    def load_master_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what `master_state` wrote: every part is checked before any layer changes.

        A state without EPOCH_KEY is a master file written before mask epochs existed (the
        masked values of epoch 0 only); it loads as such."""
        if EPOCH_KEY not in state:
            self.write(state)
            return
        epoch_t = state[EPOCH_KEY]
        if epoch_t.numel() != 1 or epoch_t.dtype != torch.int64 or int(epoch_t) < 0:
            raise MissingTensorError(f"master state: {EPOCH_KEY} must be one int64 >= 0")
        epoch = int(epoch_t)
        layers = bitlinear_modules(self.model)
        parts = {name: _master_parts(name, m, state) for name, m in layers}
        known = {f"{name}.{p}" for name in parts for p in ("weight", "gamma", "mask")}
        floats = self._float_tensors()
        for t in floats:
            if t.name not in state or state[t.name].numel() != t.tensor.numel():
                raise MissingTensorError(f"master state lacks {t.name} ({t.tensor.numel()} "
                                         "values)")
        known |= {t.name for t in floats}
        extra = sorted(set(state) - known - {EPOCH_KEY})
        if extra:
            raise MissingTensorError(f"master state holds tensors this model lacks: {extra[:5]}")
        with torch.no_grad():
            for name, m in layers:
                weight, gamma, mask = parts[name]
                assert m.weight is not None  # _master_parts checked the form
                m.weight.data.copy_(weight)
                m.gamma = gamma.reshape(()).clone()
                m.mask = None if mask is None else mask.reshape(-1).to(torch.int32).clone()
                m.mask_epoch = epoch
            for t in floats:
                t.tensor.data.copy_(state[t.name].reshape(t.tensor.shape))
        self._rebind(epoch)

    def _rebind(self, epoch: int) -> None:
        Scope.__init__(self, self.model, _scoped_tensors(self.model, self.config, epoch))
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


def _master_parts(name: str, m: BitLinear, state: Mapping[str, torch.Tensor],
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(latents, gamma, mask) of layer `name` in a master state, checked against the layer."""
    if m.weight is None:
        raise ScopeError(f"{name} is packed: a master state loads into the latent form")
    weight, gamma = state.get(f"{name}.weight"), state.get(f"{name}.gamma")
    mask = state.get(f"{name}.mask")
    if weight is None or gamma is None:
        raise MissingTensorError(f"master state lacks the latents or gamma of {name}")
    numel = m.in_features * m.out_features
    if weight.dtype != torch.float32 or weight.numel() != numel:
        raise MissingTensorError(f"{name}: master latents are {weight.numel()} "
                                 f"{weight.dtype}, the layer needs {numel} float32")
    if gamma.dtype != torch.float32 or gamma.numel() != 1 or not bool(gamma > 0):
        raise MissingTensorError(f"{name}: master gamma must be one positive float32")
    if mask is not None:
        idx = mask.reshape(-1).long()
        if mask.dtype != torch.int32 or (idx.numel() and (
                int(idx[0]) < 0 or int(idx[-1]) >= numel or not bool((idx[1:] > idx[:-1]).all()))):
            raise MissingTensorError(f"{name}: master mask is not sorted unique int32 "
                                     f"indices < {numel}")
    return weight.reshape(m.out_features, m.in_features), gamma, mask


#: The float classification heads `train_head` adds to the scope (module name, last part).
CLASS_HEADS = ("classifier", "score")


def head_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The float classification head's parameters (`classifier.weight`, `.bias`), by name."""
    return [(f"{mod_name}.{p_name}", p) for mod_name, mod in model.named_modules()
            if mod_name.rsplit(".", 1)[-1] in CLASS_HEADS and isinstance(mod, nn.Linear)
            for p_name, p in mod.named_parameters(recurse=False)]


def _scoped_tensors(model: nn.Module, config: MaskConfig, epoch: int) -> list[ScopedTensor]:
    tensors = []
    if config.train_head:
        head = head_parameters(model)
        if not head:
            raise ScopeError(f"scope 'ternary': train_head, but {type(model).__name__} has no "
                             f"float classification head ({'/'.join(CLASS_HEADS)})")
        if config.trains_head(epoch):
            tensors += [ScopedTensor(n, p) for n, p in head]
    layers = bitlinear_modules(model)
    for name, m in layers:
        canonical = f"{name}.weight"
        if m.mask is not None and m.mask.numel() == 0:
            continue  # selection 'none' or a head epoch: this layer's latents stay frozen
        if m.latent is not None:
            tensors.append(ScopedTensor(canonical, m.latent, m.mask, compact=True))
        elif m.weight is not None:
            tensors.append(ScopedTensor(canonical, m.weight, m.mask))
    if not tensors:
        raise ScopeError(f"scope 'ternary': {type(model).__name__} holds no latents "
                         "(an inference-only packed model); load a snapshot with latents")
    return tensors


def _scope(model: nn.Module, config: MaskConfig, epoch: int) -> TernaryScope:
    return TernaryScope(model, _scoped_tensors(model, config, epoch), config, epoch)


@register_epochs("ternary")
def version_epoch(options: TernaryOptions | Mapping[str, Any], version: int) -> int:
    """The mask epoch of `version` of a task whose scope options are `options`."""
    return mask_config(options).epoch_of(version)


@register_scope("ternary", options=TernaryOptions)
def _build_from_options(model: nn.Module, options: TernaryOptions, epoch: int = 0,
                        convert: bool = True) -> TernaryScope:
    """`build_ternary_scope` with a task's typed options (`build_scope("ternary", ...)`)."""
    return build_ternary_scope(model, epoch=epoch, convert=convert, act_bits=options.act_bits,
                               **asdict(options.mask))


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
