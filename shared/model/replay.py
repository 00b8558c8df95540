"""Replay: a model version is version 0 plus the log entries [(seed, coef), ...] applied in order.

Arithmetic contract: trainable tensors are float32; for each entry in version order, for each
seed in plan order, every covered element x becomes fl32(x + coef * z) with z = +-1, so
coef * z is exact and each step is one IEEE addition: every platform gets the same bits.
Coefficients are float32 values computed by `update_coefficient`, the one definition both the
device (for its own local steps) and the coordinator (for aggregated entries) use. A tensor with
a step scale c_t != 1 (`TaskSpec.step_scales`) adds fl32(coef * c_t) * z instead
(`ScopedTensor.scaled_coefs`: the float64 product rounded once), still one exact addition.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from seedfed.shared.model.perturb import SignCache, Stash
from seedfed.shared.model.scopes import Scope
from seedfed.shared.model.stream import add_seeds_, add_words
from seedfed.shared.protocol.errors import ChecksumMismatchError

# Entries and the coefficient rule are numpy-only (`npzo`, shared with the torch-free device).
from seedfed.shared.protocol.npzo import (
    LogEntry,
    check_entries,
    hash_values,
)


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
    # The hash of the same bytes on every device: a GPU tensor's are copied to the host.
    hash_values(h, name, values.detach().reshape(-1).cpu().numpy())


def apply_seeds(scope: Scope, seeds: Sequence[int], coefs: Sequence[float],
                on_tensor: Callable[[int], None] | None = None,
                signs: SignCache | None = None) -> None:
    """theta += sum in order of coef * z(seed) over the scope (no validation; hot path).

    The one definition of an entry's arithmetic: devices replay with it and the coordinator
    applies its aggregated entries with it. `on_tensor(i)` runs after the i-th tensor (the
    coordinator's crash tests stop there). `signs`: a ZO step's cache of its last seed's z
    (whole tensors), reused instead of generated; the same additions in the same order."""
    with torch.no_grad():
        for i, t in enumerate(scope):
            scaled = t.scaled_coefs(coefs)
            words = (signs.cached(t.name, seeds[-1])
                     if signs is not None and seeds and t.indices is None else None)
            if words is None:
                add_seeds_(t.tensor.data, t.name, seeds, scaled, t.indices, t.compact)
            else:  # the earlier seeds fused, then the last one from its cached words
                add_seeds_(t.tensor.data, t.name, seeds[:-1], scaled[:-1])
                flat = t.tensor.data.view(-1)
                add_words(flat, flat, words, float(np.float32(scaled[-1])))
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
    expected = check_entries(entries, task_id=task_id, version=version)
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
