"""Two-point SPSA (MeZO) over a scope, with seeds chosen by the coordinator.

For each seed s of a step: g(s) = (L(theta + eps z) - L(theta - eps z)) / (2 eps), or the
one-sided (L(theta + eps z) - L(theta)) / eps, clipped to [-C, C] (QZO's DDC) and rounded to
float32 -- the value uploaded. The step then applies theta += coef(g(s)) z(s) for the step's
seeds in plan order, with the same arithmetic the coordinator's replay uses, so replaying a
device's uploads on its starting state reproduces its local model bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from seedfed.shared.model.perturb import Mode, Perturber
from seedfed.shared.model.replay import apply_seeds
from seedfed.shared.model.scopes import Scope

# The scalar rule is numpy-only (`npzo`, shared with the torch-free device).
from seedfed.shared.protocol.npzo import projected_gradient, update_coefficients

LossFn = Callable[[], float]


@dataclass(frozen=True)
class ZOConfig:
    """Hyperparameters of one ZO step. `perturbations` seeds per step share one batch."""

    lr: float = 1e-4
    eps: float = 1e-3
    perturbations: int = 1
    clip: float | None = None
    one_sided: bool = False
    mode: Mode = "auto"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be positive and finite, got {self.eps}")
        if self.perturbations < 1:
            raise ValueError(f"perturbations must be >= 1, got {self.perturbations}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive (or None), got {self.clip}")
        if self.mode not in ("auto", "copy", "virtual"):
            raise ValueError(f"mode must be auto, copy or virtual, got {self.mode!r}")


@dataclass(frozen=True)
class StepResult:
    g: np.ndarray  # float32, one projected gradient per seed
    loss: float  # mean loss of the probes (an estimate of L(theta) on this batch)
    forwards: int  # probes evaluated (one per copy, batched or not)
    model_calls: int = 0  # forward calls of the model (0: not counted)
    copies_per_forward: int = 1  # probes stacked along the batch per model call


def spsa_step(scope: Scope, loss_fn: LossFn, seeds: Sequence[int], config: ZOConfig,
              perturber: Perturber | None = None) -> StepResult:
    """Estimate g for every seed at the current theta, then apply the update in plan order."""
    perturber = perturber or Perturber(scope, config.mode)
    losses: list[float] = []
    g = np.empty(len(seeds), dtype=np.float32)
    with perturber.step():
        base = loss_fn() if config.one_sided else None
        if base is not None:
            losses.append(base)
        for i, seed in enumerate(seeds):
            with perturber.probe(seed, config.eps):
                lp = loss_fn()
            if base is None:
                with perturber.probe(seed, -config.eps):
                    lm = loss_fn()
                losses.extend((lp, lm))
            else:
                lm = base
                losses.append(lp)
            g[i] = projected_gradient(lp, lm, config.eps, config.one_sided, config.clip)
        coefs = update_coefficients(g, config.lr, config.perturbations)
        # inside the step: a virtual perturber still holds the last seed's z to reuse
        apply_seeds(scope, seeds, coefs.tolist(), signs=perturber.signs)
    return StepResult(g=g, loss=float(np.mean(losses)), forwards=len(losses),
                      model_calls=len(losses))
