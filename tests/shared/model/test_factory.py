"""The model factory: MiniLM becomes a mean-pooled classifier with a prototype head, version 0
is deterministic, and canonical names are identical on both sides."""

from __future__ import annotations

import pytest
import torch
from seedfed.client.data import tokenize
from seedfed.shared.model.classifier import (
    MeanPoolClassifier,
)
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.model.replay import checksum

from tests.shared.model.minilm import head_spec, spec


@pytest.fixture(scope="module")
def head_bundle() -> ModelBundle:
    return build_model(head_spec(), initialize=True)


def test_minilm_builds_a_mean_pool_classifier_with_a_prototype_head(head_bundle) -> None:  # noqa: ANN001
    model = head_bundle.model

    assert isinstance(model, MeanPoolClassifier)
    assert head_bundle.scope.names == ["classifier.bias", "classifier.weight"]
    norms = model.classifier.weight.norm(dim=1)
    assert torch.allclose(norms, torch.full_like(norms, 20.0), atol=1e-3)


def test_zero_shot_head_reads_sentiment(head_bundle) -> None:  # noqa: ANN001
    texts = ["a wonderful , moving film", "a dull , lifeless mess", "I loved every minute",
             "boring and badly acted"]
    batch = tokenize(head_bundle.tokenizer, texts, None, 64)

    with torch.no_grad():
        pred = head_bundle.model(**batch).logits.argmax(-1)

    assert pred.tolist() == [1, 0, 1, 0]


def test_version_zero_is_deterministic_and_names_match_the_device_side() -> None:
    a = build_model(spec(scope="lora"), initialize=True)
    b = build_model(spec(scope="lora"), initialize=True)
    device = build_model(spec(scope="lora"), initialize=False)

    assert checksum(a.scope) == checksum(b.scope)
    assert a.scope.names == device.scope.names
    device.scope.write(a.scope.read())
    assert checksum(device.scope) == checksum(a.scope)


def test_label_alternatives_average_into_one_prototype() -> None:
    single = build_model(head_spec(), initialize=True)
    multi = build_model(spec(scope="named", scope_options={"patterns": ("classifier",)},
                              label_texts=("It was terrible.|It was awful.",
                                           "It was great.|It was wonderful.")),
                        initialize=True)

    w1, w2 = single.model.classifier.weight, multi.model.classifier.weight
    assert not torch.allclose(w1, w2)
    assert torch.nn.functional.cosine_similarity(w1, w2).min() > 0.5
