"""The fixed split and partition of the fast sweeps (head_sweep, body_sweep, byzantine).

The sweeps run the fleet's ZO math on cached features, seconds per run, to compare recipes and
aggregation rules over many seeds; their conclusions transfer to the real round code because
they use the same split (`client.data.split`), the same kind of Dirichlet partition and the same
coefficient rule. `seedfed.bench.accuracy` then measures the chosen recipe through `seedfed
simulate`. Every sweep takes the SST-2 training file as --data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from seedfed.client.data import Examples, dirichlet_partition, load_labelled, split, tokenize
from seedfed.shared.model.factory import ModelBundle


@dataclass(frozen=True)
class FedConfig:
    devices: int = 20
    alpha: float = 0.5
    train_pool: int = 8000  # training examples spread over the devices
    test_size: int = 1000
    rounds: int = 300
    per_round: int = 5  # devices sampled per round
    eval_every: int = 50
    seed: int = 0  # the split and the partition
    run_seed: int = 0  # the training randomness: device sampling, batches, perturbation seeds


def carve(data: Path, cfg: FedConfig) -> tuple[Examples, list[np.ndarray], Examples, Examples]:
    """(training pool, device partitions of it, validation, test): all fixed by cfg.seed."""
    splits = split(load_labelled(data))
    rng = np.random.default_rng([cfg.seed, 1])
    pool_idx = np.sort(rng.permutation(len(splits.train))[:cfg.train_pool])
    pool = splits.train.subset(pool_idx)
    parts = dirichlet_partition(pool.labels, cfg.devices, cfg.alpha, rng, min_size=4)
    test = splits.test.subset(range(min(cfg.test_size, len(splits.test))))
    return pool, parts, splits.validation, test


def _embed(bundle: ModelBundle, texts: tuple[str, ...]) -> torch.Tensor:
    batch = tokenize(bundle.tokenizer, texts, None, bundle.spec.max_seq_len)
    return bundle.model.embed(**batch)  # type: ignore[operator]
