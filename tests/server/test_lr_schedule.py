"""A task's lr schedule is the coordinator's alone: each round's plan carries that round's lr,
and the round's log entry is built from it (so devices and replay need nothing new)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from seedfed.server.coordinator import Coordinator
from seedfed.shared.protocol.npzo import update_coefficients
from seedfed.shared.protocol.task import Hyper
from seedfed.shared.protocol.wire import Upload

from tests.server.conftest import tiny_spec


def test_each_plan_carries_its_rounds_lr_and_the_entry_uses_it(coord: Coordinator,
                                                                tiny_bert: Path) -> None:
    # Arrange: a three-round cosine from 0.02 to 0.005, run for four rounds
    hyper = Hyper(lr=0.02, eps=1e-3, steps=1, perturbations=3, batch_size=4, decay_rounds=3,
                  lr_final_ratio=0.25)
    task_id = coord.create_task(tiny_spec(tiny_bert, hyper=hyper))
    device, _ = coord.enroll(task_id)
    g = np.array([[0.5, -1.25, 2.0]])
    lrs, coefs = [], []

    # Act
    for _ in range(4):
        plan = coord.open_round(task_id)
        coord.submit(task_id, device, Upload.build(plan, g, 4, 0.1))
        lrs.append(plan.lr)
        coefs.append(coord.close_round(task_id).to_entry().coefs)

    # Assert: 0.02, the cosine's midpoint, then 0.005 for good
    assert lrs == [0.02, 0.0125, 0.005, 0.005]
    for lr, c in zip(lrs, coefs, strict=True):
        assert c == tuple(float(x) for x in update_coefficients(g[0].astype(np.float32), lr, 3))
