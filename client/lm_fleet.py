"""The keyboard fleet's text: devices whose owners write differently, from one file's sentences.

A next-word personalization fleet needs owners with their own ways of writing. Made from a
labelled sentence file (SST-2's training split), reproducible from a seed:

1. The sentences a pretrained base never saw: the tail of `ternarize.training_order` past the
   base's `sentences` (the base pretrains on its head).
2. Topics: spherical k-means over hashed TF-IDF bag-of-words vectors (numpy only), `topics`
   clusters. A writing group is (topic, sentiment label): what an owner writes about and how
   they feel about it.
3. Each device draws its mixture over the groups from Dirichlet(`alpha`) (small alpha: an owner
   writes mostly in one or two groups) and samples its training and held-out sentences from
   that mixture, without replacement across the fleet.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np
from seedfed.client.data import Examples

#: Hashed bag-of-words dimensions of the topic vectors.
HASH_DIM = 1024
_WORD = re.compile(r"[a-z']+")


@dataclass(frozen=True)
class WriterFleet:
    """Each device's training and held-out text, and the group mixture it was drawn from."""

    train: list[Examples]
    held_out: list[Examples]
    mixtures: np.ndarray  # (devices, groups)
    groups: np.ndarray  # the group of every pool sentence


def _vectors(texts: tuple[str, ...]) -> np.ndarray:
    """Row-normalized TF-IDF vectors of hashed words (stable hashes: the same on every run)."""
    rows = np.zeros((len(texts), HASH_DIM), dtype=np.float32)
    for i, text in enumerate(texts):
        for word in _WORD.findall(text.lower()):
            h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little")
            rows[i, h % HASH_DIM] += 1.0
    df = (rows > 0).sum(0)
    rows *= np.log((1 + len(texts)) / (1 + df)).astype(np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


def topics_of(texts: tuple[str, ...], k: int, seed: int, iterations: int = 15) -> np.ndarray:
    """Spherical k-means topic of every text (k clusters; k-means++ seeding from `seed`)."""
    x = _vectors(texts)
    rng = np.random.default_rng([seed, 0x70C])
    centres = np.empty((k, x.shape[1]), dtype=x.dtype)
    centres[0] = x[rng.integers(len(x))]
    gap = 1.0 - x @ centres[0]
    for c in range(1, k):  # far from the centres so far, with probability ~ distance^2
        weights = np.maximum(gap, 0.0) ** 2
        pick = rng.choice(len(x), p=weights / weights.sum()) if weights.sum() > 0 \
            else rng.integers(len(x))
        centres[c] = x[pick]
        gap = np.minimum(gap, 1.0 - x @ centres[c])
    assign = np.zeros(len(x), dtype=np.int64)
    for _ in range(iterations):
        assign = (x @ centres.T).argmax(1)
        for c in range(k):
            members = x[assign == c]
            if len(members):
                mean = members.sum(0)
                centres[c] = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return assign


def maximal_sentences(pool: Examples) -> Examples:
    """The texts of `pool` that are no contiguous word span of a longer text of it. SST-2's
    training split holds every phrase of a parse tree beside its sentence; without this, a
    device's held-out phrase is often a piece of one of its training sentences, and anything
    that memorizes (a personal n-gram model) would look better than it is."""
    words = [tuple(t.split()) for t in pool.texts]
    spans: set[tuple[str, ...]] = set()
    for w in words:
        for i in range(len(w)):
            for j in range(i + 1, len(w) + 1):
                if j - i < len(w):
                    spans.add(w[i:j])
    keep = [i for i, w in enumerate(words) if w and w not in spans]
    seen: set[tuple[str, ...]] = set()
    unique = []
    for i in keep:  # duplicates of one sentence: the first
        if words[i] not in seen:
            seen.add(words[i])
            unique.append(i)
    return pool.subset(unique)


def writer_fleet(pool: Examples, devices: int, *, train_per_device: int,
                 held_per_device: int, topics: int = 12, alpha: float = 0.1,
                 seed: int = 0) -> WriterFleet:
    """The fleet's text (module docstring); `pool`: sentences the base never saw (its
    `maximal_sentences` are drawn)."""
    if devices < 1 or train_per_device < 1 or held_per_device < 1:
        raise ValueError("need devices, train_per_device and held_per_device >= 1")
    pool = maximal_sentences(pool)
    need = devices * (train_per_device + held_per_device)
    if need > len(pool):
        raise ValueError(f"{devices} devices x {train_per_device + held_per_device} sentences "
                         f"need {need}, the pool holds {len(pool)}")
    labels = pool.labels.astype(np.int64)
    groups = topics_of(pool.texts, topics, seed) * (int(labels.max()) + 1) + labels
    n_groups = int(groups.max()) + 1
    rng = np.random.default_rng([seed, 0xF1EE7])
    mixtures = rng.dirichlet([alpha] * n_groups, size=devices)
    members = [list(rng.permutation(np.flatnonzero(groups == g))) for g in range(n_groups)]
    train, held = [], []
    for d in range(devices):
        picked: list[int] = []
        weights = mixtures[d].copy()
        while len(picked) < train_per_device + held_per_device:
            g = int(rng.choice(n_groups, p=weights / weights.sum()))
            if members[g]:
                picked.append(int(members[g].pop()))
            else:  # a used-up group: the owner writes in the others
                weights[g] = 0.0
                if not weights.sum():
                    raise ValueError("the pool ran out of sentences for the fleet")
        order = rng.permutation(len(picked))
        ids = np.array(picked)[order]
        train.append(pool.subset(ids[:train_per_device]))
        held.append(pool.subset(ids[train_per_device:]))
    return WriterFleet(train, held, mixtures, groups)
