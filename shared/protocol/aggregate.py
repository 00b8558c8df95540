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
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from seedfed.shared.protocol import ranges as R
from seedfed.shared.protocol.errors import NonFiniteScalarError, ShapeError
from seedfed.shared.protocol.npzo import LogEntry, update_coefficients
from seedfed.shared.protocol.ranges import Range, bounded, check_fields, help_of

Rule = Literal["mean", "clipped_mean", "trimmed_mean", "median"]
RULES: tuple[str, ...] = ("mean", "clipped_mean", "trimmed_mean", "median")
#: The rules client-level DP is calibrated for (see `dp_aggregate`).
DP_RULES: tuple[str, ...] = ("mean", "clipped_mean")
#: The rules that weigh every device the same, whatever it claims (`round_weights`).
UNIFORM_RULES: tuple[str, ...] = ("trimmed_mean", "median")
#: Default cap of one device's aggregation weight (AggregationConfig.max_num_examples).
DEFAULT_MAX_NUM_EXAMPLES = 100_000
#: Default of AggregationConfig.max_weight_ratio: no device weighs more than the round's
#: median claim (`seedfed bench byzantine`: FedAvg's weights below the median keep most of their
#: accuracy on a skewed fleet, 0.839 against 0.846 uncapped and 0.824 uniform).
DEFAULT_MAX_WEIGHT_RATIO = 1.0
#: Highest cap a task may set: the wire bound of num_examples (2**31 - 1).
MAX_WEIGHT = (1 << 31) - 1


def capped_weights(num_examples: Sequence[int] | np.ndarray, cap: int) -> np.ndarray:
    """Each device's example count, at most `cap` (float64)."""
    return np.minimum(np.asarray(num_examples, dtype=np.float64), float(cap))


def round_weights(num_examples: Sequence[int] | np.ndarray, config: AggregationConfig
                  ) -> np.ndarray:
    """The aggregation weights of a round's devices: the one definition the coordinator, the
    conformance kit and the benchmarks use.

    `num_examples` is each device's own claim, so no rule lets a claim decide much:
    - `trimmed_mean` and `median` weigh every device 1: which values are trimmed, and where
      the median falls, cannot be bought at all; a minority stays a minority.
    - `mean` and `clipped_mean` keep FedAvg's example weights (most of their accuracy on
      skewed fleets) up to a cap: min(n_d, max_num_examples, max_weight_ratio x M), M the
      median of the round's claims (each first capped at max_num_examples; the mean of the two
      middle ones for an even count). Claiming more than the cap buys nothing, and liars move
      M only as far as the honest claims around it: liars who are a fraction f of the round
      and claim the cap hold f r / (f r + (1 - f) q) of the weight, where r =
      max_weight_ratio and q is the honest devices' mean weight over r M. With equal honest
      claims (q = 1) and the default r = 1 that is their count's share, f: no minority takes
      the majority. A skewed honest fleet (q < 1) gives them more (6 of the benchmark's 20
      Dirichlet devices: 45%), and every r > 1 more again (r = 2: 53%); only uniform weights
      bound every minority to its count whatever the honest claims.
    A claim is finite and >= 1 on the wire, so every weight is positive."""
    n = capped_weights(num_examples, config.max_num_examples)
    if config.rule in UNIFORM_RULES:
        return np.ones_like(n)
    if config.max_weight_ratio is None or n.size == 0:
        return n
    return np.minimum(n, config.max_weight_ratio * float(np.median(n)))


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


