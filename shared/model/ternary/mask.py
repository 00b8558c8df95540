"""Which latents of a ternary matrix train: the TerMeZO threshold mask and its baselines.

A latent can only change the forward by crossing the rounding threshold gamma / 2, so the
`threshold` selection keeps, per matrix, the `fraction` of latents with the smallest
| |w| / gamma - 1/2 |: those a small step can flip. It reads only the latents and gamma (the
quantizer's geometry): no gradients, no data. Ties at the cut are broken by the lower flat
index, so the mask is a function of the bits of the latents.

`random` draws the same number of elements uniformly (a baseline); `full` trains every latent
(full-latent MeZO); `none` trains no latent (the float head alone), and so does every head
epoch of a task with `alternate` epochs. Masks are chosen by the coordinator, which holds the
full latents, at the start of each mask epoch (every `epoch_rounds` rounds) and shipped to
devices as sorted int32 flat indices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from seedfed.shared.model.ternary.quantize import threshold_distance
from seedfed.shared.protocol.philox import MASK64, tensor_id

# MaskConfig lives with the scope options (no torch needed to validate a task definition).
from seedfed.shared.protocol.scope_options import SELECTIONS as SELECTIONS
from seedfed.shared.protocol.scope_options import MaskConfig, TernaryOptions
from seedfed.shared.protocol.scope_options import Selection as Selection


def mask_config(options: TernaryOptions | Mapping[str, Any]) -> MaskConfig:
    """The MaskConfig of a ternary task's scope options (typed, or their JSON object, which
    may also hold the scope builder's own arguments, e.g. `act_bits`)."""
    if isinstance(options, TernaryOptions):
        return options.mask
    names = {f.name for f in fields(MaskConfig)}
    return MaskConfig(**{k: v for k, v in options.items() if k in names})


def crosses_epoch(config: MaskConfig, from_version: int, to_version: int) -> bool:
    """Whether (from_version, to_version] holds a mask epoch start: replay cannot get there,
    because the target's mask selects latents a packed device does not hold."""
    return config.epoch_of(from_version) != config.epoch_of(to_version)


def mask_size(numel: int, fraction: float) -> int:
    """Elements a mask of `fraction` keeps in a matrix of `numel` (at least one)."""
    return min(numel, max(1, math.ceil(fraction * numel)))


def threshold_mask(w: torch.Tensor, gamma: torch.Tensor | float, fraction: float) -> torch.Tensor:
    """Sorted int32 flat indices of the `fraction` of latents nearest the rounding threshold."""
    d = threshold_distance(w, gamma).reshape(-1)
    if not bool(torch.isfinite(d).all()):
        raise ValueError("latents contain NaN or infinity; cannot choose a threshold mask")
    k = mask_size(d.numel(), fraction)
    if k == d.numel():
        return torch.arange(k, dtype=torch.int32)
    cut = d.kthvalue(k).values
    below = torch.nonzero(d < cut).reshape(-1)
    at_cut = torch.nonzero(d == cut).reshape(-1)[: k - below.numel()]
    chosen, _ = torch.sort(torch.cat([below, at_cut]))
    return chosen.to(torch.int32)


def random_mask(numel: int, fraction: float, seed: int, name: str, epoch: int) -> torch.Tensor:
    """Sorted int32 flat indices of a uniform random subset, reproducible from (seed, name,
    epoch) through numpy's Philox (the coordinator can rebuild it after a restart)."""
    k = mask_size(numel, fraction)
    key = np.array([seed & MASK64, (tensor_id(name) + epoch) & MASK64], dtype=np.uint64)
    rng = np.random.Generator(np.random.Philox(key=key))
    picked = np.sort(rng.choice(numel, size=k, replace=False, shuffle=False))
    return torch.from_numpy(picked.astype(np.int32))


def choose_mask(config: MaskConfig, w: torch.Tensor, gamma: torch.Tensor, name: str,
                epoch: int) -> torch.Tensor | None:
    """The mask `config` selects for latent matrix `w` (None: every element trains)."""
    if not config.trains_latents(epoch):  # the float head alone trains (train_head)
        return torch.empty(0, dtype=torch.int32)
    if config.selection == "full":
        return None
    if config.selection == "random":
        return random_mask(w.numel(), config.fraction, config.seed, name, epoch)
    return threshold_mask(w, gamma, config.fraction)
