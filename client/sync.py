"""Catch-up: bring a device's trainable state to the coordinator's version, verified.

A device behind version v either replays the log entries it missed (a few scalars each) or loads
a snapshot of version v (safetensors of the exact float32 trainable state). Either way it ends on
the checksum the coordinator published for v, or it raises and keeps nothing half-applied. Which
of the two is cheaper is the coordinator's call (it knows the log); `replay_cost_bytes` (the
coordinator's cost model, `shared.messages`) and `snapshot_cost_bytes` are the estimates a
device without a catch-up plan uses.

A ternary task adds one rule (`catch_up_ternary`): replay only inside a mask epoch; across an
epoch start the device loads the published ternary snapshot, since its packed model holds no
latents outside its old mask.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from seedfed.shared.model.replay import LogEntry, checksum, replay
from seedfed.shared.model.scopes import Scope
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    MissingTensorError,
    WireFormatError,
)
from seedfed.shared.protocol.messages import replay_bytes
from torch import nn

if TYPE_CHECKING:  # the ternary package loads only for ternary tasks
    from seedfed.shared.model.ternary import MaskConfig, TernaryScope


@dataclass(frozen=True)
class SyncResult:
    """Where a catch-up left the device: its version, checksum and how it got there."""

    version: int
    checksum: str
    method: str  # "none" | "replay" | "snapshot"
    entries_applied: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("none", "replay", "snapshot"):
            raise ValueError(f"sync method must be none, replay or snapshot, got {self.method!r}")
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")


def replay_cost_bytes(entries: Sequence[LogEntry]) -> int:
    """Estimated download for replaying `entries` (the coordinator's cost model)."""
    return replay_bytes(len(entries), sum(len(e.seeds) for e in entries))


def snapshot_cost_bytes(scope: Scope) -> int:
    """Download of a float32 snapshot of the scope (values plus a small safetensors header)."""
    return 4 * scope.numel + 64 * len(scope)


def state_bytes(scope: Scope) -> bytes:
    """The scope's trainable state as safetensors bytes (flat float32 per tensor name)."""
    return save_safetensors(scope.read())


def load_state(scope: Scope, data: bytes, expected_checksum: str | None = None) -> str:
    """Write safetensors `data` into the scope; returns the new checksum.

    With `expected_checksum`, a state that hashes differently is refused and the scope is left
    exactly as it was (ChecksumMismatchError).
    """
    try:
        state = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise WireFormatError(f"snapshot is not valid safetensors: {e}") from e
    state = {k: v.to(torch.float32).reshape(-1) for k, v in state.items()}
    before = scope.read() if expected_checksum is not None else None
    try:
        scope.write(state)
    except MissingTensorError as e:
        raise WireFormatError(f"snapshot does not fit this model's scope: {e}") from e
    scope.after_update()
    got = checksum(scope)
    if expected_checksum is not None and got != expected_checksum:
        assert before is not None
        scope.write(before)
        raise ChecksumMismatchError(
            f"snapshot hashes to {got[:16]}..., the coordinator published "
            f"{expected_checksum[:16]}...; refusing it"
        )
    return got


def catch_up(scope: Scope, *, task_id: str, version: int, entries: Sequence[LogEntry],
             target: int) -> SyncResult:
    """Replay the entries that take the scope from `version` to `target`.

    `entries` may start before `version` (those already applied are skipped, so a plan written
    for an older device still serves this one) but must reach `target` without a gap. Each
    applied entry's checksum is verified; on a mismatch the scope is put back to `version`.
    """
    if target < version:
        raise LogEntryMismatchError(
            f"task {task_id}: device is at v{version}, ahead of the plan's v{target}; "
            "load a snapshot of the plan's version")
    needed = sorted((e for e in entries if e.base_version >= version),
                    key=lambda e: e.base_version)
    needed = [e for e in needed if e.base_version < target]
    if target == version:
        return SyncResult(version, checksum(scope), "none")
    have = [e.base_version for e in needed]
    if have != list(range(version, target)):
        raise LogEntryMismatchError(
            f"task {task_id}: cannot replay v{version} -> v{target} from entries starting at "
            f"{have[:5]}; load a snapshot instead")
    new_version = replay(scope, needed, task_id=task_id, version=version, verify=True,
                         atomic=True)
    final = needed[-1].checksum
    got = checksum(scope) if final is None else final
    return SyncResult(new_version, got, "replay", len(needed))


def read_snapshot(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a published snapshot file (safetensors bytes)."""
    try:
        return load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise WireFormatError(f"snapshot is not valid safetensors: {e}") from e


def catch_up_ternary(model: nn.Module, scope: TernaryScope | None, *, task_id: str,
                     version: int | None, target: int, config: MaskConfig,
                     entries: Sequence[LogEntry],
                     snapshot: Callable[[], tuple[Mapping[str, torch.Tensor], str]],
                     ) -> tuple[TernaryScope, SyncResult]:
    """Bring a ternary device (packed model) to `target`; returns the scope to train with next.

    Replay works only inside a mask epoch: an epoch start changes the mask (and, with
    `refresh_gamma`, every code), and the device holds no latents outside its old mask. So the
    device replays `entries` when it holds a state of `target`'s epoch, and otherwise (no
    state yet, an epoch start in (version, target], an entry announcing another epoch, or a
    failed replay) loads the published snapshot of `target` that `snapshot()` fetches (its
    tensors and the checksum the coordinator published for `target`, which they must hash
    to). The returned scope replaces `scope` (a snapshot
    rebuilds the layers, so a trainer bound to the old scope must be rebuilt too).
    """
    from seedfed.shared.model.ternary import crosses_epoch, load_published_ternary

    if scope is not None and version is not None and version <= target and \
            scope.epoch == config.epoch_of(version) and \
            not crosses_epoch(config, version, target):
        announced = {scope.epoch if e.mask_epoch is None else e.mask_epoch for e in entries
                     if version <= e.base_version < target}
        if announced <= {scope.epoch}:
            try:
                return scope, catch_up(scope, task_id=task_id, version=version,
                                       entries=entries, target=target)
            except (ChecksumMismatchError, LogEntryMismatchError):
                pass  # diverged or a gap in the log: the snapshot below settles it
    tensors, target_checksum = snapshot()
    fresh = load_published_ternary(model, tensors, config=config,
                                   epoch=config.epoch_of(target),
                                   expected_checksum=target_checksum)
    return fresh, SyncResult(target, target_checksum, "snapshot")
