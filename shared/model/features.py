"""The per-sentence feature cache's contract: the canonical context a row is computed in, the
key of a sentence, and the store that shares rows beyond one process.

`MeanPoolClassifier` (shared/model/classifier.py) caches, per sentence, the states entering its
first trainable layer; what makes a cached row's bits depend on the sentence alone is defined
here, so the classifier, a simulation's shared store (seedfed/features.py) and the tests agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch

#: Upper bound of a MeanPoolClassifier's per-example feature cache (FIFO eviction beyond it).
FEATURE_CACHE_BYTES = 512 * 1024 * 1024
#: The canonical context of a cached feature: a sentence is encoded in a group of exactly this
#: many sentences of its own token length (no padding), on one thread. With the shape fixed by
#: the length alone, a row's bits do not depend on its companions or its slot (measured: the
#: matmul kernels pick their blocking by shape; tests/shared/model/test_classifier.py checks
#: it), while a padded batch, a batch of another size or another thread count each move the
#: last bits.
#: 8 costs ~5.6 ms a sentence on one core, a sentence alone ~27 ms (docs/performance.md).
FEATURE_GROUP = 8


class FeatureStore(Protocol):
    """Cached features shared beyond one process (a simulation's run directory: one encoding
    per run, seedfed/features.py). Rows are what `MeanPoolClassifier` caches, by sentence key;
    `namespace` (`MeanPoolClassifier.feature_namespace`) names the model and the context."""

    def get(self, namespace: str, keys: Sequence[bytes]) -> dict[bytes, torch.Tensor]: ...

    def put(self, namespace: str, rows: Mapping[bytes, torch.Tensor]) -> None: ...


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
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
        return distinct_rows_exact(flat)
    return first.tolist(), inverse.tolist()


#: An odd 64-bit constant (the golden ratio's): scrambles the rows' hash lanes.
_HASH_MULT = 0x9E3779B97F4A7C15


def distinct_rows_exact(flat: np.ndarray) -> tuple[list[int], list[int]]:
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


def sentence_key(ids: np.ndarray, types: np.ndarray | None) -> bytes:
    """A sentence's cache key: its token ids (and token types), unpadded, as int64 bytes."""
    return ids.astype(np.int64, copy=False).tobytes() + (
        b"" if types is None else types.astype(np.int64, copy=False).tobytes())


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread: the thread count moves a matmul's last bits."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)
