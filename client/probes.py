"""Cheap probes for any scope: a prefix shared by every probe of a step, many perturbations per
forward (MobiZO's MP-LoRA / P-RGE idea, for any model and scope).

Usage (a device's ZO step; `client.trainer.LocalTrainer` does this by default)::

    engine = ProbeEngine(model, scope, classification_loss, classification_losses)
    result = engine_step(engine, batch, seeds, ZOConfig(lr=..., eps=..., perturbations=P))
    # result.g: the float32 scalars spsa_step would give (to float tolerance), theta updated in
    # plan order with the same arithmetic; result.copies_per_forward, result.model_calls.

    losses = engine.losses(batch, [(seed, +eps), (seed, -eps), None])  # any probes, None = theta

How a step runs:

1. *Recording pass* (`seedfed.shared.model.probe_check.ForwardRecorder`, which the coordinator's
   task check runs too). The step's first probe runs as an ordinary sequential probe (the
   `Perturber`), with hooks on every module and a torch-function mode that tracks which tensors
   depend on the perturbed tensors ("tainted"). A module that runs once, holds no scoped tensor
   and whose inputs and output are all untainted computes the same output for every probe of the
   step: its output is kept (the outermost such call's: what ran inside it is dropped). Nothing
   is model-specific: for MiniLM with LoRA on layer 5's query and value, layers 0-4, the key
   projection and the frozen base matmuls `x W` of query and value are kept; with only
   `output.dense` of layer 5 perturbed, everything up to that module's input; with only the
   head, the pooled sentence embedding (`seedfed.shared.model.classifier.SentenceEmbedding`).
2. *Shared prefix.* Every later probe of the step runs with the kept modules replaced by their
   outputs, so only the part of the model that depends on theta + eps z runs again.
3. *Batched copies.* With a per-copy loss (`CopyLosses`), up to `copies_per_forward` probes are
   stacked along the batch dimension in one forward: kept outputs are repeated (once a step
   per group size, shared by every module that kept the same tensor), the frozen
   layers above them run once over all copies, and each module owning scoped tensors runs per
   copy on its slice with that copy's perturbed tensors (`perturbed_copy`, the bits the
   sequential path adds; a seed's -eps twin comes from the same z, `perturbed_pair`), so z
   comes from the shared stream exactly as in `spsa_step`.
   `copies_per_forward` comes from a memory budget (`budget_mb` of extra activations, estimated
   from the recording pass); a `max_copies` above what the budget allows is lowered with a
   warning and reported in `ProbeStats.limited`; a group that runs out of memory anyway (the
   estimate is short on this device) is redone at half the copies, with a warning, as many
   times as it takes. The scalars are the same either way.

Scalars equal the sequential estimator's to float tolerance (batched matmuls and per-copy loss
reductions round differently); with one copy per forward (`copy_losses=None`) they are the
sequential bits exactly. Seeds, z, the upload and the coordinator's replay are unchanged.

Before any round opens, `seedfed.shared.model.probe_check.check_task_probes` (task creation)
refuses a scope no tensor of which reaches the loss and a `Hyper.probe_copies` whose stacked
activations exceed `Hyper.probe_memory_mb`.
"""


from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch
from seedfed.shared.model.estimator import StepResult, ZOConfig
from seedfed.shared.model.perturb import Perturber, perturbed_copy
from seedfed.shared.model.probe_check import (
    Batch,
    Call,
    ForwardRecorder,
    LossOnBatch,
    Plan,
    first_rows,
)
from seedfed.shared.model.replay import apply_seeds
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.model.stream import perturbed_pair, perturbed_pairs
from seedfed.shared.protocol import npzo
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.npzo import update_coefficients
from seedfed.shared.protocol.task import DEFAULT_PROBE_MEMORY_MB
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

