import pytest
import torch
from seedfed.client.backends.base import SyncResult
from seedfed.client.sync import (
    catch_up,
    load_state,
    replay_cost_bytes,
    snapshot_cost_bytes,
    state_bytes,
)
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope, build_scope
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    WireFormatError,
)
from seedfed.shared.protocol.npzo import LogEntry
from torch import nn

TASK = "t1"


def _model(seed: int = 0) -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _scope(seed: int = 0) -> Scope:
    return build_scope("full", _model(seed))


def _log(n: int) -> list[LogEntry]:
    """n entries v0 -> vn, each with the checksum a coordinator would publish."""
    master = _scope()
    entries = []
    for v in range(n):
        seeds = (100 + 3 * v, 101 + 3 * v)
        coefs = (1e-3 * (v + 1), -2e-3)
        apply_seeds(master, seeds, coefs)
        entries.append(LogEntry(TASK, v, seeds, coefs, checksum(master)))
    return entries


def test_replay_reaches_the_published_checksum() -> None:
    scope, log = _scope(), _log(3)

    result = catch_up(scope, task_id=TASK, version=0, entries=log, target=3)

    assert result == SyncResult(3, log[-1].checksum or "", "replay", 3)
    assert checksum(scope) == log[-1].checksum


def test_entries_the_device_already_applied_are_skipped() -> None:
    scope, log = _scope(), _log(3)
    catch_up(scope, task_id=TASK, version=0, entries=log[:1], target=1)

    result = catch_up(scope, task_id=TASK, version=1, entries=log, target=3)

    assert (result.version, result.entries_applied) == (3, 2)
    assert checksum(scope) == log[-1].checksum


def test_at_target_nothing_moves() -> None:
    scope = _scope()
    before = checksum(scope)

    result = catch_up(scope, task_id=TASK, version=2, entries=[], target=2)

    assert (result.method, result.checksum) == ("none", before)


def test_a_gap_in_the_log_is_refused_before_anything_moves() -> None:
    scope, log = _scope(), _log(3)
    before = checksum(scope)

    with pytest.raises(LogEntryMismatchError, match="snapshot"):
        catch_up(scope, task_id=TASK, version=0, entries=[log[0], log[2]], target=3)

    assert checksum(scope) == before


def test_a_device_ahead_of_the_plan_is_refused() -> None:
    with pytest.raises(LogEntryMismatchError, match="ahead"):
        catch_up(_scope(), task_id=TASK, version=3, entries=[], target=2)


def test_a_diverged_device_is_caught_and_put_back() -> None:
    scope, log = _scope(seed=1), _log(2)  # a different starting state than the coordinator's
    before = checksum(scope)

    with pytest.raises(ChecksumMismatchError):
        catch_up(scope, task_id=TASK, version=0, entries=log, target=2)

    assert checksum(scope) == before


def test_snapshot_round_trip_is_bit_exact() -> None:
    source, target = _scope(seed=3), _scope(seed=4)

    got = load_state(target, state_bytes(source), checksum(source))

    assert got == checksum(source) == checksum(target)


def test_snapshot_with_the_wrong_checksum_leaves_the_state_alone() -> None:
    source, target = _scope(seed=3), _scope(seed=4)
    before = checksum(target)

    with pytest.raises(ChecksumMismatchError):
        load_state(target, state_bytes(source), "0" * 64)

    assert checksum(target) == before


@pytest.mark.parametrize("data", [b"not safetensors", None])
def test_snapshot_that_does_not_fit_is_a_wire_error(data: bytes | None) -> None:
    target = _scope()
    if data is None:  # valid safetensors of another model
        data = state_bytes(build_scope("full", nn.Linear(3, 3)))

    with pytest.raises(WireFormatError):
        load_state(target, data)


def test_cost_estimates_grow_with_what_must_move() -> None:
    log, scope = _log(4), _scope()

    assert replay_cost_bytes(log[:1]) < replay_cost_bytes(log)
    assert snapshot_cost_bytes(scope) >= 4 * scope.numel
