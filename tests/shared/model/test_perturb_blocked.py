"""A virtual probe through a large bias-free Linear (an LM head) computes its forward in
blocks of perturbed rows instead of swapping in a whole perturbed copy: the same probe, no
second copy of the matrix, the stored weight untouched."""

from __future__ import annotations

import pytest
import torch
from seedfed.shared.model import perturb
from seedfed.shared.model.perturb import Perturber
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.model.stream import add_words as stream_add_words
from torch import nn


def _model() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 300, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("block_bytes", [4 * 128 * 64, 4 * 128 * 128, 4 * 128 * 300])
def test_blocked_probes_equal_the_swapped_copy(monkeypatch: pytest.MonkeyPatch,
                                               block_bytes: int) -> None:
    # Arrange: the head (300 x 128) counts as large; blocks of 64, 128 or 256 rows
    model = _model()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    scope = build_scope("full", model)
    before = model[2].weight.detach().clone()
    swapped = Perturber(scope, "virtual")
    with swapped.step(), swapped.probe(7, 1e-2):
        expected = model(x)
    monkeypatch.setattr(perturb, "BLOCKED_BYTES", 4 * 128 * 100)
    monkeypatch.setattr(perturb, "BLOCK_BYTES", block_bytes)
    blocked = Perturber(scope, "virtual")
    calls: list[int] = []
    monkeypatch.setattr(perturb, "add_words", lambda *a: calls.append(1) or
                        stream_add_words(*a))
    # Act
    with blocked.step(), blocked.probe(7, 1e-2):
        got = model(x)
    # Assert
    # the first layer's weight and bias are swapped copies (one pass each); the head in blocks
    assert len(calls) == 2 + -(-300 // max(64, block_bytes // (4 * 128) // 64 * 64))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(model[2].weight, before)  # theta untouched, no forward left patched
    assert "forward" not in vars(model[2])
