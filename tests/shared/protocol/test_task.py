"""TaskSpec / Hyper validation: what a task can ask of its devices' probes, and which formats a
scope can take, is refused when the spec is built, before any model loads."""

from __future__ import annotations

import math

import pytest
from seedfed.shared.protocol.task import Hyper, TaskSpec


@pytest.mark.parametrize("kwargs, msg", [
    ({"probe_copies": 0}, "probe_copies"),
    ({"perturbations": 2, "probe_copies": 5}, "4 probes"),
    ({"perturbations": 2, "one_sided": True, "probe_copies": 4}, "3 probes"),
    ({"probe_memory_mb": -1.0}, "probe_memory_mb"),
])
def test_hyper_refuses_probe_settings_a_step_cannot_use(kwargs, msg) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=msg):
        Hyper(**kwargs)


def test_hyper_accepts_every_copy_count_of_a_step() -> None:
    assert Hyper(perturbations=3, probe_copies=6).probe_copies == 6


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "ternary"])
def test_scales_scope_needs_a_quantized_format(fmt: str) -> None:
    with pytest.raises(ValueError, match="needs format int8 or int4"):
        TaskSpec(model_path="m", scope="scales", format=fmt)  # type: ignore[arg-type]


def test_probe_settings_round_trip_through_the_task_dict() -> None:
    spec = TaskSpec(model_path="m", hyper=Hyper(perturbations=4, probe_copies=3,
                                                probe_memory_mb=16.0))

    assert TaskSpec.from_dict(spec.to_dict()) == spec




# -- the lr schedule (spec version 4) ------------------------------------------------------------
def test_a_hyper_without_a_schedule_plans_its_lr_every_round() -> None:
    h = Hyper(lr=0.5)

    assert [h.lr_of_round(n) for n in (1, 2, 1000)] == [0.5, 0.5, 0.5]


def test_the_cosine_runs_from_lr_at_round_one_to_the_final_ratio_and_stays() -> None:
    h = Hyper(lr=24.0, decay_rounds=300, lr_final_ratio=0.1)

    lrs = [h.lr_of_round(n) for n in range(1, 400)]

    assert lrs[0] == 24.0
    assert lrs[299] == pytest.approx(2.4, rel=1e-12)
    assert lrs[299:] == [lrs[299]] * 100  # every round after the schedule keeps the final lr
    assert all(a > b for a, b in zip(lrs[:299], lrs[1:300], strict=True))  # strictly decaying
    assert h.lr_of_round(150) == pytest.approx(2.4 + 21.6 * 0.5 * (1 + math.cos(math.pi * 149
                                                                               / 299)))


def test_a_one_round_schedule_plans_lr_then_the_final_lr() -> None:
    h = Hyper(lr=2.0, decay_rounds=1, lr_final_ratio=0.5)

    assert [h.lr_of_round(n) for n in (1, 2, 3)] == [2.0, 1.0, 1.0]


@pytest.mark.parametrize("kwargs, msg", [
    ({"decay_rounds": 0}, "decay_rounds"),
    ({"decay_rounds": 10, "lr_final_ratio": 0.0}, "lr_final_ratio"),
    ({"decay_rounds": 10, "lr_final_ratio": 1.5}, "lr_final_ratio"),
    ({"decay_rounds": 10, "lr_final_ratio": float("nan")}, "lr_final_ratio"),
])
def test_hyper_refuses_a_schedule_it_cannot_run(kwargs, msg) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=msg):
        Hyper(**kwargs)


def test_rounds_are_numbered_from_one() -> None:
    with pytest.raises(ValueError, match="from 1"):
        Hyper(decay_rounds=5).lr_of_round(0)


def test_a_version_3_spec_reads_as_a_constant_lr_and_a_schedule_round_trips() -> None:
    old = {**TaskSpec(model_path="m").to_dict(), "spec_version": 3}
    old["hyper"] = {k: v for k, v in old["hyper"].items()
                    if k not in ("decay_rounds", "lr_final_ratio")}
    scheduled = TaskSpec(model_path="m", hyper=Hyper(lr=3.0, decay_rounds=7,
                                                     lr_final_ratio=0.25))

    upgraded = TaskSpec.from_dict(old)

    assert upgraded.hyper.decay_rounds is None and upgraded.spec_version == 4
    assert TaskSpec.from_dict(scheduled.to_dict()) == scheduled


def _alternate_spec(**options: object) -> TaskSpec:
    return TaskSpec(model_path="/m", scope="ternary", format="ternary",
                    scope_options={"train_head": True, "alternate": True, "epoch_rounds": 3,
                                   **options},
                    hyper=Hyper(lr=1e-3, perturbations=4, decay_rounds=10))


def test_head_epochs_plan_the_head_lr_on_the_task_schedule_and_the_head_seeds() -> None:
    # Arrange: versions 0-2 epoch 0 (head), 3-5 epoch 1 (latents), 6-8 epoch 2 (head)
    spec = _alternate_spec(head_lr=32.0, head_perturbations=64, head_steps=3)
    head = Hyper(lr=32.0, decay_rounds=10)

    # Act
    plans = [spec.round_hyper(n, n - 1) for n in range(1, 10)]

    # Assert
    assert [(r.steps, r.perturbations) for r in plans] == [(3, 64)] * 3 + [(10, 4)] * 3 + \
        [(3, 64)] * 3
    assert [r.lr for r in plans] == [head.lr_of_round(n) if n in (1, 2, 3, 7, 8, 9)
                                     else spec.hyper.lr_of_round(n) for n in range(1, 10)]
    assert spec.largest_plan() == (10, 64)


def test_without_head_settings_every_round_plans_the_task_hyper() -> None:
    # Arrange
    spec, plain = _alternate_spec(), TaskSpec(model_path="/m", hyper=Hyper(perturbations=4))

    # Act / Assert
    assert spec.round_hyper(1, 0) == (spec.hyper.lr_of_round(1), 10, 4)
    assert plain.round_hyper(5, 4) == (plain.hyper.lr, 10, 4)
    assert plain.largest_plan() == (10, 4)
