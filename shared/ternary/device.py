"""Device side of a ternary task: load the coordinator's published snapshot into a packed model.

The coordinator publishes, per version, `publish_ternary`'s tensors: for each BitLinear `<p>`,
`<p>.packed` (2-bit codes of every weight), `<p>.gamma`, `<p>.bias` if any, and `<p>.mask` +
`<p>.latent` (the masked latents), or `<p>.weight` when every latent trains. A device builds
the task's model from its TaskSpec (Linear -> BitLinear), may pack it at once, and then takes
everything ternary from a snapshot: at join time, and again at every mask epoch start, because
its packed form holds only the latents the old mask selected.

`load_published_ternary` checks the whole snapshot (layer set, codes, mask order, and the
version's checksum, computed from the snapshot's own latents) before any layer changes, so a
refused snapshot leaves the device's model as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..replay import state_checksum
from .bitlinear import BitLinear, bitlinear_modules
from .errors import TernaryChecksumError, TernaryFormatError
from .mask import MaskConfig
from .scope import TernaryScope, _scope
from .snapshot import _LAYER_PARTS, _fill_layer

#: What the error messages call a snapshot that did not come from a file.
SOURCE = "published ternary snapshot"


def published_state(tensors: Mapping[str, torch.Tensor],
                    layers: list[tuple[str, BitLinear]]) -> dict[str, torch.Tensor]:
    """The scope state (canonical name -> covered latents) a snapshot carries, for `layers`."""
    state: dict[str, torch.Tensor] = {}
    for name, _ in layers:
        values = tensors.get(f"{name}.latent", tensors.get(f"{name}.weight"))
        if values is None:
            raise TernaryFormatError(f"{SOURCE}: layer {name} carries no latents (an "
                                     "inference-only snapshot cannot train)")
        state[f"{name}.weight"] = values.reshape(-1)
    return state


def load_published_ternary(model: nn.Module, tensors: Mapping[str, torch.Tensor], *,
                           config: MaskConfig, epoch: int,
                           expected_checksum: str | None = None) -> TernaryScope:
    """Put a published ternary snapshot into `model`'s BitLinear layers; returns the scope.

    `model` holds the task's BitLinear layers in either form (a fresh conversion or an older
    packed state); afterwards each layer is packed with the snapshot's codes, gamma, mask and
    masked latents (or, for full-latent tasks, holds every latent). `config` and `epoch` are
    the task's mask configuration and the version's mask epoch, recorded on the scope.
    With `expected_checksum` (the version's), a snapshot whose latents hash differently is
    refused with TernaryChecksumError before the model changes.
    """
    layers = bitlinear_modules(model)
    if not layers:
        raise TernaryFormatError(f"{type(model).__name__} has no BitLinear layers; build the "
                                 "task's model (scope 'ternary' converts it) first")
    layer_names = {n for n, _ in layers}
    stray = sorted(k for k in tensors if k.rpartition(".")[0] not in layer_names
                   or k.rpartition(".")[2] not in _LAYER_PARTS)
    if stray:
        raise TernaryFormatError(f"{SOURCE}: tensors {stray[:5]} belong to no BitLinear of "
                                 f"{type(model).__name__}")
    state = published_state(tensors, layers)
    if expected_checksum is not None:
        got = state_checksum(state)
        if got != expected_checksum:
            raise TernaryChecksumError(f"{SOURCE}: latents hash to {got[:16]}..., the version's "
                                       f"checksum is {expected_checksum[:16]}...; refusing it")
    # Fill fresh layers first (each checks codes, shapes and mask order), then swap them in:
    # a bad layer anywhere raises before the model changes.
    fresh: list[tuple[str, BitLinear]] = []
    remaining = dict(tensors)
    for name, old in layers:
        m = BitLinear(old.in_features, old.out_features, bias=old.bias is not None,
                      act_bits=old.act_bits)
        _fill_layer(SOURCE, name, m, remaining)
        m.mask_epoch = epoch
        fresh.append((name, m))
    for name, m in fresh:
        model.set_submodule(name, m)
    return _scope(model, config, epoch)
