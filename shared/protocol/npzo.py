"""The ZO protocol's arithmetic in numpy alone: log entries, the scalar and coefficient rules,
the checksum, and replay over a state of flat float32 arrays.

`replay.py` and `estimator.py` (torch) take their rules from here, so a device that runs its
forwards on an inference engine (`seedfed.client.backends.ort`: numpy, ORT) computes the same
scalars' float32 rounding, the same coefficients, the same update bits and the same checksum
as the torch device and the coordinator, without importing torch (docs/protocol.md, sections
2 and 3).

A numpy state is `{canonical name: flat float32 array of the covered values}`, what
`Scope.read()` returns as tensors and what a snapshot file holds.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    NonFiniteScalarError,
)
from seedfed.shared.protocol.philox import add_dense

#: A trainable state as numpy: canonical name -> flat float32 covered values.
NpState = dict[str, np.ndarray]


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


def projected_gradient(loss_plus: float, loss_minus: float, eps: float, one_sided: bool,
                       clip: float | None) -> float:
    """The float32 scalar a device uploads for one seed: the difference quotient in float64,
    clipped to [-clip, clip], then rounded to float32 once."""
    if not (math.isfinite(loss_plus) and math.isfinite(loss_minus)):
        raise NonFiniteScalarError(f"loss is not finite (L+={loss_plus}, L-={loss_minus})")
    g = (loss_plus - loss_minus) / (eps if one_sided else 2 * eps)
    if clip is not None:
        g = min(max(g, -clip), clip)
    return float(np.float32(g))


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


def hash_values(h: Any, name: str, values: np.ndarray) -> None:
    """Feed one tensor into a state checksum: the UTF-8 name, a NUL, the covered element count
    as uint64 LE, the covered float32 values LE."""
    flat = np.asarray(values).reshape(-1).astype("<f4", copy=False)
    h.update(name.encode("utf-8") + b"\0" + struct.pack("<Q", flat.size))
    h.update(flat.tobytes())


#: `TaskSpec.step_scales`: (substring, c) pairs, the first a tensor's name contains wins.
StepScales = Sequence[tuple[str, float]]


def step_scale_of(name: str, pairs: StepScales) -> float:
    """c_t of tensor `name`: the scale of the first pattern it contains, else 1.0."""
    return next((c for pattern, c in pairs if pattern in name), 1.0)


def unmatched_step_scales(pairs: StepScales, names: Iterable[str]) -> list[str]:
    """The patterns of `pairs` that no tensor name contains (a typo would otherwise train that
    tensor at c = 1 without a word): every side refuses a task for which this is not empty."""
    names = list(names)
    return [pattern for pattern, _ in pairs if not any(pattern in n for n in names)]


def scaled_multiple(s: float, c: float) -> float:
    """The multiple of z a tensor with step scale `c` sees for a plan-level probe scale or
    coefficient `s`: s itself at c = 1 (unscaled tasks keep their bits), else fl32(s * c),
    the product in binary64 rounded once (docs/protocol.md section 2)."""
    return s if c == 1.0 else float(np.float32(float(s) * c))


def np_checksum(state: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of a numpy state, tensors in canonical (sorted by code point) order: the bits of
    `replay.checksum` of a scope holding the same values."""
    h = hashlib.sha256()
    for name in sorted(state):
        hash_values(h, name, state[name])
    return h.hexdigest()


def np_apply_seeds(state: Mapping[str, np.ndarray], seeds: Sequence[int],
                   coefs: Sequence[float], step_scales: StepScales = ()) -> None:
    """theta += sum in plan order of coef * c_t * z(seed) over every tensor of the state, in
    place: the bits of `replay.apply_seeds` on a scope of whole fp32 tensors (c_t from the
    task's `step_scales`, 1 when none names the tensor)."""
    for name in sorted(state):
        flat = state[name]
        c = step_scale_of(name, step_scales)
        # `ScopedTensor.scaled_coefs`: the entry's coefficient times c_t, rounded once
        scales = [float(np.float32(scaled_multiple(k, c))) for k in coefs]
        add_dense(flat, name, seeds, scales, out=flat)


def check_entries(entries: Sequence[LogEntry], *, task_id: str, version: int) -> int:
    """Validate a run of entries from `version` (task, contiguous versions, finite
    coefficients) before anything moves; returns the version they reach."""
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
    return expected


def np_replay(state: NpState, entries: Iterable[LogEntry], *, task_id: str,
              version: int, step_scales: StepScales = ()) -> tuple[int, str]:
    """Apply entries to a numpy state standing at `version`, verifying every checksum the log
    carries; all-or-nothing (a mismatch puts the state back and raises
    ChecksumMismatchError). Returns (new version, checksum)."""
    entries = list(entries)
    target = check_entries(entries, task_id=task_id, version=version)
    saved = {k: v.copy() for k, v in state.items()}
    got = ""
    for e in entries:
        np_apply_seeds(state, e.seeds, e.coefs, step_scales)
        got = np_checksum(state)
        if e.checksum is not None and got != e.checksum:
            for k, v in saved.items():
                state[k][...] = v
            raise ChecksumMismatchError(
                f"task {task_id} v{e.version}: state hashes to {got[:16]}..., log says "
                f"{e.checksum[:16]}...; re-sync from a snapshot")
    return target, got or np_checksum(state)


#: (seed, scale): the forward sees theta + scale * z(seed); None: theta itself.
Probe = tuple[int, float] | None


def step_probes(seeds: Sequence[int], eps: float, one_sided: bool) -> list[Probe]:
    """The probes of one step in `spsa_step`'s order: the base first when one-sided, else
    +eps then -eps of each seed. Every probe of a step sees the same batch."""
    if one_sided:
        return [None] + [(s, eps) for s in seeds]
    return [p for s in seeds for p in ((s, eps), (s, -eps))]


def step_scalars(losses: Sequence[float], n_seeds: int, eps: float, one_sided: bool,
                 clip: float | None) -> np.ndarray:
    """The float32 scalars of one step from its probes' losses in `step_probes` order."""
    g = np.empty(n_seeds, dtype=np.float32)
    for i in range(n_seeds):
        if one_sided:
            lp, lm = losses[1 + i], losses[0]
        else:
            lp, lm = losses[2 * i], losses[2 * i + 1]
        g[i] = projected_gradient(lp, lm, eps, one_sided, clip)
    return g
