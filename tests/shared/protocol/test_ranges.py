"""Every number of a task definition has a range (`seedfed.shared.protocol.ranges`): out-of-range
values fail when the task is defined, naming the field and its range; the measured recipes sit
inside every range; a stored spec still loads; and no accepted task can overflow a coefficient."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from seedfed.shared.protocol import ranges as R
from seedfed.shared.protocol.aggregate import AggregationConfig, build_entry
from seedfed.shared.protocol.npzo import scaled_multiple
from seedfed.shared.protocol.recipes import RECIPES, resolve_recipe
from seedfed.shared.protocol.scope_options import ScalesOptions, TernaryOptions
from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec
from seedfed.shared.protocol.wire import MAX_ABS_SCALAR


def spec_dict(**over: Any) -> dict[str, Any]:
    d = TaskSpec(model_path="/m").to_dict()
    for key, value in over.items():
        if isinstance(value, dict):
            d[key] = {**d.get(key, {}), **value}
        else:
            d[key] = value
    return d


# The absurd values a probe found accepted at task creation, and their neighbours.
ABSURD = [
    ({"hyper": {"lr": 1e37}}, r"hyper.lr must be in \[1e-12, 10000\], got 1e\+37"),
    ({"hyper": {"lr": 1e300}}, "hyper.lr must be in"),
    ({"hyper": {"eps": 1e300}}, r"hyper.eps must be in \[1e-08, 100\]"),
    ({"hyper": {"batch_size": 10**12}}, r"hyper.batch_size must be an integer in 1..4096"),
    ({"hyper": {"batch_size": 1e12}}, "hyper.batch_size must be an integer"),
    ({"hyper": {"clip": 1e300}}, r"hyper.clip must be in \(0, 1e\+06\]"),
    ({"hyper": {"steps": 5000}}, "hyper.steps must be an integer in 1..1024"),
    ({"hyper": {"perturbations": 70000}}, "hyper.perturbations must be an integer in 1..65536"),
    ({"hyper": {"steps": 1024, "perturbations": 1024}},
     r"steps x perturbations \(1024 x 1024\) must be an integer in 1..65536"),
    ({"hyper": {"probe_memory_mb": 1e9}}, "hyper.probe_memory_mb must be in"),
    ({"hyper": {"decay_rounds": 2**40}}, "hyper.decay_rounds must be an integer"),
    ({"max_seq_len": 10**9}, "max_seq_len must be an integer in 1..32768"),
    ({"hyper": {"batch_size": 4096}, "max_seq_len": 4096},
     r"batch_size x max_seq_len \(4096 x 4096\) must be an integer in 1..262144"),
    ({"num_labels": 10**7}, "num_labels must be an integer in 1..4096"),
    ({"lora": {"r": 10**6}}, r"lora.r must be an integer in 1..256, got 1000000"),
    ({"lora": {"alpha": 10**7}}, "lora.alpha must be an integer in 1..4096"),
    ({"aggregation": {"dp_clip": 1.0, "dp_noise_multiplier": 1e300}},
     r"aggregation.dp_noise_multiplier must be in \[0, 1000\]"),
    ({"aggregation": {"dp_clip": 1e300}}, r"aggregation.dp_clip must be in \(0, 1e\+06\]"),
    ({"aggregation": {"clip_bound": float("inf")}}, "aggregation.clip_bound must be in"),
    ({"step_scales": [["classifier", 1e30]]}, r"step_scales\['classifier'\] must be in"),
    ({"model_path": "m" * 5000}, r"model_path \(characters\) must be an integer in 1..4096"),
]


@pytest.mark.parametrize(("over", "msg"), ABSURD)
def test_an_out_of_range_value_fails_naming_the_field_and_its_range(
        over: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        TaskSpec.from_dict(spec_dict(**over))


@pytest.mark.parametrize(("kind", "options", "msg"), [
    ("scales", {"group_size": 1 << 20}, "scope_options.group_size must be an integer in"),
    ("scales", {"layers": ["x"] * 300}, "scope_options.layers must hold 0..256 entries"),
    ("ternary", {"epoch_rounds": 2**40}, "scope_options.epoch_rounds must be an integer"),
    ("ternary", {"act_bits": 64}, "scope_options.act_bits must be an integer in 2..16"),
    ("ternary", {"alternate": True, "train_head": True, "head_lr": 1e37},
     r"scope_options.head_lr must be in \[1e-12, 10000\]"),
    ("ternary", {"alternate": True, "train_head": True, "head_steps": 10**6},
     "scope_options.head_steps must be an integer in 1..1024"),
    ("named", {"patterns": ["p" * 2000]}, "at most 1024 characters"),
])
def test_every_scope_option_has_a_range(kind: str, options: dict[str, Any], msg: str) -> None:
    fmt = {"scales": "int8", "ternary": "ternary"}.get(kind, "fp32")
    with pytest.raises(ValueError, match=msg):
        TaskSpec.from_dict(spec_dict(scope=kind, scope_options=options, format=fmt))


def test_every_number_of_a_task_definition_declares_a_range() -> None:
    # Arrange: the dataclasses a task is made of, and their numeric fields
    classes = [Hyper, LoraOptions, AggregationConfig, TaskSpec, ScalesOptions, TernaryOptions]
    unbounded = []

    # Act
    for cls in classes:
        for f in dataclasses.fields(cls):
            hint = str(f.type)
            numeric = any(t in hint for t in ("int", "float")) and "tuple" not in hint
            if numeric and "range" not in f.metadata and f.name not in ("bits", "spec_version"):
                unbounded.append(f"{cls.__name__}.{f.name}")

    # Assert (bits is one of 4 and 8; spec_version is checked against SPEC_VERSION)
    assert unbounded == []


def test_the_help_of_each_class_shows_the_ranges() -> None:
    assert "(in [1e-12, 10000])" in Hyper.help()["lr"]
    assert "(an integer in 1..256)" in LoraOptions.help()["r"]
    assert "(in [0, 1000])" in AggregationConfig.help()["dp_noise_multiplier"]
    assert "(an integer in 2..16)" in TernaryOptions.help()["act_bits"]
    assert "(an integer in 1..32768)" in TaskSpec.help()["max_seq_len"]


@pytest.mark.parametrize("recipe, fmt", [(r, None) for r in sorted(RECIPES)] + [
    (r, "int4") for r in sorted(RECIPES) if RECIPES[r].task.get("format") != "ternary"])
def test_every_measured_recipe_is_inside_every_range(recipe: str, fmt: str | None) -> None:
    spec = resolve_recipe(recipe, {} if fmt is None else {"spec.format": fmt}, model="/m").spec

    again = TaskSpec.from_dict(json.loads(json.dumps(spec.to_dict())))

    assert again == spec and spec.hyper.lr == again.hyper.lr


def test_a_stored_spec_loads_whatever_ranges_came_later() -> None:
    # Arrange: a spec stored by a coordinator that had no ranges yet
    stored = spec_dict(hyper={"lr": 1e37}, lora={"r": 10**6})

    # Act
    spec = TaskSpec.from_dict(stored, stored=True)

    # Assert: it loads, every other rule still holds, and a new definition is still refused
    assert spec.hyper.lr == 1e37 and spec.lora.r == 10**6
    assert spec.round_hyper(1, 0).lr == 1e37
    with pytest.raises(ValueError, match="lora.r"):
        TaskSpec.from_dict(stored)
    with pytest.raises(ValueError, match="spec_version"):
        TaskSpec.from_dict({**stored, "spec_version": 99}, stored=True)
    assert R.checking()  # the exemption ends with the load


def test_no_accepted_task_overflows_a_coefficient() -> None:
    # Arrange: every factor of a coefficient at the edge of its range: the largest lr, one
    # seed, scalars at the wire bound and a DP noise draw 40 standard deviations out
    lr, p = R.MAX_LR, 1
    noise = 40 * R.MAX_DP_NOISE_MULTIPLIER * R.MAX_ABS_SCALAR
    g = np.array([[MAX_ABS_SCALAR + noise, -(MAX_ABS_SCALAR + noise)]])

    # Act
    entry = build_entry("t", 0, (1, 2), g, np.ones(1), lr, p)
    moved = [scaled_multiple(c, R.MAX_STEP_SCALE) for c in entry.coefs]
    probe = scaled_multiple(R.MIN_EPS, R.MIN_STEP_SCALE)

    # Assert: finite with twenty orders of magnitude to spare; the smallest probe step normal
    assert all(math.isfinite(c) and abs(c) < 1e18 for c in moved)
    assert probe >= np.finfo(np.float32).tiny
    assert R.MAX_ABS_SCALAR == MAX_ABS_SCALAR


def test_server_readme_documents_every_range() -> None:
    # Arrange: the table the coordinator's README must show, from the fields themselves
    readme = (Path(__file__).resolve().parents[3] / "server" / "README.md").read_text("utf-8")
    parts = [(TaskSpec, ""), (Hyper, "hyper."), (LoraOptions, "lora."),
             (AggregationConfig, "aggregation."), (ScalesOptions, "scope_options."),
             (TernaryOptions, "scope_options.")]

    # Act
    missing = [f"| `{path}` | {rng} |" for cls, prefix in parts
               for path, (rng, _) in R.ranges_of(cls, prefix).items()
               if f"| `{path}` | {rng} |" not in readme]

    # Assert
    assert missing == []
