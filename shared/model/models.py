"""From a task definition to a model, its tokenizer and its trainable scope.

Both sides call `build_model`: the coordinator with `initialize=True` to create version 0 of the
trainable state (heads and adapters set from an explicit generator, never the global RNG), a
device with `initialize=False` and then loads the coordinator's snapshot, so the two agree bit
for bit without sharing an initialization routine across library versions.

Sentence-transformers directories (a `modules.json` with a mean `Pooling` module, e.g. the
all-MiniLM-L6-v2 the package ships) become a `MeanPoolClassifier`: encoder -> masked mean
pooling -> (L2 normalization) -> linear head, the function the encoder was trained for. BERT's
`pooler` in such a checkpoint was never trained for sentence meaning: a prototype head on it
scores 59% zero-shot on SST-2 against 73-75% on mean-pooled features (docs/accuracy.md). Any
other directory loads with `AutoModelForSequenceClassification` / `AutoModelForCausalLM`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from seedfed.shared.model.scopes import Scope, build_scope
from seedfed.shared.model.tokens import memo_for
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.task import LoraOptions, TaskSpec
from torch import nn

#: Seed of the generator that initializes version 0 (adapters, heads without label texts).
INIT_SEED = 0x5EEDFED
#: Logit scale of a prototype head on L2-normalized features (a cosine-similarity temperature).
PROTOTYPE_SCALE = 20.0
#: Upper bound of a MeanPoolClassifier's per-example feature cache (FIFO eviction beyond it).
FEATURE_CACHE_BYTES = 512 * 1024 * 1024
#: The canonical context of a cached feature: a sentence is encoded in a group of exactly this
#: many sentences of its own token length (no padding), on one thread. With the shape fixed by
#: the length alone, a row's bits do not depend on its companions or its slot (measured: the
#: matmul kernels pick their blocking by shape; tests/shared/model/test_models.py checks it), while
#: a padded batch, a batch of another size or another thread count each move the last bits.
#: 8 costs ~5.6 ms a sentence on one core, a sentence alone ~27 ms (docs/performance.md).
FEATURE_GROUP = 8
#: Separates alternative descriptions of one label in `TaskSpec.label_texts` ("bad|awful"):
#: the label's prototype is the mean of their embeddings.
ALTERNATIVES = "|"


class FeatureStore(Protocol):
    """Cached features shared beyond one process (a simulation's run directory: one encoding
    per run, seedfed/features.py). Rows are what `MeanPoolClassifier` caches, by sentence key;
    `namespace` (`MeanPoolClassifier.feature_namespace`) names the model and the context."""

    def get(self, namespace: str, keys: Sequence[bytes]) -> dict[bytes, torch.Tensor]: ...

    def put(self, namespace: str, rows: Mapping[bytes, torch.Tensor]) -> None: ...


@dataclass
class ModelBundle:
    model: nn.Module
    tokenizer: Any
    scope: Scope
    spec: TaskSpec


@dataclass(frozen=True)
class SequenceClassifierOutput:
    logits: torch.Tensor


@dataclass(frozen=True)
class PoolingConfig:
    """How a sentence-transformers directory turns token states into a sentence embedding."""

    mean: bool = True
    normalize: bool = False


def sentence_pooling(path: Path) -> PoolingConfig | None:
    """The pooling of a sentence-transformers directory, or None for a plain HF directory."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{modules_file} is not valid JSON: {e}") from e
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = types.get("Pooling")
    if pooling is None:
        return None
    conf_file = path / pooling.get("path", "1_Pooling") / "config.json"
    conf = json.loads(conf_file.read_text(encoding="utf-8")) if conf_file.is_file() else {}
    if not conf.get("pooling_mode_mean_tokens", True):
        return None  # CLS/max pooling: the plain classification head is the closer match
    return PoolingConfig(mean=True, normalize="Normalize" in types)


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
            pooled = _mean_pool(self.encoder(**kwargs).last_hidden_state, attention_mask)
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
            key = _sentence_key(a_ids, a_types)
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
        first, inverse = _distinct_rows(input_ids, attention_mask, token_type_ids)
        a_ids = input_ids.to(torch.int64).numpy()
        a_types = None if token_type_ids is None else token_type_ids.to(torch.int64).numpy()
        distinct, sentences = [], {}
        for i in first:
            n = lengths[i]
            key = _sentence_key(a_ids[i, :n], None if a_types is None else a_types[i, :n])
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
        return _mean_pool(states, mask)

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
                with _one_thread(), _only_prefix(self.encoder, k):
                    states = self.encoder(**kwargs).last_hidden_state
                if k >= self.num_layers:
                    states = _mean_pool(states, kwargs["attention_mask"])
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


