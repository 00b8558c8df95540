"""Round math of the coordinator: seed drawing, per-seed aggregation, applying an entry.

Everything random derives from the task's secret and the round number through an explicit
numpy Generator, so recomputing a round after a crash gives the same seeds, the same DP noise
and therefore the same log entry bit for bit, while devices (who never see the secret) cannot
predict either.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope
from seedfed.shared.protocol.aggregate import (
    AggregationConfig,
    build_entry,
    dp_noise_std,
    round_weights,
)
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.wire import MAX_SEED

SEEDS_STREAM = 1
NOISE_STREAM = 2


def round_rng(secret: str, round_number: int, stream: int) -> np.random.Generator:
    words = [int(secret[i:i + 8], 16) for i in range(0, len(secret), 8)]
    return np.random.default_rng(np.random.SeedSequence([*words, round_number, stream]))


def draw_seeds(secret: str, round_number: int, steps: int, perturbations: int) -> list[list[int]]:
    rng = round_rng(secret, round_number, SEEDS_STREAM)
    seeds = rng.integers(0, MAX_SEED, size=(steps, perturbations), dtype=np.int64, endpoint=True)
    return [[int(s) for s in row] for row in seeds]


def upload_digest(version: int, matrix: np.ndarray, num_examples: int, loss: float) -> str:
    """Content hash of an upload: equal for byte-identical retries in either wire form."""
    h = hashlib.sha256()
    m = np.ascontiguousarray(matrix, dtype="<f4")
    h.update(np.array([version, *m.shape, num_examples], dtype="<i8").tobytes())
    h.update(np.array([loss], dtype="<f8").tobytes())
    h.update(m.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Combined:
    entry: LogEntry  # without checksum yet
    loss: float  # example-weighted mean of the devices' losses
    noise_std: float


def combine(*, task_id: str, base_version: int, round_number: int, seeds: Sequence[int],
            perturbations: int, lr: float, matrices: Sequence[np.ndarray],
            num_examples: Sequence[int], losses: Sequence[float], config: AggregationConfig,
            secret: str, dp_devices: int | None = None) -> Combined:
    """The log entry of a round from its uploads (each steps x P, flattened in plan order).

    `dp_devices`: the fixed denominator of a DP task's round (its quorum, known before any
    upload; `shared.aggregate.dp_aggregate` says why); default the number of uploads."""
    g = np.stack([np.asarray(m, dtype=np.float32).reshape(-1) for m in matrices])
    # A device's claimed example count buys at most what `round_weights` allows.
    w = round_weights(num_examples, config)
    rng = round_rng(secret, round_number, NOISE_STREAM)
    devices = len(matrices) if dp_devices is None else dp_devices
    entry = build_entry(task_id, base_version, seeds, g, w, lr, perturbations, config, rng,
                        devices)
    noise = dp_noise_std(config, devices)
    loss = math.fsum(x * n for x, n in zip(losses, w, strict=True)) / math.fsum(w)
    return Combined(entry, loss, noise)


def apply_entry(scope: Scope, seeds: Sequence[int], coefs: Sequence[float],
                on_tensor: Callable[[int], None] | None = None) -> str:
    """Apply one entry to the scope with the devices' replay (`shared.replay.apply_seeds`,
    compact tensors included); returns the new checksum. `on_tensor` is the crash tests'
    hook between tensors."""
    apply_seeds(scope, seeds, coefs, on_tensor)
    return checksum(scope)
