"""Aggregating the fleet's projected gradients per seed, and the log entry that results.

Every device in a round used the same seeds, so the update is a per-seed combination of
scalars: c(s) = -(lr / P) * AGG_d g_d(s). With AGG the example-weighted mean this is exactly
FedAvg of the devices' local models (each is theta + sum_s c_d(s) z(s), linear in c), and its
cost is one regeneration per seed whatever the number of devices.

All functions are pure: (n_devices, n_seeds) float arrays in, one aggregated row out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import NonFiniteScalarError, ShapeError
from .replay import LogEntry, update_coefficients

Rule = Literal["mean", "clipped_mean", "trimmed_mean", "median"]
RULES: tuple[str, ...] = ("mean", "clipped_mean", "trimmed_mean", "median")


def _check(g: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    g = np.asarray(g, dtype=np.float64)
    if g.ndim != 2 or g.shape[0] == 0:
        raise ShapeError(f"expected a (devices, seeds) matrix with at least one row, got {g.shape}")
    if not np.isfinite(g).all():
        raise NonFiniteScalarError("scalar matrix contains NaN or infinity")
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (g.shape[0],):
            raise ShapeError(f"{w.shape[0] if w.ndim else 0} weights for {g.shape[0]} devices")
        if (w <= 0).any() or not np.isfinite(w).all():
            raise ValueError(f"weights must be positive and finite, got {w.tolist()}")
    return g


def weighted_mean(g: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Example-weighted mean per seed (FedAvg). Independent of row order up to float64 sums."""
    g = _check(g, weights)
    w = np.asarray(weights, dtype=np.float64)
    # math.fsum per column: exactly rounded, so the result does not depend on upload order.
    return np.array([math.fsum(col) for col in (g * w[:, None]).T]) / math.fsum(w)


def clipped_mean(g: np.ndarray, weights: np.ndarray, bound: float) -> np.ndarray:
    """Weighted mean after clipping every scalar to [-bound, bound] (bounds a device's pull)."""
    if not bound > 0:
        raise ValueError(f"clip bound must be positive, got {bound}")
    return weighted_mean(np.clip(_check(g), -bound, bound), weights)


def trimmed_mean(g: np.ndarray, trim: float) -> np.ndarray:
    """Per seed, drop the `trim` fraction of highest and of lowest values, average the rest."""
    g = _check(g)
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {trim}")
    k = int(math.floor(trim * g.shape[0]))
    s = np.sort(g, axis=0)
    kept = s[k: g.shape[0] - k]
    return np.array([math.fsum(col) for col in kept.T]) / kept.shape[0]


def median(g: np.ndarray) -> np.ndarray:
    """Per-seed median (robust to up to half the devices misbehaving)."""
    return np.median(_check(g), axis=0)


@dataclass(frozen=True)
class AggregationConfig:
    """How a round's scalars combine. Validated on construction, so a bad task fails early."""

    rule: Rule = "mean"
    clip_bound: float = 100.0
    trim: float = 0.1
    dp_clip: float | None = None  # client-level DP: L2 bound of each device's scalar vector
    dp_noise_multiplier: float = 0.0

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"aggregation rule must be one of {RULES}, got {self.rule!r}")
        if not self.clip_bound > 0:
            raise ValueError(f"clip_bound must be positive, got {self.clip_bound}")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}")
        if self.dp_clip is not None and not self.dp_clip > 0:
            raise ValueError(f"dp_clip must be positive, got {self.dp_clip}")
        if self.dp_noise_multiplier < 0:
            raise ValueError(f"dp_noise_multiplier must be >= 0, got {self.dp_noise_multiplier}")
        if self.dp_noise_multiplier > 0 and self.dp_clip is None:
            raise ValueError("DP noise needs dp_clip (the sensitivity it is scaled to)")


def dp_clip_rows(g: np.ndarray, bound: float) -> np.ndarray:
    """Scale each device's scalar vector to L2 norm <= bound (client-level sensitivity)."""
    g = _check(g)
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    return g * np.minimum(1.0, bound / np.maximum(norms, 1e-300))


def aggregate(g: np.ndarray, weights: np.ndarray, config: AggregationConfig,
              rng: np.random.Generator | None = None) -> np.ndarray:
    """One aggregated scalar per seed. DP noise (if configured) needs an explicit generator."""
    g = _check(g, weights)
    if config.dp_clip is not None:
        g = dp_clip_rows(g, config.dp_clip)
    if config.rule == "mean":
        out = weighted_mean(g, weights)
    elif config.rule == "clipped_mean":
        out = clipped_mean(g, weights, config.clip_bound)
    elif config.rule == "trimmed_mean":
        out = trimmed_mean(g, config.trim)
    else:
        out = median(g)
    if config.dp_noise_multiplier > 0:
        if rng is None:
            raise ValueError("DP noise needs an explicit numpy Generator")
        assert config.dp_clip is not None
        # Weighted mean sensitivity to one device is at most max_w / sum_w * dp_clip.
        w = np.asarray(weights, dtype=np.float64)
        sigma = config.dp_noise_multiplier * config.dp_clip * float(w.max() / w.sum())
        out = out + rng.normal(0.0, sigma, size=out.shape)
    return out


def build_entry(task_id: str, base_version: int, seeds: Sequence[int], g: np.ndarray,
                weights: np.ndarray, lr: float, perturbations: int,
                config: AggregationConfig | None = None,
                rng: np.random.Generator | None = None) -> LogEntry:
    """The log entry of a round: flat seeds in plan order with their float32 coefficients."""
    g = _check(g, weights)
    if g.shape[1] != len(seeds):
        raise ShapeError(f"scalars have {g.shape[1]} columns but the plan has {len(seeds)} seeds")
    agg = aggregate(g, weights, config or AggregationConfig(), rng)
    coefs = update_coefficients(agg, lr, perturbations)
    return LogEntry(task_id, base_version, tuple(int(s) for s in seeds),
                    tuple(float(c) for c in coefs))
