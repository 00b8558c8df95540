"""Per-tensor step scales (TaskSpec.step_scales, ScopedTensor.step_scale): theta_t = theta0_t +
c_t * phi_t. Probes show fl32(eps c_t) z, updates add fl32(coef c_t) z, on every path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from seedfed.client.probes import ProbeEngine, engine_step
from seedfed.shared.model.estimator import ZOConfig, spsa_step
from seedfed.shared.model.lora import apply_lora
from seedfed.shared.model.objectives import causal_lm_loss, causal_lm_losses
from seedfed.shared.model.perturb import Perturber, perturbed_copy
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope, build_scope
from seedfed.shared.model.stream import rademacher
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.task import LoraOptions, TaskSpec

from tests.shared.conftest import tiny_llama

SEEDS = [3, 4, 5]
C = 0.03


def _scaled_lora(c: float = C) -> Scope:
    model = apply_lora(tiny_llama(), LoraOptions(r=4, target_modules=("q_proj", "v_proj")),
                       "causal_lm")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(False)
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    scope = build_scope("lora", model)
    scope.set_step_scales([("lora_B", c)])
    return scope


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_replay_adds_the_rounded_scaled_coefficient_exactly() -> None:
    scope = _scaled_lora()
    before = scope.read()
    coef = 0.123456789

    apply_seeds(scope, [SEEDS[0]], [coef])

    for t in scope:
        z = rademacher(SEEDS[0], t.name, t.numel).reshape(-1)
        step = np.float32(coef * C) if "lora_B" in t.name else np.float32(coef)
        expected = (before[t.name].numpy() + step * z.numpy()).astype(np.float32)
        assert t.step_scale == (C if "lora_B" in t.name else 1.0)
        assert np.array_equal(t.values().numpy(), expected)


def test_a_probe_shows_theta_plus_rounded_eps_times_scale() -> None:
    scope = _scaled_lora()
    eps = 1e-3
    want = {}
    for t in scope:
        z = rademacher(SEEDS[0], t.name, t.numel).reshape(t.tensor.shape)
        want[t.name] = t.tensor + np.float32(eps * t.step_scale) * z
        assert torch.equal(perturbed_copy(t, SEEDS[0], eps), want[t.name])
    perturber = Perturber(scope, "copy")

    with perturber.step(), perturber.probe(SEEDS[0], eps):
        seen = {t.name: t.tensor.clone() for t in scope}

    assert all(torch.equal(seen[n], want[n]) for n in want)


@pytest.mark.parametrize("batched", [False, True])
def test_engine_gives_the_sequential_scalars_and_update_with_scales(batched: bool) -> None:
    scope = _scaled_lora()
    model, batch = scope.model, _batch()
    config = ZOConfig(lr=1e-2, eps=1e-3, perturbations=len(SEEDS))
    start = scope.read()
    with torch.no_grad():
        ref = spsa_step(scope, lambda: float(causal_lm_loss(model, batch)), SEEDS, config)
    ref_sum = checksum(scope)
    scope.write(start)

    engine = ProbeEngine(model, scope, causal_lm_loss, causal_lm_losses if batched else None)
    got = engine_step(engine, batch, SEEDS, config)

    if batched:
        np.testing.assert_allclose(got.g, ref.g, atol=2e-3, rtol=1e-3)
    else:
        assert np.array_equal(got.g, ref.g)
        assert checksum(scope) == ref_sum


def test_scaled_and_unscaled_scopes_differ_only_in_the_scaled_tensors() -> None:
    scaled, plain = _scaled_lora(), _scaled_lora(1.0)

    for scope in (scaled, plain):
        apply_seeds(scope, SEEDS, [0.5, -0.25, 0.125])

    a, b = scaled.read(), plain.read()
    for name in a:
        assert torch.equal(a[name], b[name]) != ("lora_B" in name)


def test_a_pattern_that_matches_no_tensor_is_refused() -> None:
    scope = _scaled_lora()
    with pytest.raises(ScopeError, match="matches no tensor"):
        scope.set_step_scales([("lora_Q", 0.1)])


def test_task_spec_validates_and_round_trips_step_scales() -> None:
    spec = TaskSpec(model_path="m", scope="named", scope_options={"patterns": ["classifier"]},
                    step_scales=(("encoder", 0.05),))

    again = TaskSpec.from_dict(json.loads(json.dumps(spec.to_dict())))

    assert again == spec and again.step_scales == (("encoder", 0.05),)
    old = {k: v for k, v in spec.to_dict().items() if k != "step_scales"}
    assert TaskSpec.from_dict({**old, "spec_version": 2}).step_scales == ()
    for bad in ((("encoder", 0.0),), (("", 1.0),), (("a", 1.0), ("a", 2.0)), (("a",),),
                (("a", float("nan")),)):
        with pytest.raises(ValueError):
            TaskSpec(model_path="m", step_scales=bad)  # type: ignore[arg-type]
