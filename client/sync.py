"""Catch-up: bring a device's trainable state to the coordinator's version, verified.

A device behind version v either replays the log entries it missed (a few scalars each) or loads
a snapshot of version v (safetensors of the exact float32 trainable state). Either way it ends on
the checksum the coordinator published for v, or it raises and keeps nothing half-applied. Which
of the two is cheaper is the coordinator's call (it knows the log); `replay_cost_bytes` (the
coordinator's cost model, `shared.messages`) and `snapshot_cost_bytes` are the estimates a
device without a catch-up plan uses.

A ternary task adds one rule (`replayable_in_epoch`, applied by `client.ternary.PackedTernary`'s
replay): replay only inside a mask epoch; across an epoch start the device
(`client.device.Device`) loads the published ternary snapshot, since its packed model holds no
latents outside its old mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from seedfed.client.backends.base import SyncResult
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.model.scopes import Scope
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    MissingTensorError,
    WireFormatError,
)
from seedfed.shared.protocol.messages import replay_bytes
from seedfed.shared.protocol.npzo import LogEntry

if TYPE_CHECKING:  # the ternary package loads only for ternary tasks
    from seedfed.shared.model.ternary import MaskConfig, TernaryScope


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


def replayable_in_epoch(scope: TernaryScope, *, version: int, target: int, config: MaskConfig,
                        entries: Sequence[LogEntry]) -> bool:
    """Can a ternary device at `version` replay to `target`? Only inside the mask epoch its
    scope holds: no epoch start in (version, target] and no entry announcing another epoch."""
    from seedfed.shared.model.ternary import crosses_epoch

    if scope.epoch != config.epoch_of(version) or crosses_epoch(config, version, target):
        return False
    announced = {scope.epoch if e.mask_epoch is None else e.mask_epoch for e in entries
                 if version <= e.base_version < target}
    return announced <= {scope.epoch}
