import numpy as np
import pytest
from seedfed.shared.model.estimator import ZOConfig, spsa_step
from seedfed.shared.model.scopes import build_scope
from seedfed.shared.protocol.errors import NonFiniteScalarError
from seedfed.shared.protocol.npzo import projected_gradient


def test_projected_gradient_two_point_one_sided_and_clip():
    assert projected_gradient(1.5, 1.0, 0.25, one_sided=False, clip=None) == 1.0
    assert projected_gradient(1.5, 1.0, 0.25, one_sided=True, clip=None) == 2.0
    assert projected_gradient(100.0, 0.0, 0.5, one_sided=False, clip=3.0) == 3.0
    with pytest.raises(NonFiniteScalarError):
        projected_gradient(float("nan"), 1.0, 0.1, False, None)


@pytest.mark.parametrize("kwargs, msg", [({"lr": 0}, "lr"), ({"eps": -1}, "eps"),
                                         ({"perturbations": 0}, "perturbations"),
                                         ({"clip": 0}, "clip"), ({"mode": "x"}, "mode")])
def test_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ZOConfig(**kwargs)


@pytest.mark.parametrize("mode", ["copy", "virtual"])
def test_spsa_on_quadratic_descends(mode):
    import torch
    from torch import nn

    model = nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    scope = build_scope("full", model)

    def loss() -> float:  # |w|^2 through the module's forward, as a model's loss would be
        with torch.no_grad():
            return float((model(torch.eye(8)) ** 2).sum())

    start = loss()
    cfg = ZOConfig(lr=0.05, eps=1e-3, perturbations=4, mode=mode)
    for step in range(40):
        res = spsa_step(scope, loss, [4 * step + j for j in range(4)], cfg)
    assert loss() < 0.5 * start
    assert res.g.dtype == np.float32 and res.forwards == 8
