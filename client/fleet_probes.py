"""The head-scope probes of many devices' ZO steps in one batched computation: a fleet of
virtual devices sharing one model (a simulation's actor, a GPU serving many devices).

A head scope (a classifier's Linear: weight and bias, e.g. the SST-2 recipe's 770 parameters
over 384-d pooled features) trains on the rows the head sees, which a cached model computes
once per sentence. So every device of a round that steps from its own head theta_d, on its
own batch of those rows x_d and labels y_d, with the round's seeds (every device of a round
shares them), needs only

    logits[d, c] = x_d W_dc^T + b_dc,   (W_dc, b_dc) = theta_d + scale_c z(seed_c)

for each probe c of the step: one batched matmul over [devices, copies] (`HeadFleet.losses`).

Bits, as `client.probes.ProbeEngine` gives them for one device:
- each perturbed head holds the bits of the function that engine stacks a fused head's
  copies with (`client.probes.stacked_copies`: `perturbed_pairs` on theta_d with the
  tensor's step scale; `copies_of` makes that call itself for a two-sided step), so every
  element is the one float32 addition fl32(theta + scale c_t z) of a sequential probe;
- the per-copy loss is `client.trainer.classification_losses`' definition (cross-entropy of
  the float32 logits, mean over the batch rows of each copy);
- the scalars follow `npzo.step_scalars` and the update `update_coefficients` and
  `apply_seeds` on a scope of the device's own (same names, order and step scales), so, given
  the scalars, a device's state after a step is bit for bit what its own step or a replay of
  its upload gives. The scalars themselves equal the per-device engine's to float tolerance
  only: the batched matmul and the per-copy means round as the engine's batched copies do.

Each device's rows x_d are the head's input from an ordinary forward of the shared model
(`head_features`, after `prime_features`): the cached pooled embedding for a
`MeanPoolClassifier`, whatever feeds the classifier for another model whose logits are the
head's output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch
from seedfed.client.probes import stacked_copies
from seedfed.shared.model.classifier import prime_features
from seedfed.shared.model.estimator import StepResult, ZOConfig
from seedfed.shared.model.head import classifier_module
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.model.stream import perturbed_pairs
from seedfed.shared.protocol import npzo
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.npzo import update_coefficients
from torch import nn
from torch.nn import functional as F

#: The most bytes of stacked perturbed heads one batched computation makes (devices beyond it
#: run in further groups, whose matmuls may round differently: the same float tolerance).
FLEET_WEIGHT_BYTES = 256 * 2**20

Batch = Mapping[str, torch.Tensor]


@torch.no_grad()
def head_features(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The rows the classifier head sees for `batch` ([rows, hidden]), from one forward of
    the model (in eval mode, as a trainer keeps it; the feature cache primed first, as a
    trainer's step does). Refuses a model whose logits are not the head's own output."""
    head = classifier_module(model)
    prime_features(model, batch)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = head.register_forward_hook(lambda _m, args, out: seen.append((args[0], out)))
    try:
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        handle.remove()
    if len(seen) != 1 or out.logits is not seen[0][1]:
        raise ScopeError(f"{type(model).__name__}: the logits are not the output of one head "
                         "call; batch this model's devices one at a time")
    return seen[0][0].detach()


def copies_of(t: ScopedTensor, probes: Sequence[npzo.Probe], out: torch.Tensor) -> None:
    """Write the perturbed copies of a whole tensor for `probes` into `out` ([copies,
    *shape]): the bits of `client.probes.stacked_copies` (the batched engine's fused head).
    A two-sided step's probes ((s, +eps), (s, -eps) for each seed, `npzo.step_probes`' order)
    take the rows of one `perturbed_pairs` call directly, the call that function makes,
    without its row-by-row stack; any other list goes through it."""
    two_sided = two_sided_seeds(probes)
    if two_sided is None:
        out.copy_(stacked_copies(t, list(probes)))
        return
    seeds, eps = two_sided
    plus, minus = perturbed_pairs(t.tensor.detach(), t.name, seeds, t.scaled(eps))
    pairs = out.view(len(seeds), 2, *t.tensor.shape)
    pairs[:, 0] = plus
    pairs[:, 1] = minus


def two_sided_seeds(probes: Sequence[npzo.Probe]) -> tuple[list[int], float] | None:
    """(the seeds, eps) when `probes` are (s, +eps), (s, -eps) for each seed in turn (one
    eps > 0), else None."""
    if not probes or len(probes) % 2 or probes[0] is None or not probes[0][1] > 0:
        return None
    eps = probes[0][1]
    seeds = [p[0] for p in probes[::2] if p is not None]
    if list(probes) != [p for s in seeds for p in ((s, eps), (s, -eps))]:
        return None
    return seeds, eps


def device_scope(scope: Scope, state: Mapping[str, torch.Tensor]) -> Scope:
    """A scope of the same names, order and step scales as `scope`, over tensors of its own
    holding `state` (flat covered values, as `Scope.read` gives them)."""
    tensors = [replace(t, tensor=state[t.name].detach().to(
        device=t.tensor.device, dtype=torch.float32).reshape(t.tensor.shape).clone())
        for t in scope]
    return Scope(scope.model, tensors)


