"""`seedfed.bench.body_coherence` on a synthetic cache (no model, seconds): the head scope's
gradient, Fisher and Gauss-Newton traces against their closed forms, the Hutchinson Hessian
trace against autograd's Hessian, and the round's effective batch."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from seedfed.bench import body_coherence

HIDDEN = 8


@pytest.fixture(scope="module")
def coherence() -> ModuleType:
    return body_coherence


def synthetic_cache(examples: int = 48) -> dict[str, Any]:
    """Final token states of `examples` sentences (2-5 tokens) and a linear head."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 6, (examples,), generator=gen)
    pool = {"lengths": lengths, "y": torch.randint(0, 2, (examples,), generator=gen),
            "h6": torch.randn(int(lengths.sum()), HIDDEN, generator=gen)}
    params = {"classifier.weight": torch.randn(2, HIDDEN, generator=gen),
              "classifier.bias": torch.randn(2, generator=gen)}
    parts = [np.arange(0, examples // 2), np.arange(examples // 2, examples)]
    return {"pool": pool, "params": params, "parts": parts}


def pooled_features(cache: dict[str, Any]) -> torch.Tensor:
    rows = torch.split(cache["pool"]["h6"], cache["pool"]["lengths"].tolist())
    return F.normalize(torch.stack([r.mean(0) for r in rows]), dim=-1)


def test_head_moments_match_their_closed_forms(coherence: ModuleType) -> None:
    # Arrange: for a linear head on unit-norm features, the margin's gradient has norm^2 4
    cache = synthetic_cache()
    params, names, start, lora = coherence.scope_point(cache, "head", None)
    x, y = pooled_features(cache), cache["pool"]["y"]
    w, b = params["classifier.weight"], params["classifier.bias"]
    p1 = torch.softmax(x @ w.T + b, dim=-1)[:, 1].double()

    # Act
    loss, g = coherence.pool_gradient(cache, params, lora, names, start)
    tr_f, tr_g = coherence.example_moments(cache, params, lora, names, start, sample=48)

    # Assert
    wt, bt = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ref = F.cross_entropy(x @ wt.T + bt, y)
    ref_g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(ref, [wt, bt])])
    assert start == 6 and names == ["classifier.weight", "classifier.bias"]
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    assert torch.allclose(g, ref_g, atol=1e-6)
    assert tr_f == pytest.approx(float(4 * ((p1 - y.double()) ** 2).mean()), rel=1e-4)
    assert tr_g == pytest.approx(float(4 * (p1 * (1 - p1)).mean()), rel=1e-4)


def test_hutchinson_trace_matches_autograd_hessian(coherence: ModuleType) -> None:
    # Arrange
    cache = synthetic_cache()
    params, names, start, lora = coherence.scope_point(cache, "head", None)
    x, y = pooled_features(cache).double(), cache["pool"]["y"]

    def flat_loss(theta: torch.Tensor) -> torch.Tensor:
        w, b = theta[:2 * HIDDEN].view(2, HIDDEN), theta[2 * HIDDEN:]
        return F.cross_entropy(x @ w.T + b, y)

    theta = torch.cat([params[n].reshape(-1) for n in names]).double()
    exact = float(torch.autograd.functional.hessian(flat_loss, theta).trace())
    _, tr_g = coherence.example_moments(cache, params, lora, names, start, sample=48)

    # Act
    estimate = coherence.hessian_trace(cache, params, lora, names, start, 48, tr_g, draws=400)

    # Assert: a cross-entropy head's Hessian is its Gauss-Newton matrix; Hutchinson's spread
    # over 400 Rademacher draws is a few percent here
    assert exact == pytest.approx(tr_g, rel=1e-4)
    assert estimate == pytest.approx(exact, rel=0.15)


def test_effective_batch_counts_each_device_by_its_weight(coherence: ModuleType) -> None:
    equal = [np.arange(100)] * 20
    skewed = [np.arange(1000)] + [np.arange(16)] * 19
    small = [np.arange(4)] * 20  # devices holding fewer than 16 examples send them all

    assert coherence.effective_batch(equal) == pytest.approx(320.0)
    assert coherence.effective_batch(skewed) < 320.0 / 2
    assert coherence.effective_batch(small) == pytest.approx(80.0)
