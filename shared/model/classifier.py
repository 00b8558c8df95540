"""A sentence-transformers directory as a classifier: encoder -> masked mean pooling ->
(L2 normalization) -> linear head, with a per-sentence feature cache of the frozen bottom layers.

Sentence-transformers directories (a `modules.json` with a mean `Pooling` module, e.g. the
all-MiniLM-L6-v2 the package ships) become a `MeanPoolClassifier` (`hf.load_base`), the
function the encoder was trained for. BERT's `pooler` in such a checkpoint was never trained for
sentence meaning: a prototype head on it scores 59% zero-shot on SST-2 against 73-75% on
mean-pooled features (docs/accuracy.md). The cache's canonical context and keys are
`features.py`'s; the model-level helpers below (`prime_features`, `expect_texts`, ...) are
no-ops for any other model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from seedfed.shared.model.features import (
    FEATURE_CACHE_BYTES,
    FEATURE_GROUP,
    FeatureStore,
    distinct_rows,
    one_thread,
    sentence_key,
)
from seedfed.shared.model.scopes import Scope
from seedfed.shared.model.tokens import memo_for
from torch import nn


@dataclass(frozen=True)
class SequenceClassifierOutput:
    logits: torch.Tensor


class SentenceEmbedding(nn.Module):
    """A classifier's sentence embedding (`MeanPoolClassifier.embed`) as a module call of its
    own, holding nothing: the encoder stays its classifier's child (state dict, scopes and
    checksums unchanged). The probe engine shares module outputs, and pooling is not a
    module; with this call, a head scope's probes share the pooled embedding of the batch
    (each stacked copy repeats [batch, hidden] rows) instead of re-deriving it per copy from
    the cache, or pooling repeated token states where nothing is cached (a packed ternary
    device). A scope inside the encoder taints the embedding, which is then never shared."""

    def __init__(self, embed: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(input_ids, attention_mask, token_type_ids)


class MeanPoolClassifier(nn.Module):
    """encoder -> masked mean of token states -> optional L2 normalization -> Linear head.

    `frozen_prefix` = k > 0 (set by `build_model` only when no trainable tensor sits below
    encoder layer k) turns on a per-example feature cache: the states entering layer k (or,
    when k is the number of layers, the pooled embedding) are computed once per sentence and
    reused by every later forward (autograd, if on, starts at layer k). The 2P probes of a ZO
    step, and every later step over the same private examples, then pay only for the trainable
    top: a device fine-tuning its head re-encodes nothing. Whoever trains tensors below layer k
    must set `frozen_prefix = 0` (and `clear_cache()`) first. Right-padded batches assumed.

    A cached row is computed in the canonical context (`FEATURE_GROUP`), so its bits depend on
    the sentence alone, not on the batch that first needed it: a device's scalars do not
    depend on the order it met its sentences, and a `feature_store` (a simulation's, shared by
    its processes) can hand out rows another process computed without changing a bit.
    `expect` names sentences the caller will need (its own data), which fill a group instead
    of repeated rows.
    """

    def __init__(self, encoder: Any, num_labels: int, normalize: bool) -> None:
        super().__init__()
        self.encoder: Any = encoder  # a BERT-style encoder (embeddings, encoder.layer)
        self.config = encoder.config
        self.normalize = normalize
        self.classifier = nn.Linear(int(encoder.config.hidden_size), num_labels)
        self.sentence_embedding = SentenceEmbedding(self.embed)
        self.frozen_prefix = 0
        self.cache_limit_bytes = FEATURE_CACHE_BYTES
        self.feature_store: FeatureStore | None = None
        self._cache: dict[bytes, torch.Tensor] = {}
        self._cache_bytes = 0
        # expected sentences by token length: key -> (ids, token types or None)
        self._expected: dict[int, dict[bytes, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._namespace: tuple[int, str] | None = None
        #: rows this model has encoded (not read from its cache or feature store) so far
        self.rows_encoded = 0

    @property
    def num_layers(self) -> int:
        return len(self.encoder.encoder.layer)

    def clear_cache(self) -> None:
        self._cache.clear()
        self._cache_bytes = 0

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Sentence embeddings (pooled, normalized if the checkpoint normalizes)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.frozen_prefix >= self.num_layers:  # cached pooled rows: the distinct ones
            found, inverse = self._cached_rows(input_ids, attention_mask, token_type_ids)
            distinct = torch.stack(found)
            if self.normalize:  # a row's own bits, so before the gather (2P copies: 1/2P)
                distinct = nn.functional.normalize(distinct, dim=-1)
            return distinct[torch.as_tensor(inverse)]  # a copy, same bits
        if self.frozen_prefix > 0:
            pooled = self._cached_pool(input_ids, attention_mask, token_type_ids)
        else:
            kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            pooled = mean_pool(self.encoder(**kwargs).last_hidden_state, attention_mask)
        return nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, **_: Any) -> SequenceClassifierOutput:
        return SequenceClassifierOutput(logits=self.classifier(
            self.sentence_embedding(input_ids, attention_mask, token_type_ids)))

    def expect(self, rows: Iterable[tuple[Sequence[int] | np.ndarray,
                                          Sequence[int] | np.ndarray | None]]) -> None:
        """Sentences (token ids, token types or None; unpadded) the caller will need: a group
        of the canonical context is filled with those of its length not yet cached. Only
        speed depends on this, never a bit."""
        for ids, types in rows:
            a_ids = np.asarray(ids, dtype=np.int64)
            a_types = None if types is None else np.asarray(types, dtype=np.int64)
            key = sentence_key(a_ids, a_types)
            if key not in self._cache:
                self._expected.setdefault(len(a_ids), {})[key] = (
                    torch.from_numpy(a_ids), None if a_types is None else torch.from_numpy(a_types))

    @torch.no_grad()
    def warm(self) -> int:
        """Cache every expected sentence now (from the feature store when it holds them,
        else encoded in full canonical groups); returns how many were encoded. A process
        that serves many devices' data at once (a simulation's actor) pays for full groups
        instead of the short ones a batch's few new sentences of each length make."""
        todo = {key: s for group in self._expected.values() for key, s in group.items()
                if key not in self._cache}
        self._expected.clear()
        if not todo or self.frozen_prefix == 0:
            return 0
        before = self.rows_encoded
        self._fill(todo)
        return self.rows_encoded - before

    def feature_namespace(self) -> str:
        """Names the cached rows: the canonical context, the depth k and the weights below
        it (sha256). Rows of two models agree bit for bit when their namespaces do."""
        k = self.frozen_prefix
        if self._namespace is None or self._namespace[0] != k:
            h = hashlib.sha256(f"seedfed-features/1 group={FEATURE_GROUP} k={k} "
                               f"layers={self.num_layers}".encode())
            below = list(self.encoder.encoder.layer)[:k]
            modules = [("embeddings", self.encoder.embeddings)] + [
                (f"layer.{i}", layer) for i, layer in enumerate(below)]
            for prefix, module in modules:
                for name, t in sorted(module.state_dict().items()):
                    flat = t.detach().cpu().contiguous().reshape(-1)
                    h.update(f"{prefix}.{name} {t.dtype} {list(t.shape)}".encode())
                    h.update(flat.view(torch.uint8).numpy().tobytes())
            self._namespace = (k, h.hexdigest())
        return self._namespace[1]

    def cache_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    token_type_ids: torch.Tensor | None = None) -> None:
        """Make sure the batch's sentences are cached (from the feature store, else encoded).
        A trainer calls this before a step (`prime_features`), so the probes never see a
        forward that also encodes: the batched probe engine sizes its stacked copies from
        what its first forward ran, so a cold cache would change a step's scalars."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self._cached_rows(input_ids, attention_mask, token_type_ids)

    def _fill(self, sentences: Mapping[bytes, tuple[torch.Tensor, torch.Tensor | None]],
              ) -> dict[bytes, torch.Tensor]:
        """Cache the rows of uncached `sentences`: from the feature store, else encoded in
        the canonical context (and given to the store). Returns the rows added."""
        fresh: dict[bytes, torch.Tensor] = {}
        if sentences:
            if self.feature_store is not None:
                fresh.update(self.feature_store.get(self.feature_namespace(), list(sentences)))
            todo = {key: s for key, s in sentences.items() if key not in fresh}
            encoded = self._encode_canonical(todo, fresh) if todo else {}
            self.rows_encoded += len(encoded)
            if encoded and self.feature_store is not None:
                self.feature_store.put(self.feature_namespace(), encoded)
            fresh.update(encoded)
            self._remember(fresh)
        return fresh

    def _cached_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     token_type_ids: torch.Tensor | None,
                     ) -> tuple[list[torch.Tensor], list[int]]:
        """(the cached row of each distinct sentence of the batch, each row's position in
        that list), filling the cache first (from the store, else encoded)."""
        lengths = attention_mask.sum(dim=1).tolist()
        # The batched probe engine stacks copies of one batch (2P of them): key each distinct
        # row once (a key costs ~80 us, 2P x 16 of them were most of a head step).
        first, inverse = distinct_rows(input_ids, attention_mask, token_type_ids)
        a_ids = input_ids.to(torch.int64).numpy()
        a_types = None if token_type_ids is None else token_type_ids.to(torch.int64).numpy()
        distinct, sentences = [], {}
        for i in first:
            n = lengths[i]
            key = sentence_key(a_ids[i, :n], None if a_types is None else a_types[i, :n])
            distinct.append(key)
            if key not in self._cache:
                sentences[key] = (input_ids[i, :n],
                                  None if token_type_ids is None else token_type_ids[i, :n])
        fresh = self._fill(sentences)
        return [fresh[key] if key in fresh else self._cache[key] for key in distinct], inverse

    def _cached_pool(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """Mean-pooled states of a batch whose first k layers come from the cache (k below
        the encoder's depth: the layers above run on the cached states)."""
        k = self.frozen_prefix
        found, inverse = self._cached_rows(input_ids, attention_mask, token_type_ids)
        lengths = attention_mask.sum(dim=1).tolist()
        rows = [found[j] for j in inverse]
        n_max = max(lengths)
        hidden = rows[0].new_zeros((len(rows), n_max, rows[0].shape[-1]))
        for i, row in enumerate(rows):
            hidden[i, :row.shape[0]] = row
        mask = (torch.arange(n_max)[None, :] < torch.tensor(lengths)[:, None]).to(
            attention_mask.dtype)
        with _skip_prefix(self.encoder, k, hidden):
            states = self.encoder(input_ids=input_ids[:, :n_max], attention_mask=mask,
                                  ).last_hidden_state
        return mean_pool(states, mask)

    @torch.no_grad()
    def _encode_canonical(self, todo: Mapping[bytes, tuple[torch.Tensor, torch.Tensor | None]],
                          found: dict[bytes, torch.Tensor]) -> dict[bytes, torch.Tensor]:
        """The cached rows of `todo` (and of expected sentences that fill their groups), each
        computed in the canonical context: FEATURE_GROUP sentences of one length, one thread.
        Fillers the feature store already holds go to `found` instead of being encoded."""
        k = self.frozen_prefix
        by_length: dict[int, dict[bytes, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        for key, s in todo.items():
            by_length.setdefault(len(s[0]), {})[key] = s
        out: dict[bytes, torch.Tensor] = {}
        for n, group in by_length.items():
            spare = self._expected.get(n, {})
            for key in list(group):
                spare.pop(key, None)
            while len(group) % FEATURE_GROUP and spare:  # fill with the caller's own sentences
                want: dict[bytes, tuple[torch.Tensor, torch.Tensor | None]] = {}
                while spare and len(want) < FEATURE_GROUP - len(group) % FEATURE_GROUP:
                    key, s = spare.popitem()
                    if key not in self._cache and key not in found:
                        want[key] = s
                if want and self.feature_store is not None:
                    found.update(self.feature_store.get(self.feature_namespace(), list(want)))
                group.update({key: s for key, s in want.items() if key not in found})
            items = list(group.items())
            for start in range(0, len(items), FEATURE_GROUP):
                chunk = items[start:start + FEATURE_GROUP]
                # a short last group repeats its first sentence: the shape stays canonical
                padded = chunk + [chunk[0]] * (FEATURE_GROUP - len(chunk))
                ids = torch.stack([s[0] for _, s in padded])
                kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                if any(s[1] is not None for _, s in padded):
                    kwargs["token_type_ids"] = torch.stack(
                        [torch.zeros_like(s[0]) if s[1] is None else s[1] for _, s in padded])
                # Only layers below k run: the states entering layer k are the output of
                # layer k - 1 (a BERT encoder has no final norm).
                with one_thread(), _only_prefix(self.encoder, k):
                    states = self.encoder(**kwargs).last_hidden_state
                if k >= self.num_layers:
                    states = mean_pool(states, kwargs["attention_mask"])
                for j, (key, _) in enumerate(chunk):
                    out[key] = states[j].clone()
        return out

    def _remember(self, fresh: dict[bytes, torch.Tensor]) -> None:
        for key, row in fresh.items():
            if key in self._cache:
                continue
            self._cache[key] = row
            self._cache_bytes += row.numel() * row.element_size()
        while self._cache_bytes > self.cache_limit_bytes and self._cache:
            oldest = next(iter(self._cache))  # FIFO: dicts keep insertion order
            self._cache_bytes -= self._cache[oldest].numel() * self._cache[oldest].element_size()
            del self._cache[oldest]


def mean_pool(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.unsqueeze(-1).to(states.dtype)
    return (states * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


class _Constant(nn.Module):
    """Stands in for the embeddings while the frozen prefix is skipped."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value

    def forward(self, *_: Any, **__: Any) -> torch.Tensor:
        return self.value


@contextmanager
def _only_prefix(encoder: Any, k: int) -> Iterator[None]:
    """Run only layers 0..k-1 of a BERT-style encoder."""
    layers = encoder.encoder.layer
    encoder.encoder.layer = nn.ModuleList(list(layers)[:k])
    try:
        yield
    finally:
        encoder.encoder.layer = layers


@contextmanager
def _skip_prefix(encoder: Any, k: int, hidden: torch.Tensor) -> Iterator[None]:
    """Run only layers k.. of a BERT-style encoder, starting from cached `hidden` states."""
    embeddings, layers = encoder.embeddings, encoder.encoder.layer
    encoder.embeddings = _Constant(hidden)
    encoder.encoder.layer = nn.ModuleList(list(layers)[k:])
    try:
        yield
    finally:
        encoder.embeddings = embeddings
        encoder.encoder.layer = layers


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layer" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def pooled_classifier(model: nn.Module) -> MeanPoolClassifier | None:
    """The MeanPoolClassifier inside `model` (under peft's wrappers), or None."""
    inner: Any = getattr(model, "base_model", model)
    inner = getattr(inner, "model", inner)
    return inner if isinstance(inner, MeanPoolClassifier) else None


def share_features(model: nn.Module, store: FeatureStore | None) -> None:
    """Let the model's feature cache read and write `store` (None: its own cache only)."""
    inner = pooled_classifier(model)
    if inner is not None:
        inner.feature_store = store


def prime_features(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
    """`MeanPoolClassifier.cache_batch` for a tokenized batch (a no-op for a model without
    a feature cache): call it before a ZO step's probes."""
    inner = pooled_classifier(model)
    if inner is not None and inner.frozen_prefix > 0:
        inner.cache_batch(batch["input_ids"], batch.get("attention_mask"),
                          batch.get("token_type_ids"))


def expect_texts(model: nn.Module, tokenizer: Any, texts: Sequence[str], max_len: int, *,
                 now: bool = False) -> None:
    """`MeanPoolClassifier.expect` for texts, tokenized as `client.data.tokenize` does, and
    with `now` its `warm` (a no-op for a model without a feature cache)."""
    inner = pooled_classifier(model)
    if inner is None or inner.frozen_prefix == 0 or tokenizer is None or not len(texts):
        return
    memo = memo_for(tokenizer, max_len)
    if memo is None:
        enc = tokenizer(list(texts), truncation=True, max_length=max_len)
        types = enc.get("token_type_ids")
        inner.expect((ids, None if types is None else types[i])
                     for i, ids in enumerate(enc["input_ids"]))
    else:  # tokenized once, and the device's later batches pad from the same memo
        inner.expect((r["input_ids"], r.get("token_type_ids")) for r in memo.unpadded(texts))
    if now:
        inner.warm()


def frozen_prefix_depth(model: nn.Module, scope: Scope) -> int:
    """How many bottom encoder layers (and the embeddings) no scoped tensor touches."""
    inner: Any = getattr(model, "base_model", model)
    inner = getattr(inner, "model", inner)
    if not isinstance(inner, MeanPoolClassifier):
        return 0
    n_layers = len(inner.encoder.encoder.layer)
    depth = n_layers
    for name in scope.names:
        if ".classifier." in f".{name}" or name.startswith("classifier"):
            continue
        idx = _layer_index(name)
        if idx is None:
            return 0  # embeddings or another tensor below every layer
        depth = min(depth, idx)
    return depth