class HeadFleet:
    """The head states of many devices of one task, stepped together.

    `scope` is the model's head scope (exactly the classifier Linear's weight and bias,
    whole); `states` each device's values of it. The model itself is only read (its
    features); each device's state lives in a scope of its own (`scopes[d]`)."""

    def __init__(self, model: nn.Module, scope: Scope,
                 states: Sequence[Mapping[str, torch.Tensor]], *,
                 max_bytes: int = FLEET_WEIGHT_BYTES) -> None:
        head = classifier_module(model)
        owned = {id(t.tensor): t for t in scope}
        if head.bias is None or set(owned) != {id(head.weight), id(head.bias)} or any(
                t.indices is not None for t in scope):
            raise ScopeError(f"a head fleet trains exactly the whole weight and bias of "
                             f"{type(model).__name__}'s classifier head, not scope "
                             f"{', '.join(scope.names[:4])}; run its devices one at a time")
        self.weight_name = owned[id(head.weight)].name
        self.bias_name = owned[id(head.bias)].name
        self.model, self.max_bytes = model, max_bytes
        self.scopes = [device_scope(scope, s) for s in states]

    def __len__(self) -> int:
        return len(self.scopes)

    def state(self, d: int) -> dict[str, torch.Tensor]:
        return self.scopes[d].read()

    def checksum(self, d: int) -> str:
        return checksum(self.scopes[d])

    def _tensor(self, d: int, name: str) -> ScopedTensor:
        return next(t for t in self.scopes[d] if t.name == name)

    # -- the probes ------------------------------------------------------------------------------
    def losses(self, features: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
               probes: Sequence[npzo.Probe]) -> torch.Tensor:
        """L_d(theta_d + scale z(seed)) for each device d (its rows `features[d]`, labels
        `labels[d]`) and probe (None: theta_d): float32 [devices, probes]. Devices whose
        batches have as many rows run in one batched computation (groups of `max_bytes`)."""
        if len(features) != len(self) or len(labels) != len(self):
            raise ValueError(f"{len(self)} devices but {len(features)} feature batches and "
                             f"{len(labels)} label batches")
        out = torch.empty((len(self), len(probes)), dtype=torch.float32)
        by_rows: dict[int, list[int]] = {}
        for d, x in enumerate(features):
            by_rows.setdefault(int(x.shape[0]), []).append(d)
        per_device = 4 * len(probes) * sum(t.numel for t in self.scopes[0])
        group = max(1, self.max_bytes // max(per_device, 1))
        for devices in by_rows.values():
            for start in range(0, len(devices), group):
                chunk = devices[start:start + group]
                values = self._losses(chunk, features, labels, probes)
                out[chunk] = values.cpu()
        return out

    def _losses(self, devices: list[int], features: Sequence[torch.Tensor],
                labels: Sequence[torch.Tensor], probes: Sequence[npzo.Probe]) -> torch.Tensor:
        group = list(probes)
        with torch.no_grad():
            # [D, C, out, in] and [D, C, out]: each device's copies, as its engine stacks them
            w = self._stacked(devices, self.weight_name, group)
            b = self._stacked(devices, self.bias_name, group)
            x = torch.stack([features[d] for d in devices]).to(w.device, torch.float32)
            y = torch.stack([labels[d] for d in devices]).to(w.device)
            n_dev, copies, classes, hidden = w.shape
            rows = x.shape[1]
            # one matmul per device of its rows with every copy's head side by side
            logits = torch.baddbmm(b.reshape(n_dev, 1, copies * classes), x,
                                   w.reshape(n_dev, copies * classes, hidden).transpose(1, 2))
            logits = logits.view(n_dev, rows, copies, classes).transpose(1, 2)  # [D, C, B, K]
            target = y.unsqueeze(1).expand(n_dev, copies, rows)
            per = F.cross_entropy(logits.float().reshape(-1, classes), target.reshape(-1),
                                  reduction="none")
            return per.view(n_dev, copies, rows).mean(dim=2)

    def _stacked(self, devices: list[int], name: str, probes: list[npzo.Probe]
                 ) -> torch.Tensor:
        """[devices, copies, *shape]: device d's row holds `copies_of` its tensor `name`."""
        t0 = self._tensor(devices[0], name)
        out = torch.empty((len(devices), len(probes), *t0.tensor.shape),
                          dtype=torch.float32, device=t0.tensor.device)
        for i, d in enumerate(devices):
            copies_of(self._tensor(d, name), probes, out[i])
        return out

    # -- a step ----------------------------------------------------------------------------------
    def step(self, features: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
             seeds: Sequence[int], config: ZOConfig) -> list[StepResult]:
        """Every device's ZO step on its own batch with the round's `seeds`: the scalars of
        `client.probes.engine_step` (to float tolerance) from one batched computation, then
        each device's update, bit for bit its own step's given those scalars."""
        probes = npzo.step_probes(seeds, config.eps, config.one_sided)
        losses = self.losses(features, labels, probes)
        out = []
        for d in range(len(self)):
            row = losses[d].tolist()
            g = npzo.step_scalars(row, len(seeds), config.eps, config.one_sided, config.clip)
            self.update(d, g, seeds, config)
            # one model call: the forward that gave its rows; every probe is a copy of the head
            out.append(StepResult(g=g, loss=float(np.mean(row)), forwards=len(row),
                                  model_calls=1, copies_per_forward=len(row)))
        return out

    def update(self, d: int, g: np.ndarray, seeds: Sequence[int], config: ZOConfig) -> None:
        """Device d's step from its scalars: `update_coefficients` and `apply_seeds` on its own
        scope, the arithmetic of `engine_step` and of a replay of its upload."""
        coefs = update_coefficients(np.asarray(g, dtype=np.float32), config.lr,
                                    config.perturbations)
        apply_seeds(self.scopes[d], seeds, coefs.tolist())
