"""Which latents of a ternary matrix train: the TerMeZO threshold mask and its baselines.

A latent can only change the forward by crossing the rounding threshold gamma / 2, so the
`threshold` selection keeps, per matrix, the `fraction` of latents with the smallest
| |w| / gamma - 1/2 |: those a small step can flip. It reads only the latents and gamma (the
quantizer's geometry): no gradients, no data. Ties at the cut are broken by the lower flat
index, so the mask is a function of the bits of the latents.

`random` draws the same number of elements uniformly (a baseline); `full` trains every latent
(full-latent MeZO). Masks are chosen by the coordinator, which holds the full latents, at the
start of each mask epoch (every `epoch_rounds` rounds) and shipped to devices as sorted int32
flat indices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch

from ..stream import MASK64, tensor_id
from .quantize import threshold_distance

Selection = Literal["threshold", "random", "full"]
SELECTIONS: tuple[str, ...] = ("threshold", "random", "full")


@dataclass(frozen=True)
class MaskConfig:
    """How the ternary scope picks its trainable latents, and how often it re-picks them.

    `refresh_gamma`: at each mask epoch the coordinator recomputes every gamma = mean |W| from
    its latents (BitNet semantics), so the whole packed model changes and devices re-download
    it. With False, gamma stays as converted for the whole task and an epoch change only moves
    the codes of the previously masked elements.
    """

    selection: Selection = "threshold"
    # 1%: a device then holds 8 bytes (index + fp32 latent) per masked weight, 1.8% of the
    # fp32 model, and a ZO step peaks at 1.065 x packed inference on a 1.1B Llama; 2% learns
    # ~20% faster per forward but peaks at 1.156 x (benchmarks/ternary.py, README).
    fraction: float = 0.01
    epoch_rounds: int = 10
    seed: int = 0
    refresh_gamma: bool = True

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"mask selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not (math.isfinite(self.fraction) and 0 < self.fraction <= 1):
            raise ValueError(f"mask fraction must lie in (0, 1], got {self.fraction}")
        if self.epoch_rounds < 1:
            raise ValueError(f"epoch_rounds must be >= 1, got {self.epoch_rounds}")
        if not 0 <= self.seed <= MASK64:
            raise ValueError(f"mask seed must be a uint64, got {self.seed}")

    def epoch_of(self, round_index: int) -> int:
        """The mask epoch a round belongs to (rounds counted from 0). The coordinator counts
        committed versions: version v is in epoch v // epoch_rounds, and the round that
        commits a version with v % epoch_rounds == 0 (v > 0) starts a new epoch."""
        if round_index < 0:
            raise ValueError(f"round index must be >= 0, got {round_index}")
        return round_index // self.epoch_rounds

    def starts_epoch(self, round_index: int) -> bool:
        return round_index % self.epoch_rounds == 0


def mask_config(options: Mapping[str, Any]) -> MaskConfig:
    """The MaskConfig among a ternary task's scope options (which may also hold the scope
    builder's own arguments, e.g. `act_bits`)."""
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
    if config.selection == "full":
        return None
    if config.selection == "random":
        return random_mask(w.numel(), config.fraction, config.seed, name, epoch)
    return threshold_mask(w, gamma, config.fraction)
