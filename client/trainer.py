"""The device's local ZO trainer: run a round plan's steps on private data, return scalars only.

The trainer never lets its local steps become shared state: it stashes the scope at the start of
the round and puts it back at the end, so the device stands at version v again and later applies
the aggregated entry like every other device. Large scopes stash to disk (safetensors) instead of
memory, keeping the device at inference memory.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from seedfed.client.probes import DEFAULT_BUDGET_MB, CopyLosses, ProbeEngine, engine_step
from seedfed.shared.model.classifier import prime_features
from seedfed.shared.model.estimator import StepResult, ZOConfig, spsa_step
from seedfed.shared.model.objectives import (
    causal_lm_loss,
    causal_lm_losses,
    classification_loss,
    classification_losses,
)
from seedfed.shared.model.perturb import Mode, Perturber
from seedfed.shared.model.scopes import Scope
from seedfed.shared.protocol.wire import RoundPlan
from torch import nn

Batch = Mapping[str, torch.Tensor]
LossOnBatch = Callable[[nn.Module, Batch], torch.Tensor]

#: Scopes larger than this many bytes stash to a temporary file rather than to memory.
MEMORY_STASH_LIMIT = 64 * 1024 * 1024


@dataclass(frozen=True)
class TrainResult:
    scalars: np.ndarray  # float32 (steps, perturbations), the whole upload
    num_examples: int
    loss: float
    forwards: int  # probes evaluated
    model_calls: int = 0  # forward calls (fewer than `forwards` when probes were batched)
    copies_per_forward: int = 1  # the fewest probes stacked per forward in the round


#: The per-copy form of each built-in loss: what lets the trainer batch probes.
COPY_LOSSES: dict[LossOnBatch, CopyLosses] = {
    causal_lm_loss: causal_lm_losses,
    classification_loss: classification_losses,
}


class _ScopeStash:
    """An exact copy of the scope at round start, in memory or spilled to temporary files.

    A large scope spills tensor by tensor into files of at most `limit` bytes, so the stash never
    holds more than one file's worth of the scope in memory (a full copy would double a device's
    footprint for the full scope).
    """

    def __init__(self, scope: Scope, limit: int = MEMORY_STASH_LIMIT) -> None:
        self.scope = scope
        self._memory: dict[str, torch.Tensor] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._files: list[Path] = []
        if 4 * scope.numel <= limit:
            self._memory = scope.read()
            return
        self._dir = tempfile.TemporaryDirectory(prefix="seedfed-stash-")
        part: dict[str, torch.Tensor] = {}
        size = 0
        for t in scope:
            part[t.name] = t.values()
            size += 4 * t.numel
            if size >= limit:
                self._spill(part)
                part, size = {}, 0
        if part:
            self._spill(part)

    def _spill(self, part: dict[str, torch.Tensor]) -> None:
        assert self._dir is not None
        path = Path(self._dir.name) / f"stash-{len(self._files)}.safetensors"
        save_file(part, str(path))
        self._files.append(path)

    def restore(self) -> None:
        if self._memory is not None:
            self.scope.write(self._memory)
            return
        assert self._dir is not None
        by_name = {t.name: t for t in self.scope}
        with torch.no_grad():
            for path in self._files:
                for name, values in load_file(str(path)).items():
                    by_name[name].assign(values)
        self._dir.cleanup()


#: How a trainer runs a step's probes (see `seedfed.client.probes`).
PROBE_MODES: tuple[str, ...] = ("auto", "batched", "shared", "sequential")


class LocalTrainer:
    """Runs round plans on one model and scope. Reused across rounds (model loaded once).

    `probes` chooses how a step's probes run: "sequential" is the plain `spsa_step` (every probe
    a full forward); "shared" computes what no perturbed tensor influences once per step
    (`ProbeEngine`, bit-identical scalars); "batched" also stacks up to `max_copies` probes per
    forward within `budget_mb` of extra activations (same scalars to float tolerance); "auto"
    (the default) batches when the loss has a per-copy form (`COPY_LOSSES` or `copy_losses`)
    and shares the prefix otherwise.
    """

    def __init__(self, model: nn.Module, scope: Scope, loss_on_batch: LossOnBatch,
                 mode: Mode = "auto", one_sided: bool = False, *, probes: str = "auto",
                 copy_losses: CopyLosses | None = None, max_copies: int | None = None,
                 budget_mb: float = DEFAULT_BUDGET_MB) -> None:
        if probes not in PROBE_MODES:
            raise ValueError(f"probes must be one of {PROBE_MODES}, got {probes!r}")
        self.model = model.eval()  # dropout off: both probes of a seed must see the same function
        self.scope = scope
        self.loss_on_batch = loss_on_batch
        self.perturber = Perturber(scope, mode)
        copy_losses = copy_losses or COPY_LOSSES.get(loss_on_batch)
        if probes == "batched" and copy_losses is None:
            raise ValueError("probes='batched' needs a per-copy loss (copy_losses=)")
        self.engine: ProbeEngine | None = None
        if probes != "sequential":
            self.engine = ProbeEngine(
                model, scope, loss_on_batch, copy_losses if probes != "shared" else None,
                max_copies=max_copies, budget_mb=budget_mb, perturber=self.perturber)

    def run(self, plan: RoundPlan, batches: Iterator[Batch], keep: bool = False,
            ) -> TrainResult:
        """Run the plan's local steps; afterwards the scope is back at the plan's version
        exactly, unless `keep` (then it holds the device's local model)."""
        config = ZOConfig(lr=plan.lr, eps=plan.eps, perturbations=plan.perturbations,
                          clip=plan.clip, one_sided=plan.one_sided, mode=self.perturber.mode)
        stash = None if keep else _ScopeStash(self.scope)
        g = np.zeros((plan.steps, plan.perturbations), dtype=np.float32)
        losses: list[float] = []
        examples = forwards = calls = 0
        copies = 0
        try:
            for step, seeds in enumerate(plan.seeds):
                batch = next(batches)
                examples += _batch_size(batch)
                res = self._step(batch, seeds, config)
                g[step] = res.g
                losses.append(res.loss)
                forwards += res.forwards
                calls += res.model_calls
                copies = res.copies_per_forward if not copies else min(copies,
                                                                        res.copies_per_forward)
        finally:
            if stash is not None:
                stash.restore()
        return TrainResult(g, examples, float(np.mean(losses)), forwards, calls, max(copies, 1))

    def _step(self, batch: Batch, seeds: list[int], config: ZOConfig) -> StepResult:
        # The batch's features are cached before any probe runs: a step then runs the same
        # modules (and the batched engine stacks the same copies) whatever the cache held.
        prime_features(self.model, batch)
        if self.engine is not None:
            return engine_step(self.engine, batch, seeds, config)

        def loss_fn() -> float:
            with torch.no_grad():
                return float(self.loss_on_batch(self.model, batch))

        return spsa_step(self.scope, loss_fn, seeds, config, self.perturber)


def _batch_size(batch: Batch) -> int:
    first: Any = next(iter(batch.values()))
    return int(first.shape[0])