#: (model, batch repeated `copies` times along dim 0, copies) -> the `copies` mean losses.
CopyLosses = Callable[[nn.Module, Batch, int], torch.Tensor]
#: (seed, scale): the forward sees theta + scale * z(seed); None: theta itself.
Probe = npzo.Probe

#: Extra activation memory a batched forward may use beyond one probe's (MB).
DEFAULT_BUDGET_MB = DEFAULT_PROBE_MEMORY_MB


class UnbatchableError(SeedfedError, RuntimeError):
    """A module owning scoped tensors cannot be split per copy (the engine then runs probes
    one at a time, still with the shared prefix)."""


@dataclass
class ProbeStats:
    """What the last `losses` call did."""

    probes: int = 0
    model_calls: int = 0
    copies_per_forward: int = 1
    shared_modules: int = 0  # modules replaced by their recorded output
    shared_mb: float = 0.0
    per_copy_mb: float = 0.0
    limited: bool = False  # max_copies was lowered to fit the memory budget
    fallback: str | None = None  # why probes ran one at a time although copies were asked


def _repeat(obj: Any, rows: int, n: int) -> Any:
    """obj with every tensor of `rows` rows repeated n times along dim 0 (copy-major)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() and obj.shape[0] == rows:
            return obj.repeat(n, *([1] * (obj.dim() - 1)))
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_repeat(o, rows, n) for o in obj)
    if isinstance(obj, list):
        return [_repeat(o, rows, n) for o in obj]
    if isinstance(obj, dict):
        out = obj.__class__() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _repeat(v, rows, n)
        return out
    return obj


def repeat_batch(batch: Batch, n: int) -> dict[str, torch.Tensor]:
    """The batch stacked n times along dim 0 (copy c holds rows c*B .. (c+1)*B - 1)."""
    return {k: v.repeat(n, *([1] * (v.dim() - 1))) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def _split(obj: Any, rows: int, n: int) -> list[Any]:
    """n slices of obj: tensors of n*rows rows split along dim 0, everything else shared."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() and obj.shape[0] == n * rows:
            return list(obj.split(rows))
        return [obj] * n
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        parts = [_split(o, rows, n) for o in obj]
        return [tuple(p[i] for p in parts) for i in range(n)]
    if isinstance(obj, list):
        parts = [_split(o, rows, n) for o in obj]
        return [[p[i] for p in parts] for i in range(n)]
    if isinstance(obj, dict):
        keys = list(obj)
        parts = [_split(obj[k], rows, n) for k in keys]
        return [dict(zip(keys, (p[i] for p in parts), strict=True)) for i in range(n)]
    return [obj] * n


def _cat(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, tuple) and not hasattr(first, "_fields"):
        return tuple(_cat([o[i] for o in outs]) if isinstance(first[i], torch.Tensor)
                     else first[i] for i in range(len(first)))
    raise UnbatchableError(f"cannot stack per-copy outputs of type {type(first).__name__}")


