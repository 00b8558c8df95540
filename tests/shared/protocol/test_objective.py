"""The objective definition (`seedfed.shared.protocol.objective`) and how a TaskSpec resolves,
stores and reloads it. Pure protocol: no torch (tests/shared/protocol/test_no_torch.py imports
the module with torch blocked)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from seedfed.shared.protocol.objective import (
    DEFAULT_TEMPLATE,
    DEFAULT_WORDS,
    MAX_TEMPLATE_LEN,
    Objective,
    default_kind,
)
from seedfed.shared.protocol.task import SPEC_VERSION, TaskSpec


# -- Objective -----------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["It was", "{text} and {text} It was", "{ text } It was"])
def test_a_template_needs_the_text_placeholder_exactly_once(template: str) -> None:
    with pytest.raises(ValueError, match=r"\{text\} exactly once"):
        Objective("label_words", template=template)


def test_a_template_longer_than_the_limit_is_refused() -> None:
    template = "{text}" + "x" * MAX_TEMPLATE_LEN

    with pytest.raises(ValueError, match="longer than"):
        Objective("label_words", template=template)


def test_label_words_must_differ() -> None:
    with pytest.raises(ValueError, match="must differ"):
        Objective("label_words", words=("good", "bad", "good"))


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_label_word_is_refused(blank: str) -> None:
    with pytest.raises(ValueError, match="must not be blank"):
        Objective("label_words", words=("good", blank))


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="head, label_words, next_token"):
        Objective("regression")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["head", "label_words", "next_token", None])
def test_every_kind_and_none_is_accepted(kind: Any) -> None:
    objective = Objective(kind)

    assert (objective.kind, objective.template, objective.words) == (kind, DEFAULT_TEMPLATE, ())


def test_words_given_as_a_list_are_stored_as_a_tuple() -> None:
    objective = Objective("label_words", words=["bad", "good"])  # type: ignore[arg-type]

    assert objective.words == ("bad", "good")


def test_the_prompt_puts_the_text_where_the_placeholder_is() -> None:
    objective = Objective("label_words", template="Review: {text} Verdict:")

    assert objective.prompt("a fine day") == "Review: a fine day Verdict:"


def test_the_label_words_are_the_objectives_own_else_the_default_pair() -> None:
    assert Objective("label_words").label_words == DEFAULT_WORDS == ("terrible", "great")
    assert Objective("label_words", words=("no", "yes")).label_words == ("no", "yes")


def test_help_describes_every_field() -> None:
    assert set(Objective.help()) == {"kind", "template", "words"}


# -- TaskSpec resolution -------------------------------------------------------------------------
@pytest.mark.parametrize("model_kind, kind", [("seq_cls", "head"), ("causal_lm", "next_token")])
def test_a_spec_without_an_objective_takes_its_model_kinds_default(model_kind: Any,
                                                                   kind: str) -> None:
    spec = TaskSpec(model_path="m", model_kind=model_kind)

    assert spec.objective == Objective(kind)  # type: ignore[arg-type]
    assert default_kind(model_kind) == kind


def test_label_words_on_two_labels_take_the_default_words() -> None:
    spec = TaskSpec(model_path="m", model_kind="causal_lm", objective=Objective("label_words"))

    assert spec.objective.kind == "label_words"
    assert spec.objective.words == ()
    assert spec.objective.label_words == DEFAULT_WORDS


def test_label_words_on_more_labels_need_as_many_words() -> None:
    objective = Objective("label_words", words=("bad", "okay", "good"))

    spec = TaskSpec(model_path="m", model_kind="causal_lm", num_labels=3, objective=objective)

    assert spec.objective.label_words == ("bad", "okay", "good")


def test_label_words_on_more_labels_without_words_are_refused() -> None:
    with pytest.raises(ValueError, match="3 labels needs 3 words"):
        TaskSpec(model_path="m", model_kind="causal_lm", num_labels=3,
                 objective=Objective("label_words"))


@pytest.mark.parametrize("num_labels, words", [(3, ("bad", "good")), (2, ("bad", "okay", "good"))])
def test_label_words_whose_count_differs_from_the_labels_are_refused(
        num_labels: int, words: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=f"{len(words)} label words for {num_labels} labels"):
        TaskSpec(model_path="m", model_kind="causal_lm", num_labels=num_labels,
                 objective=Objective("label_words", words=words))


def test_label_words_on_one_label_are_refused() -> None:
    with pytest.raises(ValueError, match="num_labels >= 2"):
        TaskSpec(model_path="m", model_kind="causal_lm", num_labels=1,
                 objective=Objective("label_words"))


def test_a_head_objective_on_a_causal_lm_is_refused() -> None:
    with pytest.raises(ValueError, match="no classification head"):
        TaskSpec(model_path="m", model_kind="causal_lm", objective=Objective("head"))


@pytest.mark.parametrize("kind", ["label_words", "next_token"])
def test_a_causal_lm_objective_on_a_classifier_is_refused(kind: Any) -> None:
    with pytest.raises(ValueError, match="needs a causal LM"):
        TaskSpec(model_path="m", model_kind="seq_cls", objective=Objective(kind))


def test_a_spec_takes_the_objectives_json_form() -> None:
    spec = TaskSpec(model_path="m", model_kind="causal_lm",
                    objective={"kind": "label_words", "words": ["bad", "good"]})  # type: ignore[arg-type]

    assert spec.objective == Objective("label_words", words=("bad", "good"))


# -- storing and reloading -----------------------------------------------------------------------
@pytest.mark.parametrize("model_kind, objective", [
    ("seq_cls", Objective()), ("seq_cls", Objective("head")),
    ("causal_lm", Objective()), ("causal_lm", Objective("next_token")),
])
def test_the_dict_omits_an_objective_at_the_model_kinds_default(model_kind: Any,
                                                               objective: Objective) -> None:
    spec = TaskSpec(model_path="m", model_kind=model_kind, objective=objective)

    d = spec.to_dict()

    assert "objective" not in d
    assert TaskSpec.from_dict(d) == spec


@pytest.mark.parametrize("objective", [
    Objective("label_words"),
    Objective("label_words", template="Review: {text} Verdict:", words=("bad", "good")),
    Objective("next_token", template="Note: {text}"),
])
def test_an_objective_off_the_default_is_stored_and_round_trips(objective: Objective) -> None:
    spec = TaskSpec(model_path="m", model_kind="causal_lm", objective=objective)

    d = json.loads(json.dumps(spec.to_dict()))

    assert d["objective"] == {"kind": objective.kind, "template": objective.template,
                              "words": list(objective.words)}
    assert TaskSpec.from_dict(d) == spec
    assert TaskSpec.from_dict(d, stored=True) == spec


def test_a_stored_objective_is_checked_again_on_load() -> None:
    d = TaskSpec(model_path="m", model_kind="causal_lm").to_dict()
    d["objective"] = {"kind": "head", "template": DEFAULT_TEMPLATE, "words": []}

    with pytest.raises(ValueError, match="no classification head"):
        TaskSpec.from_dict(d, stored=True)


@pytest.mark.parametrize("model_kind, kind", [("seq_cls", "head"), ("causal_lm", "next_token")])
def test_a_spec_dict_from_before_objectives_loads_with_the_default(model_kind: str,
                                                                   kind: str) -> None:
    # Arrange: the dict of a release without the field (spec version 3: no lr schedule either)
    d = {"model_path": "m", "model_kind": model_kind, "num_labels": 2, "scope": "full",
         "format": "fp32", "max_seq_len": 32, "hyper": {"lr": 1e-3}, "spec_version": 3}

    # Act
    spec = TaskSpec.from_dict(d)

    # Assert
    assert spec.objective == Objective(kind)  # type: ignore[arg-type]
    assert spec.spec_version == SPEC_VERSION
    assert "objective" not in spec.to_dict()
