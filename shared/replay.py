"""Replay: a model version is version 0 plus the log entries [(seed, coef), ...] applied in order.

Arithmetic contract: trainable tensors are float32; for each entry in version order, for each
seed in plan order, every covered element x becomes fl32(x + coef * z) with z = +-1, so
coef * z is exact and each step is one IEEE addition: every platform gets the same bits.
Coefficients are float32 values computed by `update_coefficient`, the one definition both the
device (for its own local steps) and the coordinator (for aggregated entries) use.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import ChecksumMismatchError, LogEntryMismatchError, NonFiniteScalarError
from .perturb import Stash
from .scopes import Scope
from .stream import add_seeds_


def update_coefficient(g: float, lr: float, perturbations: int) -> float:
    """The float32 coefficient of z for projected gradient g: -(lr / P) * g, rounded once."""
    if not math.isfinite(g):
        raise NonFiniteScalarError(f"projected gradient is {g}")
    return float(np.float32(-(lr / perturbations) * float(g)))


def update_coefficients(g: np.ndarray, lr: float, perturbations: int) -> np.ndarray:
    """Vector form of `update_coefficient` (same float64 product, one rounding to float32)."""
    g64 = np.asarray(g, dtype=np.float64)
    if not np.isfinite(g64).all():
        raise NonFiniteScalarError("projected gradients contain NaN or infinity")
    return (-(lr / perturbations) * g64).astype(np.float32)


@dataclass(frozen=True)
class LogEntry:
    """One shared update: version `base_version` -> `base_version + 1` of task `task_id`."""

    task_id: str
    base_version: int
    seeds: tuple[int, ...]
    coefs: tuple[float, ...]
    checksum: str | None = None
    #: The mask epoch of version `base_version + 1` (a ternary task; None: no epochs). An
    #: entry whose epoch differs from its base version's started a new epoch: replay cannot
    #: cross it. Not part of the update itself, so entries compare without it.
    mask_epoch: int | None = field(default=None, compare=False)

    @property
    def version(self) -> int:
        return self.base_version + 1

    def validate(self) -> None:
        if len(self.seeds) != len(self.coefs):
            raise LogEntryMismatchError(
                f"entry v{self.version}: {len(self.seeds)} seeds but {len(self.coefs)} coefs"
            )
        bad = [c for c in self.coefs if not math.isfinite(c)]
        if bad:
            raise NonFiniteScalarError(f"entry v{self.version} has non-finite coefficient {bad[0]}")


def checksum(scope: Scope) -> str:
    """SHA-256 of the trainable state: per tensor in canonical order, the UTF-8 name, a NUL,
    the covered element count as uint64 LE, and the covered float32 values LE."""
    h = hashlib.sha256()
    for t in scope:  # one tensor's copy at a time: never a second copy of the whole scope
        _hash_tensor(h, t.name, t.values())
    return h.hexdigest()


def state_checksum(state: Mapping[str, torch.Tensor]) -> str:
    """`checksum` of a scope whose `read()` would return `state` (canonical name -> covered
    float32 values; scopes iterate in sorted name order). Lets a device check a snapshot
    before any of it enters its model."""
    h = hashlib.sha256()
    for name in sorted(state):
        _hash_tensor(h, name, state[name])
    return h.hexdigest()


def _hash_tensor(h: Any, name: str, values: torch.Tensor) -> None:
    flat = values.detach().reshape(-1).numpy().astype("<f4", copy=False)
    h.update(name.encode("utf-8") + b"\0" + struct.pack("<Q", flat.size))
    h.update(flat.tobytes())


def apply_seeds(scope: Scope, seeds: Sequence[int], coefs: Sequence[float],
                on_tensor: Callable[[int], None] | None = None) -> None:
    """theta += sum in order of coef * z(seed) over the scope (no validation; hot path).

    The one definition of an entry's arithmetic: devices replay with it and the coordinator
    applies its aggregated entries with it. `on_tensor(i)` runs after the i-th tensor (the
    coordinator's crash tests stop there)."""
    with torch.no_grad():
        for i, t in enumerate(scope):
            add_seeds_(t.tensor.data, t.name, seeds, coefs, t.indices, t.compact)
            if on_tensor is not None:
                on_tensor(i)
    scope.after_update()


def replay(scope: Scope, entries: Iterable[LogEntry], *, task_id: str, version: int,
           verify: bool = True, atomic: bool = True) -> int:
    """Apply log entries to a scope standing at `version`; returns the new version.

    All-or-nothing: entries are checked (task, contiguous versions, finite coefficients)
    before anything moves, and a checksum mismatch puts the state back as it was before
    raising ChecksumMismatchError. `atomic=False` skips that stash (a copy of the scope) for
    devices that cannot afford it; they re-sync from a snapshot on a mismatch anyway.
    """
    entries = list(entries)
    expected = version
    for e in entries:
        if e.task_id != task_id:
            raise LogEntryMismatchError(
                f"entry v{e.version} is for task {e.task_id!r}, not {task_id!r}")
        if e.base_version != expected:
            raise LogEntryMismatchError(
                f"entry for v{e.base_version}->v{e.version} does not follow version {expected}"
            )
        e.validate()
        expected = e.version
    if not entries:
        return version
    stash = Stash(scope) if verify and atomic else None
    for e in entries:
        apply_seeds(scope, e.seeds, e.coefs)
        if verify and e.checksum is not None:
            got = checksum(scope)
            if got != e.checksum:
                if stash is not None:
                    stash.restore()
                raise ChecksumMismatchError(
                    f"task {task_id} v{e.version}: state hashes to {got[:16]}..., log says "
                    f"{e.checksum[:16]}...; re-sync from a snapshot"
                )
    return expected