class ProbeEngine:
    """Runs the probes of a ZO step with a shared prefix and batched copies (module docstring).

    `copy_losses` enables batching (None: probes run one at a time, prefix still shared);
    `max_copies` caps copies per forward (None: as many as `budget_mb` allows); `share_prefix`
    False turns the recording off (every probe a full forward, today's sequential path).
    """

    def __init__(self, model: nn.Module, scope: Scope, loss_on_batch: LossOnBatch,
                 copy_losses: CopyLosses | None = None, *, max_copies: int | None = None,
                 budget_mb: float = DEFAULT_BUDGET_MB, share_prefix: bool = True,
                 perturber: Perturber | None = None) -> None:
        if max_copies is not None and max_copies < 1:
            raise ValueError(f"max_copies must be >= 1, got {max_copies}")
        if not (math.isfinite(budget_mb) and budget_mb >= 0):
            raise ValueError(f"budget_mb must be finite and >= 0, got {budget_mb}")
        self.model = model
        self.scope = scope
        self.loss_on_batch = loss_on_batch
        self.copy_losses = copy_losses
        self.max_copies = max_copies
        self.budget_bytes = int(budget_mb * 1024 * 1024)
        self.share_prefix = share_prefix
        self.perturber = perturber or Perturber(scope)
        self.stats = ProbeStats()
        self._warned = self._warned_reach = False
        self.reaches_loss: bool | None = None  # did the last recording see the scope reach it
        self._batchable = copy_losses is not None
        self._memory_cap: int | None = None  # copies per forward this device ran out above
        self._stacks = _Stacks()  # this step's shared outputs stacked per copy
        self._recorder = ForwardRecorder(model, scope)
        self._owned = self._recorder.owned
        self._active: list[Probe] = []  # the probe of the copy an owner is running now
        self._swapping: set[int] = set()  # ids of tensors `_swapped` shows perturbed now

    # -- public ------------------------------------------------------------------------------

    def losses(self, batch: Batch, probes: Sequence[Probe]) -> list[float]:
        """L(theta + scale z(seed)) for each probe, in order, on one batch."""
        if not probes:
            return []
        self.stats = ProbeStats(probes=len(probes))
        with torch.no_grad(), self.perturber.step():
            if not self.share_prefix:
                return [self._sequential(batch, p) for p in probes]
            first, plan = self._record(batch, probes[0])
            out = [first]
            rest = list(probes[1:])
            if rest:
                out += self._with_plan(batch, plan, rest)
        return out

    # -- the first probe: the recording pass -----------------------------------------------

    def _sequential(self, batch: Batch, probe: Probe) -> float:
        return float(self._loss(batch, probe))

    def _loss(self, batch: Batch, probe: Probe) -> torch.Tensor:
        self.stats.model_calls += 1
        if probe is None:
            return self.loss_on_batch(self.model, batch)
        with self.perturber.probe(*probe):
            return self.loss_on_batch(self.model, batch)

    def _record(self, batch: Batch, probe: Probe) -> tuple[float, Plan]:
        recording = self._recorder.record(batch, lambda: self._loss(batch, probe))
        self.reaches_loss = recording.reaches_loss
        if not self.reaches_loss and not self._warned_reach:
            log.warning("no tensor of the %s scope influences the loss: every scalar will be 0",
                        self.scope.kind)
            self._warned_reach = True
        return float(recording.loss), recording.plan

    # -- later probes ------------------------------------------------------------------------

    def _copies_per_forward(self, plan: Plan, wanted: int) -> int:
        if not self._batchable:
            return 1
        free = max(0, self.budget_bytes - plan.shared_bytes)
        fits = int(1 + free // plan.per_copy_bytes)
        asked = wanted if self.max_copies is None else min(wanted, self.max_copies)
        n = max(1, min(asked, fits, self._memory_cap or asked))
        if self.max_copies is not None and n < asked:  # asked explicitly: say why it got fewer
            self.stats.limited = True
            if not self._warned:
                log.warning("batched probes: %d copies per forward asked, %d fit the %.0f MB "
                            "budget (~%.2f MB per copy); running %d per forward, same scalars",
                            asked, n, self.budget_bytes / 2**20, plan.per_copy_bytes / 2**20, n)
                self._warned = True
        return n

    def _with_plan(self, batch: Batch, plan: Plan, probes: list[Probe]) -> list[float]:
        self.stats.shared_modules = len(plan.shared)
        self.stats.shared_mb = plan.shared_bytes / 2**20
        self.stats.per_copy_mb = plan.per_copy_bytes / 2**20
        n = self._copies_per_forward(plan, len(probes))
        self.stats.copies_per_forward = n
        out: list[float] = []
        rows = first_rows((), dict(batch))
        with ExitStack() as stack:
            stack.callback(self._stacks.clear)  # a step's stacks die with its recorded outputs
            for c in plan.shared:
                stack.enter_context(_replaced(c, self._stacks))
            i = 0
            while i < len(probes):
                group = probes[i:i + n]
                if len(group) == 1 or rows is None:
                    out += [self._sequential(batch, p) for p in group]
                else:
                    try:
                        out += self._batched(batch, plan, group)
                    except UnbatchableError as e:
                        log.warning("batched probes off for this model: %s", e)
                        self._batchable = False
                        self.stats.fallback = str(e)
                        self.stats.copies_per_forward = n = 1
                        continue
                    except (MemoryError, RuntimeError) as e:
                        if not _out_of_memory(e):
                            raise
                        # the budget's estimate was short for this device: halve and redo the
                        # group (nothing of it was kept; the per-copy context restored theta)
                        n = max(1, len(group) // 2)
                        log.warning("batched probes: out of memory at %d copies per forward; "
                                    "running %d, same scalars (%s)", len(group), n, e)
                        self._memory_cap = n  # later steps start there
                        self.stats.limited = True
                        self.stats.copies_per_forward = n
                        self.stats.fallback = f"out of memory at {len(group)} copies"
                        continue
                i += len(group)
        return out

    def _batched(self, batch: Batch, plan: Plan, group: list[Probe]) -> list[float]:
        assert self.copy_losses is not None
        n = len(group)
        with ExitStack() as stack:
            for key, entries in self._owned.items():
                rows = plan.owner_rows.get(key)
                if rows is not None:
                    stack.enter_context(self._per_copy(entries, rows, group))
            for c in plan.shared:
                c.module.forward.seedfed_copies = n  # type: ignore[attr-defined]
            self.stats.model_calls += 1
            values = self.copy_losses(self.model, repeat_batch(batch, n), n)
        if values.shape != (n,):
            raise UnbatchableError(f"copy losses returned shape {tuple(values.shape)}, "
                                   f"expected ({n},)")
        return [float(v) for v in values.tolist()]

    @contextmanager
    def _per_copy(self, entries: list[tuple[nn.Module, str, ScopedTensor]], rows: int,
                  group: list[Probe]) -> Iterator[None]:
        module = entries[0][0]
        original = module.forward
        n = len(group)
        pending: Pending = {}  # -eps twins made with their +eps copy, for this group only

        def forward(*args: Any, **kwargs: Any) -> Any:
            got = first_rows(args, kwargs)
            if got == rows and self._active:  # inside an outer owner's copy
                with _swapped(entries, self._active[-1], self._swapping, pending):
                    return original(*args, **kwargs)
            if got != n * rows:
                raise UnbatchableError(f"{type(module).__name__} got {got} rows, expected "
                                       f"{n} copies x {rows}")
            if not self._active and _fusable(module, entries, n, args, kwargs):
                return _fused_linear(module, entries, group, args[0],
                                     self._stacks.source(args[0], n))
            outs = []
            for probe, (a, k) in zip(group, zip(_split(args, rows, n), _split(kwargs, rows, n),
                                                strict=True), strict=True):
                self._active.append(probe)
                try:
                    with _swapped(entries, probe, self._swapping, pending):
                        outs.append(original(*a, **k))
                finally:
                    self._active.pop()
            return _cat(outs)

        module.forward = forward
        try:
            yield
        finally:
            del module.forward


Pending = dict[tuple[int, int, float], torch.Tensor]

#: The most bytes of stacked perturbed weights `_fused_linear` makes for one group of copies
#: (above it, each copy's weights are made and dropped in turn, as for any other module).
FUSED_WEIGHT_BYTES = 64 * 2**20


def _fusable(module: nn.Module, entries: list[tuple[nn.Module, str, ScopedTensor]], n: int,
             args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> TypeGuard[nn.Linear]:
    """A plain nn.Linear (a classifier head, an adapter's matrix) whose scoped tensors are
    whole, called on one tensor, with all n copies' weights within FUSED_WEIGHT_BYTES."""
    if type(module) is not nn.Linear or kwargs or len(args) != 1:
        return False
    if not all(m is module and t.indices is None for m, _, t in entries):
        return False
    return n * 4 * sum(p.numel() for p in module.parameters(recurse=False)) <= FUSED_WEIGHT_BYTES


def _fused_linear(module: nn.Linear, entries: list[tuple[nn.Module, str, ScopedTensor]],
                  group: list[Probe], x: torch.Tensor, shared_x: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Every copy's `F.linear(x_i, W_i, b_i)` in one batched matmul, W_i and b_i the copy's
    perturbed tensors (the bits `_swapped` shows; the product rounds as a batched matmul
    does, which the module's docstring allows). A head's 2P copies were 2P tiny matmuls and
    as many swaps: most of a head step.

    `shared_x`: when every copy's input is the same recorded output (x is it stacked, e.g.
    the FFN activations entering a LoRA-A on an output projection), one matmul of those rows
    with the copies' weights side by side [W_1; ...; W_n] reads them once instead of n
    times."""
    owned = {attr: t for _, attr, t in entries}

    def stacked(attr: str) -> torch.Tensor | None:
        p = getattr(module, attr)
        if p is None:
            return None
        t = owned.get(attr)
        if t is None:  # not scoped: the same tensor in every copy
            return p.detach().expand(len(group), *p.shape)
        return stacked_copies(t, group)

    weight, bias = stacked("weight"), stacked("bias")
    assert weight is not None
    n, out_features = weight.shape[0], weight.shape[1]
    if shared_x is not None:
        y = F.linear(shared_x, weight.reshape(n * out_features, -1),
                     None if bias is None else bias.reshape(-1))
        y = y.view(*shared_x.shape[:-1], n, out_features).movedim(-2, 0)  # copy-major
        return y.reshape(*x.shape[:-1], out_features)
    x3 = x.reshape(len(group), -1, x.shape[-1])  # (copy, rows x any middle dims, in)
    if bias is None:
        out = torch.bmm(x3, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), x3, weight.transpose(1, 2))
    return out.reshape(*x.shape[:-1], weight.shape[1])


def _perturbed(t: ScopedTensor, seed: int, scale: float, pending: Pending) -> torch.Tensor:
    """perturbed_copy(t, seed, scale); a whole tensor's -scale twin is made from the same z
    and kept in `pending` for the copy that needs it next (the -eps probe of the seed)."""
    key = (id(t.tensor), seed, scale)
    if key in pending:
        return pending.pop(key)
    if t.indices is not None:
        return perturbed_copy(t, seed, scale)
    plus, minus = perturbed_pair(t.tensor, t.name, seed, t.scaled(scale))  # c_t: fl32(eps c_t)
    pending[(id(t.tensor), seed, -scale)] = minus
    return plus


def stacked_copies(t: ScopedTensor, group: list[Probe]) -> torch.Tensor:
    """torch.stack of `_perturbed(t, seed, scale)` (theta for a None probe) over the group,
    for a whole tensor (`_fusable`), the pairs of every seed made in one `perturbed_pairs`
    call. A seed's copy at -eps is the minus of its +eps pair, bit for bit what `_perturbed`
    gives: fl(-a) = -fl(a), and x + (-b) z is x - b z in IEEE arithmetic."""
    plain = t.tensor.detach()
    mags = {(p[0], abs(p[1])) for p in group if p is not None}
    by_mag: dict[float, list[int]] = {}
    for seed, mag in sorted(mags):
        by_mag.setdefault(mag, []).append(seed)
    rows: dict[tuple[int, float], torch.Tensor] = {}
    for mag, seeds in by_mag.items():
        plus, minus = perturbed_pairs(plain, t.name, seeds, t.scaled(mag))
        for i, seed in enumerate(seeds):
            rows[(seed, mag)], rows[(seed, -mag)] = plus[i], minus[i]
    return torch.stack([plain if p is None else rows[(p[0], p[1])] for p in group])


@contextmanager
def _swapped(entries: list[tuple[nn.Module, str, ScopedTensor]], probe: Probe,
             active: set[int], pending: Pending) -> Iterator[None]:
    """The module's scoped tensors show theta + scale z(seed) (the bits of `perturbed_copy`).

    `active` holds the ids of tensors shown perturbed right now: a tensor shared by an owner and
    a module inside it is perturbed once, by the outer one (the same copy's probe)."""
    if probe is None:
        yield
        return
    seed, scale = probe
    saved = []
    for module, attr, t in entries:
        p = getattr(module, attr)
        if id(p) in active:
            continue
        saved.append((p, p.data))
        p.data = _perturbed(t, seed, scale, pending)
        active.add(id(p))
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data
            active.discard(id(p))


def _out_of_memory(e: BaseException) -> bool:
    """An allocation failure: Python's, torch's accelerator OOM, or the CPU allocator's."""
    if isinstance(e, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(e).lower()
    return "out of memory" in text or "can't allocate memory" in text


class _Stacks:
    """A step's recorded outputs stacked per copy, made once per group size and shared by every
    module that recorded the very same tensor (an `nn.Identity` dropout passes its input
    through): every group reads the same rows, and repeating a wide state (an FFN's 1536-wide
    activations) into fresh pages cost more than the group's own arithmetic. Like the recorded
    outputs themselves, the stacks are only read downstream, never written. `source` tells a
    fused linear that its input is such a stack, so it can read the rows once."""

    def __init__(self) -> None:
        self._stacked: dict[tuple[int, int], Any] = {}  # (id of the output, copies) -> stack
        self._source: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def get(self, output: Any, rows: int, n: int) -> Any:
        key = (id(output), n)
        if key not in self._stacked:
            if any(k[1] != n for k in self._stacked):
                self.clear()  # one group size held at a time: the last group may be smaller
            self._stacked[key] = stack = _repeat(output, rows, n)
            if isinstance(output, torch.Tensor) and stack is not output:
                self._source[id(stack)] = (stack, output, n)  # the stack keeps its id unique
        return self._stacked[key]

    def source(self, x: Any, n: int) -> torch.Tensor | None:
        """The unstacked output when x is one of this step's stacks of n copies."""
        hit = self._source.get(id(x))
        return hit[1] if hit is not None and hit[0] is x and hit[2] == n else None

    def clear(self) -> None:
        self._stacked.clear()
        self._source.clear()


@contextmanager
def _replaced(call: Call, stacks: _Stacks) -> Iterator[None]:
    """The module returns its recorded output (stacked per copy in a batched forward)."""
    module, output, rows = call.module, call.output, call.rows
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        got = first_rows(args, kwargs)
        if got == rows:
            return output
        n = forward.seedfed_copies  # type: ignore[attr-defined]
        if rows is not None and got == n * rows:
            return stacks.get(output, rows, n)
        return original(*args, **kwargs)  # not the recorded call: compute it

    forward.seedfed_copies = 1  # type: ignore[attr-defined]
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


def step_probes(seeds: Sequence[int], config: ZOConfig) -> list[Probe]:
    """The probes of one step in `spsa_step`'s order: base first when one-sided."""
    return npzo.step_probes(seeds, config.eps, config.one_sided)


def engine_step(engine: ProbeEngine, batch: Batch, seeds: Sequence[int],
                config: ZOConfig) -> StepResult:
    """`spsa_step` through the engine: same scalars (float tolerance), same update bits."""
    losses = engine.losses(batch, step_probes(seeds, config))
    g = npzo.step_scalars(losses, len(seeds), config.eps, config.one_sided, config.clip)
    coefs = update_coefficients(g, config.lr, config.perturbations)
    apply_seeds(engine.scope, seeds, coefs.tolist())
    return StepResult(g=g, loss=float(np.mean(losses)), forwards=len(losses),
                      model_calls=engine.stats.model_calls,
                      copies_per_forward=engine.stats.copies_per_forward)
