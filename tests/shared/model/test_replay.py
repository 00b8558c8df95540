import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from seedfed.client.trainer import LocalTrainer
from seedfed.shared.model.objectives import causal_lm_loss
from seedfed.shared.model.replay import apply_seeds, checksum, replay
from seedfed.shared.model.scopes import Scope, ScopedTensor, build_scope
from seedfed.shared.protocol.aggregate import build_entry
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    NonFiniteScalarError,
)
from seedfed.shared.protocol.npzo import LogEntry, update_coefficients
from seedfed.shared.protocol.wire import RoundPlan

from tests.shared.conftest import tiny_llama
from tests.shared.devices import DEVICES, host_stream, torch_stream

SETTINGS = settings(
    max_examples=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
seeds_st = st.integers(min_value=0, max_value=2**53 - 1)


def _plan(seeds: list[list[int]], lr: float, eps: float, clip: float | None = None,
          one_sided: bool = False) -> RoundPlan:
    return RoundPlan(task_id="t", round=0, version=0, seeds=seeds, lr=lr, eps=eps, batch_size=4,
                     clip=clip, one_sided=one_sided)


def _batches(seed: int, n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 96, (2, 8), generator=gen)} for _ in range(n)]


@SETTINGS
@given(
    steps=st.integers(1, 3), perturbations=st.integers(1, 3), base=seeds_st,
    lr=st.floats(1e-5, 1e-1), eps=st.floats(1e-4, 1e-1), one_sided=st.booleans(),
    clip=st.one_of(st.none(), st.floats(0.1, 10.0)), mode=st.sampled_from(["copy", "virtual"]),
)
def test_replaying_own_uploads_reproduces_local_model_bitwise(steps, perturbations, base, lr, eps,
                                                              one_sided, clip, mode):
    # Arrange: a device and a coordinator holding the same version-0 weights
    device, coordinator = tiny_llama(), tiny_llama()
    d_scope, c_scope = build_scope("full", device), build_scope("full", coordinator)
    seeds = [[(base + i * perturbations + j) % 2**53 for j in range(perturbations)]
             for i in range(steps)]
    plan = _plan(seeds, lr, eps, clip, one_sided)
    # Act: local training that keeps its result, then replay of the uploaded scalars
    result = LocalTrainer(device, d_scope, causal_lm_loss, mode=mode).run(
        plan, iter(_batches(1, steps)), keep=True)
    coefs = update_coefficients(result.scalars.reshape(-1), lr, perturbations)
    apply_seeds(c_scope, plan.flat_seeds, coefs.tolist())
    # Assert
    assert checksum(c_scope) == checksum(d_scope)


@SETTINGS
@given(n_devices=st.integers(2, 4), base=seeds_st, data=st.data())
def test_weighted_mean_entry_is_fedavg_of_local_models_and_order_free(n_devices, base, data):
    # Arrange
    steps, perturbations, lr = 2, 2, 1e-2
    weights = np.array(data.draw(st.lists(st.integers(1, 50), min_size=n_devices,
                                          max_size=n_devices)), dtype=np.float64)
    seeds = [[(base + 2 * i + j) % 2**53 for j in range(perturbations)] for i in range(steps)]
    plan = _plan(seeds, lr, 1e-2)
    start = tiny_llama()
    locals_, rows = [], []
    for d in range(n_devices):
        m = tiny_llama()
        scope = build_scope("full", m)
        res = LocalTrainer(m, scope, causal_lm_loss).run(plan, iter(_batches(10 + d, steps)),
                                                        keep=True)
        locals_.append(scope.read())
        rows.append(res.scalars.reshape(-1))
    g = np.stack(rows)
    # Act
    entry = build_entry("t", 0, plan.flat_seeds, g, weights, lr, perturbations)
    perm = np.array(data.draw(st.permutations(range(n_devices))))
    shuffled = build_entry("t", 0, plan.flat_seeds, g[perm], weights[perm], lr, perturbations)
    s_scope = build_scope("full", start)
    apply_seeds(s_scope, entry.seeds, entry.coefs)
    # Assert
    assert entry.coefs == shuffled.coefs
    state = s_scope.read()
    for name, value in state.items():
        avg = sum(w * locals_[d][name].double() for d, w in enumerate(weights)) / weights.sum()
        torch.testing.assert_close(value.double(), avg, rtol=0, atol=1e-6)


def test_replay_refuses_entry_of_another_task_and_changes_nothing(llama):
    scope = build_scope("full", llama)
    before = checksum(scope)
    with pytest.raises(LogEntryMismatchError, match="task 'other'"):
        replay(scope, [LogEntry("other", 0, (1,), (0.1,))], task_id="t", version=0)
    assert checksum(scope) == before


def test_replay_refuses_gap_in_versions(llama):
    scope = build_scope("full", llama)
    entries = [LogEntry("t", 0, (1,), (0.1,)), LogEntry("t", 2, (2,), (0.1,))]
    with pytest.raises(LogEntryMismatchError, match="does not follow version 1"):
        replay(scope, entries, task_id="t", version=0)