def _distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   token_type_ids: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(index of the first row of each distinct padded row, in first-seen order; for every
    row, its distinct row's position in that list).

    The batched probe engine stacks 2P copies of a batch (16,384 rows for the SST-2
    recipe), which a Python loop over the rows took ~15 ms to key: rows are grouped by a
    64-bit hash in numpy instead, and the grouping is checked row by row against each
    group's first row (a collision, however unlikely, falls back to the exact loop)."""
    parts = [input_ids, attention_mask] + ([] if token_type_ids is None else [token_type_ids])
    flat = torch.cat([p.to(torch.int64) for p in parts], dim=1).contiguous().numpy()
    if flat.shape[0] == 0:
        return [], []
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps: that is the hash
        mult = np.arange(1, 2 * flat.shape[1], 2, dtype=np.uint64) * np.uint64(_HASH_MULT)
        h = (flat.view(np.uint64) * mult).sum(axis=1, dtype=np.uint64)
    _, first_at, inverse = np.unique(h, return_index=True, return_inverse=True)
    order = np.argsort(first_at, kind="stable")  # unique's order (by hash) -> first seen
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    first, inverse = first_at[order], position[inverse.reshape(-1)]
    if not np.array_equal(flat, flat[first[inverse]]):
        return _distinct_rows_exact(flat)
    return first.tolist(), inverse.tolist()


#: An odd 64-bit constant (the golden ratio's): scrambles the rows' hash lanes.
_HASH_MULT = 0x9E3779B97F4A7C15


def _distinct_rows_exact(flat: np.ndarray) -> tuple[list[int], list[int]]:
    raw = flat.tobytes()
    width = len(raw) // flat.shape[0]
    seen: dict[bytes, int] = {}
    first: list[int] = []
    inverse: list[int] = []
    for i in range(flat.shape[0]):
        j = seen.setdefault(raw[i * width:(i + 1) * width], len(first))
        if j == len(first):
            first.append(i)
        inverse.append(j)
    return first, inverse


def _sentence_key(ids: np.ndarray, types: np.ndarray | None) -> bytes:
    """A sentence's cache key: its token ids (and token types), unpadded, as int64 bytes."""
    return ids.astype(np.int64, copy=False).tobytes() + (
        b"" if types is None else types.astype(np.int64, copy=False).tobytes())


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread: the thread count moves a matmul's last bits."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


def _mean_pool(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
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


#: transformers' `from_pretrained` swaps `PreTrainedModel.tie_weights` for a no-op while it loads
#: and puts it back after; two loads in threads (devices of one process) can interleave so the
#: no-op stays, and every model built after that comes out with untied embeddings. One load at a
#: time keeps the class intact.
_LOADING = threading.Lock()


def load_base(spec: TaskSpec) -> tuple[nn.Module, Any]:
    """Load the frozen base model and tokenizer from a local Hugging Face directory."""
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    path = Path(spec.model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    tokenizer = load_tokenizer(path)
    pooling = sentence_pooling(path) if spec.model_kind == "seq_cls" else None
    model: nn.Module
    with _LOADING, _quiet_loading():
        if pooling is not None:
            encoder = AutoModel.from_pretrained(path, dtype=torch.float32,
                                                add_pooling_layer=False)
            model = MeanPoolClassifier(encoder, spec.num_labels, pooling.normalize)
        elif spec.model_kind == "seq_cls":
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=spec.num_labels, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    set_pad_token_id(model, tokenizer)
    return model.eval(), tokenizer


def load_tokenizer(path: Path) -> Any:
    """The directory's tokenizer (None if it has none), with a pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def set_pad_token_id(model: nn.Module, tokenizer: Any) -> None:
    """Give the model's config the tokenizer's pad id when it names none."""
    config = getattr(model, "config", None)
    if tokenizer is not None and config is not None and getattr(config, "pad_token_id",
                                                                None) is None:
        config.pad_token_id = tokenizer.pad_token_id


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """Silence transformers' load report (the sentence-transformers checkpoint carries an unused
    BERT pooler that would be reported as unexpected on every device start)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                             "vocab.txt", "tokenizer.model"))


