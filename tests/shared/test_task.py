"""TaskSpec / Hyper validation: what a task can ask of its devices' probes, and which formats a
scope can take, is refused when the spec is built, before any model loads."""

from __future__ import annotations

import pytest
from seedfed.shared.task import Hyper, TaskSpec


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


