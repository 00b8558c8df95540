"""Typed scope options: validated when the task is defined, the same JSON object on the wire,
and a stored spec of today's (pre-typed) layout still loads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from seedfed.shared.model.ternary import MaskConfig, mask_config
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.scope_options import (
    NamedOptions,
    NoOptions,
    ScalesOptions,
    ScopeOptionsError,
    TernaryOptions,
    options_for,
)
from seedfed.shared.protocol.task import SPEC_VERSION, TaskSpec

#: A task row's spec_json as the coordinator stored it before spec_version and typed options.
OLD_HEAD_TASK = """{"model_path": "/models/minilm", "model_kind": "seq_cls", "num_labels": 2,
 "label_texts": ["It was terrible.", "It was great."], "scope": "named",
 "scope_options": {"patterns": ["classifier"]},
 "lora": {"r": 8, "alpha": 16, "target_modules": ["query", "value"], "train_head": true},
 "format": "fp32",
 "hyper": {"lr": 4.0, "eps": 0.001, "steps": 1, "perturbations": 64, "batch_size": 16,
           "clip": null, "one_sided": false, "probe_copies": null, "probe_memory_mb": 32.0},
 "aggregation": {}, "max_seq_len": 64}"""
OLD_TERNARY_TASK = """{"model_path": "/models/llama", "model_kind": "causal_lm",
 "scope": "ternary", "format": "ternary",
 "scope_options": {"fraction": 0.05, "epoch_rounds": 2, "act_bits": null}}"""


def test_a_stored_spec_of_the_old_layout_loads_with_typed_options() -> None:
    # Act
    head = TaskSpec.from_dict(json.loads(OLD_HEAD_TASK))
    ternary = TaskSpec.from_dict(json.loads(OLD_TERNARY_TASK))

    # Assert
    assert head.spec_version == SPEC_VERSION
    assert head.scope_options == NamedOptions(patterns=("classifier",))
    assert ternary.scope_options == TernaryOptions(fraction=0.05, epoch_rounds=2, act_bits=None)
    assert mask_config(ternary.scope_options) == MaskConfig(fraction=0.05, epoch_rounds=2)


def test_the_options_keep_their_json_object_on_the_wire() -> None:
    # Arrange
    old = json.loads(OLD_TERNARY_TASK)

    # Act
    again = TaskSpec.from_dict(old).to_dict()

    # Assert: the same options object (fields at their default left out) plus the version
    assert again["scope_options"] == old["scope_options"]
    assert again["spec_version"] == SPEC_VERSION
    assert TaskSpec.from_dict(json.loads(json.dumps(again))) == TaskSpec.from_dict(old)


@pytest.mark.parametrize(("kind", "options", "msg"), [
    ("named", {}, "at least one"),
    ("named", {"pattern": ["x"]}, "no option 'pattern'; its options: patterns"),
    ("scales", {"floor": 0.0}, r"scope_options.floor must be in \(0, 1\], got 0.0"),
    ("scales", {"bits": 3}, "bits must be 4 or 8"),
    ("ternary", {"fraction": 2.0}, r"scope_options.fraction must be in \(0, 1\]"),
    ("ternary", {"selection": "best"}, "selection must be one of"),
    ("full", {"patterns": ["x"]}, "scope 'full' has no option 'patterns'"),
])
def test_bad_options_fail_when_the_task_is_defined(kind: str, options: dict[str, object],
                                                   msg: str) -> None:
    # Act / Assert
    with pytest.raises(ScopeOptionsError, match=msg):
        TaskSpec(model_path="/m", model_kind="causal_lm", scope=kind,
                 format="int8" if kind == "scales" else "fp32", scope_options=options)


def test_option_errors_are_scope_errors_and_value_errors() -> None:
    # The coordinator turns ValueError into a 422 InvalidTaskError; builders raise ScopeError.
    assert issubclass(ScopeOptionsError, ScopeError)
    assert issubclass(ScopeOptionsError, ValueError)


def test_replacing_the_scope_rereads_the_options_for_the_new_kind() -> None:
    # Arrange
    spec = TaskSpec(model_path="/m", scope="named", scope_options={"patterns": ("head",)})

    # Act
    full = replace(spec, scope="full", scope_options=None)
    lora = replace(spec, scope="lora", scope_options={})

    # Assert
    assert full.scope_options == NoOptions() and lora.scope_options == NoOptions()
    with pytest.raises(ScopeOptionsError, match="scope 'full' has no option 'patterns'"):
        replace(spec, scope="full")


def test_every_option_field_says_what_it_does() -> None:
    # Act
    helps = {cls.__name__: cls.help() for cls in (NamedOptions, ScalesOptions, TernaryOptions)}

    # Assert
    assert all(text for fields in helps.values() for text in fields.values())
    assert set(helps["TernaryOptions"]) == {"selection", "fraction", "epoch_rounds", "seed",
                                            "refresh_gamma", "train_head", "alternate",
                                            "head_lr", "head_perturbations", "head_steps",
                                            "act_bits"}


def test_ternary_selection_none_needs_the_head() -> None:
    with pytest.raises(ScopeOptionsError, match="needs train_head"):
        TernaryOptions(selection="none")

    assert TernaryOptions(selection="none", train_head=True).mask.train_head


@pytest.mark.parametrize(("options", "msg"), [
    ({"alternate": True}, "need train_head"),
    ({"alternate": True, "train_head": True, "selection": "none"}, "other than 'none'"),
    ({"head_lr": 1.0, "train_head": True}, "apply to alternate epochs only"),
    ({"alternate": True, "train_head": True, "head_lr": 0.0}, r"head_lr must be in \[1e-12"),
    ({"alternate": True, "train_head": True, "head_perturbations": 0}, "an integer in 1..65536"),
    ({"alternate": True, "train_head": True, "head_steps": True}, "head_steps must be"),
])
def test_bad_alternate_options_are_refused(options: dict[str, object], msg: str) -> None:
    with pytest.raises(ScopeOptionsError, match=msg):
        TernaryOptions(**options)  # type: ignore[arg-type]


def test_alternate_epochs_give_the_head_the_even_epochs_and_the_latents_the_odd() -> None:
    # Arrange
    mask = TernaryOptions(alternate=True, train_head=True).mask
    plain = TernaryOptions(train_head=True).mask

    # Act
    kinds = [(mask.trains_head(e), mask.trains_latents(e)) for e in range(4)]

    # Assert
    assert kinds == [(True, False), (False, True)] * 2
    assert all(plain.trains_head(e) and plain.trains_latents(e) for e in range(4))


def test_a_newer_spec_version_is_refused() -> None:
    # Arrange
    newer = {**json.loads(OLD_HEAD_TASK), "spec_version": SPEC_VERSION + 1}

    # Act / Assert
    with pytest.raises(ValueError, match="spec_version"):
        TaskSpec.from_dict(newer)


def test_options_for_keeps_typed_options_of_the_kind() -> None:
    # Arrange
    given = ScalesOptions(layers=("encoder.layer.5.",))

    # Act / Assert
    assert options_for("scales", given) is given
    assert options_for("scales", {"layers": ["encoder.layer.5."]}) == given