def apply_lora(model: nn.Module, options: LoraOptions, model_kind: str) -> nn.Module:
    """Wrap the model with peft LoRA adapters (dropout 0: both probes must see one function)."""
    from peft import LoraConfig, TaskType, get_peft_model

    names = [n for n, _ in model.named_modules()]
    # peft's rule: a target names a module exactly or ends its dotted path.
    unmatched = [t for t in options.target_modules
                 if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unmatched:
        raise ScopeError(f"LoRA target_modules {unmatched} match no module of "
                         f"{type(model).__name__} (e.g. {names[-1]!r}); name modules by their "
                         "last path components, e.g. 'query' or 'layer.5.attention.self.query'")
    config = LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=0.0,
                        target_modules=list(options.target_modules))
    if isinstance(model, MeanPoolClassifier):
        # A custom module: no peft task type; the head trains as a modules_to_save copy.
        config.modules_to_save = ["classifier"] if options.train_head else []
    else:
        config.task_type = TaskType.SEQ_CLS if model_kind == "seq_cls" else TaskType.CAUSAL_LM
        if model_kind == "seq_cls" and not options.train_head:
            config.modules_to_save = []
    peft_model = get_peft_model(model, config)
    return peft_model.eval()


def classifier_module(model: nn.Module) -> nn.Linear:
    """The final Linear layer producing class logits (BERT's `classifier`, Llama's `score`)."""
    for name in ("classifier", "score"):
        for mod_name, mod in model.named_modules():
            if mod_name.endswith(name) and isinstance(mod, nn.Linear) and "original_module" \
                    not in mod_name:
                return mod
    raise ScopeError(f"{type(model).__name__} has no classifier/score Linear head")


@torch.no_grad()
def label_features(model: nn.Module, tokenizer: Any, label_texts: tuple[str, ...],
                   ) -> torch.Tensor:
    """The feature the head sees for each label description (alternatives averaged)."""
    groups = [[t.strip() for t in text.split(ALTERNATIVES) if t.strip()] or [text]
              for text in label_texts]
    flat = [t for g in groups for t in g]
    enc = tokenizer(flat, padding=True, return_tensors="pt")
    enc = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask",
                                                 "token_type_ids")}
    if isinstance(model, MeanPoolClassifier):
        feats = model.embed(**enc)
    else:
        head = classifier_module(model)
        captured: list[torch.Tensor] = []
        handle = head.register_forward_hook(
            lambda _m, args, _o: captured.append(args[0].detach()))
        try:
            model(**enc)
        finally:
            handle.remove()
        feats = captured[-1]
    feats = feats.float()
    out, start = [], 0
    for g in groups:
        out.append(feats[start:start + len(g)].mean(dim=0))
        start += len(g)
    return torch.stack(out)


