"""Task creation refuses, before any round opens, what no device could train: LoRA targets that
match no module, a scope the loss never reads, stacked probes beyond the memory the task grants."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from seedfed.server.coordinator import Coordinator
from seedfed.server.errors import InvalidTaskError
from seedfed.shared.protocol.task import Hyper, LoraOptions

from tests.server.conftest import tiny_spec


def test_lora_targets_matching_no_module_are_refused(coord: Coordinator, tiny_bert: Path) -> None:
    spec = tiny_spec(tiny_bert, lora=LoraOptions(r=2, target_modules=("layer.9.query",)))

    with pytest.raises(InvalidTaskError, match="layer.9.query"):
        coord.create_task(spec)


def test_named_scope_matching_no_tensor_is_refused(coord: Coordinator, tiny_bert: Path) -> None:
    spec = tiny_spec(tiny_bert, scope="named", scope_options={"patterns": ("decoder",)})

    with pytest.raises(InvalidTaskError, match="decoder"):
        coord.create_task(spec)


def test_stacked_probes_beyond_the_memory_budget_are_refused(coord: Coordinator,
                                                            tiny_bert: Path) -> None:
    base = tiny_spec(tiny_bert)
    hyper = replace(base.hyper, perturbations=3, probe_copies=6, probe_memory_mb=1e-4)

    with pytest.raises(InvalidTaskError, match="probe_copies=6"):
        coord.create_task(replace(base, hyper=hyper))


def test_a_budget_that_holds_the_copies_creates_the_task(coord: Coordinator,
                                                         tiny_bert: Path) -> None:
    spec = tiny_spec(tiny_bert, hyper=Hyper(lr=1e-2, eps=1e-3, steps=1, perturbations=3,
                                            batch_size=4, probe_copies=6))

    assert coord.create_task(spec)
