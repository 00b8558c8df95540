"""Recipes on a causal LM: the model kind read from the directory, the LM counterpart of a
classifier recipe, and a ternary LM's TerMeZO scope (no torch: config.json files only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from seedfed.shared.protocol.recipes import (
    LM_TERNARY_LR,
    lm_counterpart,
    model_kind_of,
    parse_set,
    resolve_recipe,
)


def _model(path: Path, architectures: list[str], sentence_transformers: bool = False) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": architectures}))
    if sentence_transformers:
        (path / "modules.json").write_text("[]")
    return str(path)


@pytest.mark.parametrize(("architectures", "kind"), [
    (["LlamaForCausalLM"], "causal_lm"), (["GPT2LMHeadModel"], "causal_lm"),
    (["OPTForCausalLM"], "causal_lm"), (["BertForSequenceClassification"], "seq_cls"),
    ([], None)])
def test_the_model_kind_comes_from_the_config(tmp_path: Path, architectures: list[str],
                                              kind: str | None) -> None:
    assert model_kind_of(_model(tmp_path / "m", architectures)) == kind


def test_a_sentence_transformers_directory_is_a_classifier(tmp_path: Path) -> None:
    assert model_kind_of(_model(tmp_path / "m", ["BertModel"], True)) == "seq_cls"


def test_a_classifier_recipe_on_a_causal_lm_trains_label_words(tmp_path: Path) -> None:
    # Arrange
    llama = _model(tmp_path / "llama", ["LlamaForCausalLM"])
    # Act
    resolved = resolve_recipe("sst2", model=llama)
    # Assert
    assert lm_counterpart("sst2", llama) == "lm-labels" == resolved.recipe
    assert resolved.spec.model_kind == "causal_lm"
    assert resolved.spec.objective.kind == "label_words"
    assert resolved.spec.objective.label_words == ("terrible", "great")


def test_an_lm_recipe_published_ternary_trains_its_latents(tmp_path: Path) -> None:
    # Arrange
    llama = _model(tmp_path / "llama", ["LlamaForCausalLM"])
    # Act
    spec = resolve_recipe("lm-keyboard", {"spec.format": "ternary"}, model=llama).spec
    # Assert
    assert (spec.scope, spec.format, spec.hyper.lr) == ("ternary", "ternary", LM_TERNARY_LR)
    assert spec.objective.kind == "next_token"


def test_the_objective_is_set_from_the_command_line(tmp_path: Path) -> None:
    # Arrange
    llama = _model(tmp_path / "llama", ["LlamaForCausalLM"])
    given = parse_set(["objective.template={text} Overall:", "words=bad,good"], "lora")
    # Act
    spec = resolve_recipe("lm-labels", given, model=llama).spec
    # Assert
    assert spec.objective.template == "{text} Overall:"
    assert spec.objective.words == ("bad", "good")


def test_a_scope_and_a_format_are_applied_together() -> None:
    spec = resolve_recipe("sst2", {"spec.format": "int4"}, scope="scales").spec
    assert (spec.scope, spec.format) == ("scales", "int4")


def test_an_lm_recipe_on_a_sentence_encoder_is_refused(tmp_path: Path) -> None:
    encoder = _model(tmp_path / "minilm", ["BertModel"], sentence_transformers=True)
    with pytest.raises(ValueError, match="trains a causal LM.*give --model a causal LM"):
        resolve_recipe("lm-keyboard", model=encoder)