@torch.no_grad()
def init_prototype_head(model: nn.Module, tokenizer: Any, label_texts: tuple[str, ...],
                        scale: float = PROTOTYPE_SCALE) -> None:
    """Set each class row of the head to the centred, normalized feature of its description.

    ZO crawls from a random head (docs/accuracy.md, "Why each setting"); starting from
    prototypes gives a model that already separates the classes before any training.
    Centring removes the direction all descriptions share, so logits differ only along what
    tells labels apart.
    """
    head = classifier_module(model)
    feats = label_features(model, tokenizer, label_texts)
    feats = feats - feats.mean(dim=0, keepdim=True)
    feats = feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-8)
    head.weight.copy_(scale * feats)
    if head.bias is not None:
        head.bias.zero_()


@torch.no_grad()
def _init_adapters(model: nn.Module, generator: torch.Generator) -> None:
    """LoRA A from a seeded Kaiming-uniform-like range, B zero: the adapted model starts equal
    to the base model, and version 0 does not depend on torch's global RNG."""
    for name, p in model.named_parameters():
        if "lora_A" in name:
            bound = (1.0 / p.shape[1]) ** 0.5
            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))
        elif "lora_B" in name:
            p.zero_()


def build_model(spec: TaskSpec, *, initialize: bool) -> ModelBundle:
    """The model a task trains, with its scope. `initialize` sets version 0 deterministically."""
    model, tokenizer = load_base(spec)
    generator = torch.Generator().manual_seed(INIT_SEED)
    if spec.model_kind == "seq_cls":
        head = classifier_module(model)
        if spec.label_texts and tokenizer is not None:
            # Both sides compute the prototype head: when the head trains, snapshot 0
            # overwrites it exactly; when it stays frozen (outside the scope), devices still
            # hold the coordinator's head (bit-identical on the same kind of CPU).
            init_prototype_head(model, tokenizer, spec.label_texts)
        else:
            # Seeded even without `initialize`: a device's head is overwritten by snapshot 0,
            # but nothing should ever depend on torch's global RNG.
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.02)
                if head.bias is not None:
                    head.bias.zero_()
    if spec.scope == "lora":
        model = apply_lora(model, spec.lora, spec.model_kind)
        if initialize:
            _init_adapters(model, generator)
    if spec.format in ("int8", "int4"):
        model = _quantize(model, spec)
    for p in model.parameters():
        p.requires_grad_(False)  # ZO never needs autograd; keeps forwards lean
    scope = build_scope(spec.scope, model, spec.scope_options)
    if spec.step_scales:
        scope.set_step_scales(spec.step_scales)
    if spec.scope == "ternary" and spec.model_kind == "seq_cls" and spec.label_texts and \
            tokenizer is not None:
        # The scope converted the encoder to BitLinear: the prototypes must be the features
        # of the ternary forward the devices run (set in place; the scope keeps its tensors).
        init_prototype_head(model, tokenizer, spec.label_texts)
    inner = getattr(getattr(model, "base_model", model), "model", model)
    if isinstance(inner, MeanPoolClassifier):
        inner.frozen_prefix = frozen_prefix_depth(model, scope)
    return ModelBundle(model=model, tokenizer=tokenizer, scope=scope, spec=spec)


def _quantize(model: nn.Module, spec: TaskSpec) -> nn.Module:
    """Group-wise int8/int4 Linear layers (heads stay float): the QZO `scales` scope's model."""
    from seedfed.shared.model.quant.model import DEFAULT_SKIP, QuantConfig, quantize_model

    bits = 8 if spec.format == "int8" else 4
    group_size = getattr(spec.scope_options, "group_size", None) or 64  # ScalesOptions
    # LoRA adapters (and peft's head copies) stay float: only the base weights under them are
    # quantized, so the shared base is int8/int4 while the adapters train in float32.
    skip = DEFAULT_SKIP + (("lora_A", "lora_B", "modules_to_save", "original_module")
                           if spec.scope == "lora" else ())
    return quantize_model(model, QuantConfig(bits=bits, group_size=group_size, skip=skip))
