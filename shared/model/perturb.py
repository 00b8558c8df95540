"""Showing the forward theta + scale * c_t * z(seed) while the stored tensors come back bit for
bit (c_t: the tensor's `ScopedTensor.step_scale`, 1 unless the task sets one).

Floating-point undo is not exact (x + e - 2e + e != x in general), so a probe either
- `copy`: adds scale * z in place and afterwards copies the tensors back from a stash kept
  for the whole step. Cheapest in time, costs one extra copy of the scope: right for small
  scopes (LoRA, heads, scales).
- `virtual`: leaves the stored tensors alone; a forward pre-hook on each owning module swaps
  in a perturbed temporary (tensor + scale * z) for the duration of that module's forward, so
  at most one tensor's temporary exists at a time. No persistent extra memory: right for the
  full scope, where a stash would double the model. An nn.Embedding is not swapped at all: a
  forward hook adds scale * z to the rows it looked up (same bits, a batch's rows instead of
  the vocabulary). A large nn.Linear weight without bias (an LM head, `BLOCKED_BYTES`) is
  not swapped either: its forward runs in row blocks of the perturbed weight, each built from
  the step's z words into one reused buffer (`_blocked_forward`), so the largest matrix of a
  small LM never exists twice. The output equals the swapped copy's to float tolerance (bit for
  bit where the BLAS computes a block of rows as it computes them in the whole matmul, as
  here with blocks of 64 rows); probes only feed the device's scalars, never the update or
  replay, which stay exact.
`auto` picks `copy` when the scope is under `COPY_FRACTION` of the model's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
import torch
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.model.stream import (
    Words,
    add_seeds_,
    add_words,
    on_torch,
    perturbed,
    rademacher_rows,
    tensor_words,
)
from seedfed.shared.protocol.philox import BLOCK_ELEMENTS
from torch import nn

Mode = Literal["auto", "copy", "virtual"]
MODES: tuple[str, ...] = ("auto", "copy", "virtual")
COPY_FRACTION = 0.05
#: A virtual probe computes a Linear weight above this size block by block (`_blocked_forward`).
BLOCKED_BYTES = 32 << 20
#: The block of perturbed rows it builds at a time.
BLOCK_BYTES = 8 << 20


def resolve_mode(scope: Scope, mode: Mode) -> Literal["copy", "virtual"]:
    if mode not in MODES:
        raise ValueError(f"perturbation mode must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    total = sum(p.numel() for p in scope.model.parameters())
    return "copy" if scope.numel <= COPY_FRACTION * max(total, 1) else "virtual"


class SignCache:
    """The stream words of the seed a step probed last, for every whole tensor of the scope,
    so its +eps probe, its -eps probe and the update generate z once. One seed at a time in
    one buffer allocated once per step (numel / 8 bytes, 1/32 of the scope's float32 size;
    one block, so the probes' temporaries keep reusing the same heap). The buffer lives where
    the stream of the scope's device runs (`stream.on_torch`): numpy for the C kernel, an
    int64 tensor on the device for the torch ops, so a GPU step never copies words across."""

    def __init__(self, scope: Scope) -> None:
        self.seed: int | None = None
        self._spans: dict[str, tuple[int, int]] = {}
        size = 0
        device: torch.device | None = None
        for t in scope:
            if t.indices is None:
                words = 4 * -(-t.tensor.numel() // BLOCK_ELEMENTS)
                self._spans[t.name] = (size, size + words)
                size += words
                device = t.tensor.device if device is None else device
        self.device = torch.device("cpu") if device is None else device
        self._buffer: Words = (torch.empty(size, dtype=torch.int64, device=self.device)
                               if on_torch(self.device) else np.empty(size, dtype=np.uint64))
        self.generated = 0  # seeds generated (tests count reuse with it)

    def get(self, t: ScopedTensor, seed: int) -> Words:
        if seed != self.seed:  # a new seed: every tensor's words at once, into the buffer
            for name, (lo, hi) in self._spans.items():
                words = tensor_words(seed, name, (hi - lo) * 64, self.device)
                if isinstance(self._buffer, torch.Tensor):
                    assert isinstance(words, torch.Tensor)
                    self._buffer[lo:hi].copy_(words)
                else:
                    self._buffer[lo:hi] = words
            self.seed = seed
            self.generated += 1
        lo, hi = self._spans[t.name]
        return self._buffer[lo:hi]

    def cached(self, name: str, seed: int) -> Words | None:
        span = self._spans.get(name)
        return None if seed != self.seed or span is None else self._buffer[span[0]:span[1]]


def perturbed_copy(t: ScopedTensor, seed: int, scale: float,
                   signs: SignCache | None = None) -> torch.Tensor:
    """A new tensor equal to t.tensor + scale * c_t * z(seed) on the covered elements
    (z of a whole tensor from `signs` when given: generated once per seed and step)."""
    scale = t.scaled(scale)
    if t.indices is None and signs is not None:
        src = t.tensor.detach().contiguous()
        out = torch.empty_like(src)
        add_words(out.view(-1), src.view(-1), signs.get(t, seed), float(np.float32(scale)))
        return out
    if t.indices is None:  # whole tensor: one pass, no clone (same bits as clone + add)
        return perturbed(t.tensor, t.name, seed, scale)
    out = t.tensor.detach().clone()
    add_seeds_(out, t.name, [seed], [scale], t.indices, t.compact)
    return out


class Stash:
    """An exact copy of a scope's covered values, to put back after probes or a failed replay."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.saved = {t.name: t.values() for t in scope}

    def restore(self) -> None:
        with torch.no_grad():
            for t in self.scope:
                t.assign(self.saved[t.name])


class Perturber:
    """Applies probes theta + scale * z(seed) to a scope with the chosen restore strategy."""

    def __init__(self, scope: Scope, mode: Mode = "auto") -> None:
        self.scope = scope
        self.mode = resolve_mode(scope, mode)
        self._stash: Stash | None = None
        #: inside `step()` of a virtual perturber: the words of the seed probed last
        self.signs: SignCache | None = None

    @contextmanager
    def step(self) -> Iterator[None]:
        """Brackets one optimizer step: the copy strategy stashes the scope once per step."""
        if self.mode == "copy":
            self._stash = Stash(self.scope)
        else:
            self.signs = SignCache(self.scope)
        try:
            yield
        finally:
            self._stash, self.signs = None, None

    @contextmanager
    def probe(self, seed: int, scale: float) -> Iterator[None]:
        """Inside the block, forwards see theta + scale * z(seed); outside, theta exactly."""
        if self.mode == "copy":
            stash = self._stash or Stash(self.scope)
            with torch.no_grad():
                for t in self.scope:
                    add_seeds_(t.tensor.data, t.name, [seed], [t.scaled(scale)],
                               t.indices, t.compact)
            try:
                yield
            finally:
                stash.restore()
        else:
            with _virtual(self.scope, seed, scale, self.signs):
                yield


@contextmanager
def _virtual(scope: Scope, seed: int, scale: float, signs: SignCache | None = None,
             ) -> Iterator[None]:
    by_id = {id(t.tensor): t for t in scope}
    owners = scope.owners()
    depth: dict[int, int] = {}
    originals: dict[int, torch.Tensor] = {}

    by_rows: dict[int, ScopedTensor] = {}  # embedding calls perturbed on their output rows
    # large Linear layers computed in blocks of perturbed rows (their weight never swapped)
    blocked = {id(m): (m, by_id[id(m.weight)]) for pairs in owners.values() for m, _ in pairs
               if signs is not None and _blocks_suffice(m, by_id)}

    def enter(module: nn.Module, _args: object) -> None:
        if id(module) in blocked:
            return
        for attr, p in _owned(module, by_id):
            key = id(p)
            if depth.get(key, 0) == 0 and _rows_suffice(module, attr, by_id[key]):
                by_rows[id(module)] = by_id[key]
                continue
            depth[key] = depth.get(key, 0) + 1
            if depth[key] == 1:  # a tensor shared by nested owners is perturbed once
                originals[key] = p.data
                p.data = perturbed_copy(by_id[key], seed, scale, signs)

    def leave(module: nn.Module, args: tuple[object, ...], out: object) -> object:
        if id(module) in blocked:
            return None
        rows = by_rows.pop(id(module), None)
        for _attr, p in _owned(module, by_id):
            if rows is not None and p is rows.tensor:
                continue
            key = id(p)
            depth[key] -= 1
            if depth[key] == 0:
                p.data = originals.pop(key)
        if rows is None or not isinstance(out, torch.Tensor):
            return None
        # An embedding's output is W[ids] exactly, so fl(W[ids] + scale * z[ids]) is bit for bit
        # the lookup into a perturbed copy, at the cost of the batch's rows, not the vocabulary.
        ids = args[0]
        assert isinstance(ids, torch.Tensor)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        delta = rademacher_rows(seed, rows.name, out.shape[-1], uniq, rows.scaled(scale))
        return out + delta[inverse]

    modules = {id(m): m for pairs in owners.values() for m, _ in pairs}
    handles = []
    for m in modules.values():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    for m, t in blocked.values():
        assert signs is not None
        m.forward = _blocked_forward(m, t, signs, seed, scale)  # type: ignore[arg-type]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m, _t in blocked.values():
            del m.forward  # the class's forward again
        for t in scope:  # a forward that raised midway must still leave theta untouched
            if id(t.tensor) in originals:
                t.tensor.data = originals.pop(id(t.tensor))


def _blocks_suffice(module: nn.Module, by_id: dict[int, ScopedTensor]) -> bool:
    """A bias-free nn.Linear whose whole weight is scoped and large, with rows whose elements
    start on a stream word (64 elements), so a block of rows takes a slice of the words."""
    if type(module) is not nn.Linear or module.bias is not None:
        return False
    t = by_id.get(id(module.weight))
    return (t is not None and t.indices is None and module.in_features % 64 == 0
            and 4 * module.weight.numel() > BLOCKED_BYTES and "forward" not in vars(module))


def _blocked_forward(module: nn.Linear, t: ScopedTensor, signs: SignCache, seed: int,
                     scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's forward on theta + scale * z, computed in blocks of output rows."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight.detach()
        words = signs.get(t, seed)
        s = float(np.float32(t.scaled(scale)))
        n_out, n_in = weight.shape
        rows = max(64, BLOCK_BYTES // (4 * n_in) // 64 * 64)
        out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
        block = torch.empty(rows, n_in, dtype=weight.dtype, device=weight.device)
        for r0 in range(0, n_out, rows):
            r1 = min(n_out, r0 + rows)
            b = block[:r1 - r0]
            add_words(b.view(-1), weight[r0:r1].reshape(-1),
                      words[r0 * n_in // 64: -(-r1 * n_in // 64)], s)
            out[..., r0:r1] = nn.functional.linear(x, b)
        return out
    return forward


def _rows_suffice(module: nn.Module, attr: str, t: ScopedTensor) -> bool:
    """An nn.Embedding reading its whole weight unchanged (no max_norm renormalization, which
    writes to the weight) only needs the looked-up rows perturbed."""
    return (type(module) is nn.Embedding and attr == "weight" and t.indices is None
            and module.max_norm is None)


def _owned(module: nn.Module, by_id: dict[int, ScopedTensor]) -> list[tuple[str, torch.Tensor]]:
    items = list(module._parameters.items()) + list(module._buffers.items())
    return [(a, p) for a, p in items if p is not None and id(p) in by_id]
