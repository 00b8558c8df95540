"""The numpy replay path (shared/protocol/npzo.py, shared/protocol/philox.py) against the torch
one, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from seedfed.shared.model import stream
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.protocol import npzo, philox
from seedfed.shared.protocol.errors import ChecksumMismatchError
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    # one tensor longer than a chunk, so the chunked generators continue across chunks
    return nn.Sequential(nn.Linear(3, philox.CHUNK_ELEMENTS // 3 + 100), nn.Linear(5, 7))


def test_numpy_replay_gives_the_torch_replays_bits_and_checksum() -> None:
    model = _model()
    scope = build_scope("full", model)
    state = {t.name: t.values().numpy().copy() for t in scope}
    seeds = [3, 2**63 + 5, 2**64 - 1]
    coefs = [0.25, -1e-3, 7.5e-6]

    apply_seeds(scope, seeds, coefs)
    npzo.np_apply_seeds(state, seeds, coefs)

    for t in scope:
        np.testing.assert_array_equal(state[t.name], t.values().numpy())
    assert npzo.np_checksum(state) == checksum(scope)


def test_masked_signs_and_perturbed_copies_match_the_torch_stream() -> None:
    idx = np.array([0, 5, 255, 256, 70_000, 70_001])
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))

    signs = philox.signs_at(9, "w", idx)
    plus = philox.add_dense(x.numpy(), "w", [9], [float(np.float32(1e-3))])

    np.testing.assert_array_equal(signs, stream.rademacher_at(9, "w", idx).numpy())
    np.testing.assert_array_equal(plus, stream.perturbed(x, "w", 9, 1e-3).numpy())


def test_a_replay_whose_checksum_differs_puts_the_state_back() -> None:
    state = {"a": np.arange(10, dtype=np.float32)}
    good = npzo.LogEntry("t", 0, (1,), (0.5,))
    bad = npzo.LogEntry("t", 1, (2,), (0.5,), checksum="0" * 64)

    with pytest.raises(ChecksumMismatchError):
        npzo.np_replay(state, [good, bad], task_id="t", version=0)

    np.testing.assert_array_equal(state["a"], np.arange(10, dtype=np.float32))


def test_step_scalars_follow_the_probe_order_of_both_forms() -> None:
    two = npzo.step_scalars([1.0, 0.5, 0.2, 0.4], 2, 0.1, False, None)
    one = npzo.step_scalars([1.0, 1.5, 0.5], 2, 0.1, True, 2.0)

    np.testing.assert_array_equal(two, np.float32([2.5, -1.0]))
    np.testing.assert_array_equal(one, np.float32([2.0, -2.0]))  # 5 and -5, clipped to 2
    assert npzo.step_probes([7, 8], 0.1, True) == [None, (7, 0.1), (8, 0.1)]