def test_replay_refuses_non_finite_coefficient_before_applying_any(llama):
    scope = build_scope("full", llama)
    before = checksum(scope)
    entries = [LogEntry("t", 0, (1,), (0.1,)), LogEntry("t", 1, (2,), (math.nan,))]
    with pytest.raises(NonFiniteScalarError):
        replay(scope, entries, task_id="t", version=0)
    assert checksum(scope) == before


def test_checksum_mismatch_restores_state(llama):
    scope = build_scope("full", llama)
    before = checksum(scope)
    with pytest.raises(ChecksumMismatchError, match="re-sync from a snapshot"):
        replay(scope, [LogEntry("t", 0, (1,), (0.1,), checksum="0" * 64)], task_id="t", version=0)
    assert checksum(scope) == before


def test_replay_with_correct_checksums_advances_version(llama):
    scope, twin = build_scope("full", llama), build_scope("full", tiny_llama())
    apply_seeds(twin, (1, 2), (0.01, -0.02))
    entry = LogEntry("t", 0, (1, 2), (0.01, -0.02), checksum=checksum(twin))
    assert replay(scope, [entry], task_id="t", version=0) == 1
    assert checksum(scope) == checksum(twin)


def test_update_coefficients_refuse_non_finite():
    with pytest.raises(NonFiniteScalarError):
        update_coefficients(np.array([1.0, np.inf]), 0.1, 1)


# -- the stream's torch path (any device; forced on the CPU): the same replay and checksums --

def _masked_llama_scope(device: str = "cpu"):
    model = tiny_llama().to(device)
    rng = np.random.default_rng(0)
    tensors = []
    for name, p in model.named_parameters(remove_duplicate=True):
        idx = np.flatnonzero(rng.random(p.numel()) < 0.1).astype(np.int64)
        tensors.append(ScopedTensor(name, p, torch.from_numpy(idx).to(device)))
    return Scope(model, tensors)


DEVICE_SCOPES = {
    "full": lambda device: build_scope("full", tiny_llama().to(device)),
    "named": lambda device: build_scope("named", tiny_llama().to(device),
                                        patterns=("layers.1.",)),
    "masked": _masked_llama_scope,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(DEVICE_SCOPES))
def test_torch_path_replay_reaches_the_kernel_checksum(device, kind):
    rng = np.random.default_rng(3)
    seeds = [int(s) for s in rng.integers(0, 2**64 - 1, size=12, dtype=np.uint64)]
    coefs = [float(np.float32(c)) for c in rng.normal(0, 1e-3, size=12)]
    host, on_device = DEVICE_SCOPES[kind]("cpu"), DEVICE_SCOPES[kind](device)
    assert checksum(on_device) == checksum(host)  # the hash of the same bytes, host or device

    with host_stream():
        apply_seeds(host, seeds, coefs)
    with torch_stream():
        apply_seeds(on_device, seeds, coefs)

    assert next(iter(on_device)).tensor.device.type == device
    assert checksum(on_device) == checksum(host)


@pytest.mark.parametrize("kind", ["scales", "ternary"])
def test_torch_path_replay_of_scales_and_ternary_scopes_reaches_the_kernel_checksum(kind):
    from seedfed.shared.model.quant import QuantConfig, quantize_model

    def scope():
        if kind == "scales":
            return build_scope("scales", quantize_model(tiny_llama(),
                                                        QuantConfig(bits=4, group_size=16)))
        return build_scope("ternary", tiny_llama(), fraction=0.05)

    seeds, coefs = [5, 2**63 + 1, 77], [1e-3, -2e-3, 5e-4]
    kernel_scope, torch_scope = scope(), scope()

    with host_stream():
        apply_seeds(kernel_scope, seeds, coefs)
    with torch_stream():
        apply_seeds(torch_scope, seeds, coefs)

    assert checksum(torch_scope) == checksum(kernel_scope)


@pytest.mark.parametrize("mode", ["copy", "virtual"])
def test_a_torch_path_device_and_a_kernel_path_coordinator_end_on_one_checksum(mode):
    # Arrange: the device trains with the torch ops, the coordinator replays with the kernel
    device, coordinator, kernel_device = tiny_llama(), tiny_llama(), tiny_llama()
    d_scope, c_scope = build_scope("full", device), build_scope("full", coordinator)
    k_scope = build_scope("full", kernel_device)
    seeds = [[2**53 - 1, 12], [2**40 + 3, 0]]  # a plan's seeds are JSON-safe integers
    plan = _plan(seeds, 1e-2, 1e-3)
    # Act
    with torch_stream():
        result = LocalTrainer(device, d_scope, causal_lm_loss, mode=mode).run(
            plan, iter(_batches(1, 2)), keep=True)
    with host_stream():
        kernel_result = LocalTrainer(kernel_device, k_scope, causal_lm_loss, mode=mode).run(
            plan, iter(_batches(1, 2)), keep=True)
        coefs = update_coefficients(result.scalars.reshape(-1), 1e-2, 2)
        apply_seeds(c_scope, plan.flat_seeds, coefs.tolist())
    # Assert: one forward arithmetic on one CPU, so the scalars are the kernel path's too
    assert np.array_equal(result.scalars, kernel_result.scalars)
    assert checksum(c_scope) == checksum(d_scope) == checksum(k_scope)
