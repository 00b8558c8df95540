"""The mean-pooled classifier's feature cache: the frozen prefix, cached rows with the uncached
bits whatever batch first encoded them, the byte limit, the shared store and the row keys."""

from __future__ import annotations

import pytest
import torch
from seedfed.client.data import tokenize
from seedfed.shared.model.classifier import (
    MeanPoolClassifier,
    expect_texts,
    frozen_prefix_depth,
    share_features,
)
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.model.features import distinct_rows, distinct_rows_exact
from seedfed.shared.model.replay import apply_seeds

from tests.shared.model.minilm import TEXTS, head_spec


@pytest.fixture(scope="module")
def head_bundle() -> ModelBundle:
    return build_model(head_spec(), initialize=True)


@pytest.mark.parametrize("patterns, depth", [(("classifier",), 6),
                                             (("classifier", "layer.5."), 5),
                                             (("layer.3.attention",), 3),
                                             (("embeddings.LayerNorm",), 0)])
def test_frozen_prefix_covers_only_layers_below_every_scoped_tensor(patterns, depth) -> None:  # noqa: ANN001
    bundle = build_model(head_spec(*patterns), initialize=False)

    assert frozen_prefix_depth(bundle.model, bundle.scope) == depth
    assert bundle.model.frozen_prefix == depth


@pytest.mark.parametrize("patterns", [("classifier",), ("classifier", "layer.5.")])
def test_feature_cache_gives_the_uncached_logits(patterns) -> None:  # noqa: ANN001
    bundle = build_model(head_spec(*patterns), initialize=True)
    model = bundle.model
    full = tokenize(bundle.tokenizer, TEXTS, None, 64)
    part = tokenize(bundle.tokenizer, TEXTS[1:], None, 64)
    depth = model.frozen_prefix
    with torch.no_grad():
        model.frozen_prefix = 0
        ref = model(**full).logits
        model.frozen_prefix = depth
        first, again, subset = model(**full).logits, model(**full).logits, model(**part).logits

    assert torch.allclose(first, ref, atol=1e-5)
    assert torch.equal(first, again)
    assert torch.allclose(subset, ref[1:], atol=1e-5)


def test_cached_top_layer_still_sees_scope_updates() -> None:
    bundle = build_model(head_spec("classifier", "layer.5.output.dense"), initialize=True)
    batch = tokenize(bundle.tokenizer, TEXTS, None, 64)
    with torch.no_grad():
        before = bundle.model(**batch).logits
        apply_seeds(bundle.scope, [7], [0.05])
        after = bundle.model(**batch).logits
        bundle.model.frozen_prefix = 0
        uncached = bundle.model(**batch).logits

    assert not torch.allclose(before, after)
    assert torch.allclose(after, uncached, atol=1e-5)


def test_feature_cache_respects_its_byte_limit(head_bundle) -> None:  # noqa: ANN001
    model = head_bundle.model
    model.clear_cache()
    model.cache_limit_bytes = 2 * 384 * 4
    try:
        with torch.no_grad():
            model(**tokenize(head_bundle.tokenizer, TEXTS, None, 64))
        assert len(model._cache) == 2
    finally:
        model.cache_limit_bytes = 512 * 1024 * 1024
        model.clear_cache()


def test_gradients_reach_the_head_through_cached_features(head_bundle) -> None:  # noqa: ANN001
    model = head_bundle.model
    batch = tokenize(head_bundle.tokenizer, TEXTS[:2], None, 64)
    with torch.no_grad():
        model(**batch)  # fills the cache
    weight = model.classifier.weight
    weight.requires_grad_(True)
    try:
        loss = model(**batch).logits.sum()
        loss.backward()
        assert weight.grad is not None and weight.grad.abs().sum() > 0
    finally:
        weight.requires_grad_(False)
        weight.grad = None


ORDER_TEXTS = TEXTS + ["the movie is a disaster", "a masterpiece", "dull , lifeless and long",
                       "an odd little film that works", "not worth the price of a ticket"]


def _cached_row(model: MeanPoolClassifier, batch: dict, i: int) -> torch.Tensor:
    n = int(batch["attention_mask"][i].sum())
    key = b"".join(batch[name][i, :n].to(torch.int64).numpy().tobytes()
                   for name in ("input_ids", "token_type_ids") if name in batch)
    return model._cache[key]