def _sorted_weights(g: np.ndarray, weights: np.ndarray | None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per seed (column): values ascending, the weights that go with them, and the running
    weight up to and including each. Integer weights (example counts below 2**31, fewer than
    2**22 devices) keep the running sums exact in float64, so ties at a boundary are exact."""
    w = np.ones(g.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    order = np.argsort(g, axis=0, kind="stable")
    ws = w[order]
    return np.take_along_axis(g, order, axis=0), ws, np.cumsum(ws, axis=0)


def trimmed_mean(g: np.ndarray, trim: float, weights: np.ndarray | None = None) -> np.ndarray:
    """Per seed, drop the `trim` fraction of the total weight from the top and from the bottom
    (a device on a boundary keeps the part of its weight inside) and take the weighted mean of
    the rest. Unweighted, a device is dropped whole: floor(trim * n) from each end."""
    g = _check(g, weights)
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {trim}")
    if weights is None:
        k = int(math.floor(trim * g.shape[0]))
        kept = np.sort(g, axis=0)[k: g.shape[0] - k]
        return np.array([math.fsum(col) for col in kept.T]) / kept.shape[0]
    s, ws, cum = _sorted_weights(g, weights)
    total = float(cum[-1, 0])
    lo, hi = trim * total, (1 - trim) * total
    # The part of each device's weight interval [cum - w, cum] that lies inside [lo, hi].
    kept_w = np.clip(np.minimum(cum, hi) - np.maximum(cum - ws, lo), 0.0, None)
    return np.array([math.fsum(col) for col in (s * kept_w).T]) / (hi - lo)


def median(g: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Per-seed weighted median: the value where the running weight reaches half the total
    (the mean of the two middle values on an exact tie; np.median for equal weights). Robust
    while the misbehaving devices hold less than half the weight."""
    g = _check(g, weights)
    if weights is None:
        return np.median(g, axis=0)
    s, _, cum = _sorted_weights(g, weights)
    twice = 2 * cum  # compare 2 * running weight with the total: exact for integer weights
    total = cum[-1]
    i = np.argmax(twice >= total, axis=0)
    cols = np.arange(g.shape[1])
    out = s[i, cols]
    tie = (twice[i, cols] == total) & (i + 1 < g.shape[0])
    nxt = s[np.minimum(i + 1, g.shape[0] - 1), cols]
    return np.where(tie, (out + nxt) / 2, out)


@dataclass(frozen=True)
class AggregationConfig:
    """How a round's scalars combine. Validated on construction, so a bad task fails early."""

    rule: Rule = field(default="mean", metadata={"help": f"how scalars combine: one of {RULES}"})
    clip_bound: float = field(default=100.0, metadata=bounded(
        Range(0, R.MAX_ABS_SCALAR, lo_open=True),
        "clipped_mean: each scalar is clipped to [-clip_bound, clip_bound]"))
    trim: float = field(default=0.1, metadata=bounded(
        Range(0, 0.5, hi_open=True), "trimmed_mean: the share of weight dropped at each end"))
    #: client-level DP: L2 bound of each device's scalar vector
    dp_clip: float | None = field(default=None, metadata=bounded(
        Range(0, R.MAX_ABS_SCALAR, lo_open=True),
        "client-level DP: the L2 bound of each device's scalar vector (None: no DP)"))
    dp_noise_multiplier: float = field(default=0.0, metadata=bounded(
        Range(0, R.MAX_DP_NOISE_MULTIPLIER),
        "client-level DP: Gaussian noise of dp_noise_multiplier x dp_clip on the sum"))
    #: Largest aggregation weight one device gets: its num_examples is capped at this, so no
    #: claim buys more than max_num_examples / (sum of the round's weights) of a seed's mean.
    #: Task JSON without the field gets this default.
    max_num_examples: int = field(default=DEFAULT_MAX_NUM_EXAMPLES, metadata=bounded(
        Range(1, MAX_WEIGHT, integer=True), "the largest aggregation weight one device gets"))
    #: mean / clipped_mean: no device weighs more than max_weight_ratio x the round's median
    #: claim (`round_weights`); None: only max_num_examples caps it. Task JSON without the
    #: field gets the default. (trimmed_mean and median weigh devices equally.)
    max_weight_ratio: float | None = field(default=DEFAULT_MAX_WEIGHT_RATIO, metadata=bounded(
        Range(1, 1e6), "mean and clipped_mean: no device weighs more than this many times the "
                       "round's median claim (None: no such cap)"))

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> what it does and its range."""
        return help_of(cls)

    def __post_init__(self) -> None:
        check_fields(self, "aggregation.")
        if self.rule not in RULES:
            raise ValueError(f"aggregation rule must be one of {RULES}, got {self.rule!r}")
        if not self.clip_bound > 0:
            raise ValueError(f"clip_bound must be positive, got {self.clip_bound}")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}")
        if not (isinstance(self.max_num_examples, int)
                and 1 <= self.max_num_examples <= MAX_WEIGHT):
            raise ValueError(f"max_num_examples must be an integer in 1..{MAX_WEIGHT}, got "
                             f"{self.max_num_examples!r}")
        if self.dp_clip is not None and not self.dp_clip > 0:
            raise ValueError(f"dp_clip must be positive, got {self.dp_clip}")
        if self.dp_noise_multiplier < 0:
            raise ValueError(f"dp_noise_multiplier must be >= 0, got {self.dp_noise_multiplier}")
        if self.dp_noise_multiplier > 0 and self.dp_clip is None:
            raise ValueError("DP noise needs dp_clip (the sensitivity it is scaled to)")
        if self.dp_clip is not None and self.rule not in DP_RULES:
            # One device can move a per-seed trimmed mean or median by up to the spread of the
            # others' values in every seed at once, so its L2 influence is not bounded by
            # dp_clip / n and the accountant's epsilon would not hold: refuse, not miscalibrate.
            raise ValueError(f"client-level DP (dp_clip) supports the rules {DP_RULES}, not "
                             f"{self.rule!r}: the sensitivity of a trimmed mean or median to "
                             "one device is not bounded by dp_clip")


def dp_clip_rows(g: np.ndarray, bound: float) -> np.ndarray:
    """Scale each device's scalar vector to L2 norm <= bound (client-level sensitivity)."""
    g = _check(g)
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    return g * np.minimum(1.0, bound / np.maximum(norms, 1e-300))


def dp_noise_std(config: AggregationConfig, devices: int) -> float:
    """Standard deviation of the Gaussian noise on each aggregated scalar of a DP round.

    The noise on the SUM of clipped vectors is noise_multiplier * dp_clip (the sum's L2
    sensitivity to adding or removing one device is dp_clip); the sum is divided by the
    fixed denominator `devices`, and so is the noise."""
    if config.dp_clip is None:
        return 0.0
    if devices < 1:
        raise ValueError(f"the DP denominator must be >= 1 device, got {devices}")
    return config.dp_noise_multiplier * config.dp_clip / devices


def dp_aggregate(g: np.ndarray, config: AggregationConfig, devices: int,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    """Client-level DP aggregate: DP-FedAvg with uniform weights and a fixed denominator
    (McMahan et al. 2018, "Learning differentially private recurrent language models").

    out = (sum_d clip_C(g_d) + N(0, (z C)^2 I)) / devices, with z = dp_noise_multiplier and
    `devices` a number fixed before the round (the coordinator passes the round's quorum).
    Why each choice: adding or removing one device changes the sum by at most C in L2 whatever
    the others sent, so every round is one Gaussian mechanism of noise multiplier z under
    add/remove-one-device adjacency, exactly what the RDP accountant (`server/privacy.py`)
    composes. The weights are uniform because `num_examples` is the device's own claim: with
    example weights, a device's share (and so the sensitivity) would be whatever it reports.
    Dividing by the actual count of uploads would make the denominator itself depend on who
    took part. With `clipped_mean` every scalar is also clipped to +-clip_bound, after the L2
    clip, which can only shrink a vector's norm."""
    if config.dp_clip is None:
        raise ValueError("dp_aggregate needs a config with dp_clip")
    if config.rule not in DP_RULES:
        raise ValueError(f"client-level DP supports the rules {DP_RULES}, not {config.rule!r}")
    g = dp_clip_rows(g, config.dp_clip)
    if config.rule == "clipped_mean":
        g = np.clip(g, -config.clip_bound, config.clip_bound)
    total = np.array([math.fsum(col) for col in g.T])
    if config.dp_noise_multiplier > 0:
        if rng is None:
            raise ValueError("DP noise needs an explicit numpy Generator")
        total = total + rng.normal(0.0, config.dp_noise_multiplier * config.dp_clip,
                                   size=total.shape)
    if devices < 1:
        raise ValueError(f"the DP denominator must be >= 1 device, got {devices}")
    return total / devices


def aggregate(g: np.ndarray, weights: np.ndarray, config: AggregationConfig,
              rng: np.random.Generator | None = None,
              dp_devices: int | None = None) -> np.ndarray:
    """One aggregated scalar per seed. DP noise (if configured) needs an explicit generator.

    With `dp_clip` set the round is aggregated by `dp_aggregate` (the weights are not used)
    over the fixed denominator `dp_devices` (default: the number of rows, which is only right
    when that number was fixed in advance; the coordinator passes the round's quorum)."""
    g = _check(g, weights)
    if config.dp_clip is not None:
        return dp_aggregate(g, config, g.shape[0] if dp_devices is None else dp_devices, rng)
    if config.rule == "mean":
        return weighted_mean(g, weights)
    if config.rule == "clipped_mean":
        return clipped_mean(g, weights, config.clip_bound)
    if config.rule == "trimmed_mean":
        return trimmed_mean(g, config.trim, weights)
    return median(g, weights)


def build_entry(task_id: str, base_version: int, seeds: Sequence[int], g: np.ndarray,
                weights: np.ndarray, lr: float, perturbations: int,
                config: AggregationConfig | None = None,
                rng: np.random.Generator | None = None,
                dp_devices: int | None = None) -> LogEntry:
    """The log entry of a round: flat seeds in plan order with their float32 coefficients."""
    g = _check(g, weights)
    if g.shape[1] != len(seeds):
        raise ShapeError(f"scalars have {g.shape[1]} columns but the plan has {len(seeds)} seeds")
    agg = aggregate(g, weights, config or AggregationConfig(), rng, dp_devices)
    coefs = update_coefficients(agg, lr, perturbations)
    if not np.isfinite(coefs).all():  # e.g. an lr so large that float32 overflows
        raise NonFiniteScalarError("the round's update coefficients are not finite")
    return LogEntry(task_id, base_version, tuple(int(s) for s in seeds),
                    tuple(float(c) for c in coefs))