@pytest.mark.parametrize("patterns", [("classifier",), ("classifier", "layer.5.")])
def test_cached_features_do_not_depend_on_the_batch_that_first_encoded_them(patterns) -> None:  # noqa: ANN001
    # Arrange: two devices with the same model meet the same sentence in different batches
    # (other companions, other order, other padding), a third alone.
    first = build_model(head_spec(*patterns), initialize=True)
    second = build_model(head_spec(*patterns), initialize=True)
    target = ORDER_TEXTS[0]
    batch_a = tokenize(first.tokenizer, ORDER_TEXTS, None, 64)
    batch_b = tokenize(second.tokenizer, [ORDER_TEXTS[5], target], None, 64)
    alone = tokenize(second.tokenizer, [target], None, 64)

    # Act
    with torch.no_grad():
        first.model.embed(**batch_a)
        second.model.embed(**batch_b)
        b = _cached_row(second.model, batch_b, 1)
        second.model.clear_cache()
        second.model.embed(**alone)
        c = _cached_row(second.model, alone, 0)
    a = _cached_row(first.model, batch_a, 0)

    # Assert: the cached rows (pooled features, or the states entering layer 5) bit for bit
    assert torch.equal(a, b) and torch.equal(a, c)


def test_expected_sentences_fill_the_group_without_changing_a_bit(head_bundle) -> None:  # noqa: ANN001
    model, tok = head_bundle.model, head_bundle.tokenizer
    model.clear_cache()
    batch = tokenize(tok, TEXTS[:1], None, 64)
    with torch.no_grad():
        plain = model.embed(**batch)
        model.clear_cache()
        expect_texts(model, tok, ORDER_TEXTS, 64)
        filled = model.embed(**batch)
    cached = len(model._cache)
    model.clear_cache()

    assert torch.equal(plain, filled)
    assert cached > 1  # same-length expected sentences were encoded alongside


class _DictStore:
    """A FeatureStore in memory (what seedfed/features.py keeps in files)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, bytes], torch.Tensor] = {}
        self.gets = 0

    def get(self, namespace: str, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
        self.gets += 1
        return {k: self.rows[(namespace, k)] for k in keys if (namespace, k) in self.rows}

    def put(self, namespace: str, rows: dict[bytes, torch.Tensor]) -> None:
        self.rows.update({(namespace, k): v for k, v in rows.items()})


def _no_encoding(*_: object) -> None:
    raise AssertionError("encoded a sentence the feature store holds")


def test_a_shared_feature_store_gives_a_second_model_the_same_bits_without_encoding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = _DictStore()
    writer = build_model(head_spec(), initialize=True)
    reader = build_model(head_spec(), initialize=True)
    share_features(writer.model, store)
    share_features(reader.model, store)
    batch = tokenize(writer.tokenizer, ORDER_TEXTS, None, 64)
    with torch.no_grad():
        want = writer.model(**batch).logits
        monkeypatch.setattr(reader.model, "_encode_canonical", _no_encoding)
        got = reader.model(**batch).logits

    assert torch.equal(want, got)
    assert writer.model.feature_namespace() == reader.model.feature_namespace()
    assert len(store.rows) >= len(ORDER_TEXTS)


def test_the_feature_namespace_names_the_frozen_weights() -> None:
    head = build_model(head_spec(), initialize=True).model
    body = build_model(head_spec("classifier", "layer.5."), initialize=True).model
    other = build_model(head_spec(), initialize=True).model
    with torch.no_grad():
        other.encoder.embeddings.word_embeddings.weight[0, 0] += 1.0

    names = {head.feature_namespace(), body.feature_namespace(), other.feature_namespace()}
    assert len(names) == 3


@pytest.mark.parametrize("patterns", [("classifier",), ("classifier", "layer.5.")])
def test_stacked_copies_of_a_batch_get_each_rows_own_bits(patterns) -> None:  # noqa: ANN001
    # Arrange: the batched probe engine stacks copies of one batch; the cache keys each
    # distinct row once, which must not change what any row gets
    bundle = build_model(head_spec(*patterns), initialize=True)
    batch = tokenize(bundle.tokenizer, TEXTS, None, 64)
    stacked = {k: torch.cat([v, v.flip(0), v]) for k, v in batch.items()}

    # Act
    with torch.no_grad():
        alone = bundle.model(**batch).logits
        together = bundle.model(**stacked).logits

    # Assert: each row gets its own sentence's result; gathered pooled rows (head) are the
    # same bits, while layers run above the cache see a larger batch, whose matmul blocking
    # may move the last bits on more than one thread
    expected = torch.cat([alone, alone.flip(0), alone])
    if bundle.model.frozen_prefix >= bundle.model.num_layers:
        assert torch.equal(together, expected)
    else:
        assert torch.allclose(together, expected, atol=1e-5)


def test_distinct_rows_match_the_exact_loop_on_stacked_copies() -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 3), (16, 2), (16, 1000), (33, 5)]:
        base = torch.randint(0, vocab, (rows, 6), generator=gen)
        ids = base.repeat(8, 1)
        mask = torch.ones_like(ids)
        flat = torch.cat([ids, mask], dim=1).numpy()

        assert distinct_rows(ids, mask, None) == distinct_rows_exact(flat)
