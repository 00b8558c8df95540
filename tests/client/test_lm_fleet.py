"""The keyboard fleet's text: reproducible from a seed, disjoint across devices, and each owner
writing mostly in a few groups."""

from __future__ import annotations

import numpy as np
import pytest
from seedfed.client.data import Examples
from seedfed.client.lm_fleet import topics_of, writer_fleet

_TOPICS = {
    "food": ["pizza", "pasta", "sauce", "cheese", "bread"],
    "sport": ["goal", "match", "team", "coach", "score"],
    "music": ["song", "band", "guitar", "album", "drums"],
}


def _pool(n: int = 600, seed: int = 0) -> Examples:
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for i in range(n):
        topic = list(_TOPICS)[i % 3]
        words = rng.choice(_TOPICS[topic], size=4)
        texts.append(f"{' '.join(words)} number {i}")
        labels.append(i % 2)
    return Examples(tuple(texts), np.array(labels, dtype=np.int64))


def test_topics_separate_sentences_by_their_words() -> None:
    # Arrange
    pool = _pool()
    truth = np.arange(len(pool)) % 3
    # Act
    found = topics_of(pool.texts, 3, seed=0)
    # Assert: each found topic is (nearly) one true topic
    for c in range(3):
        members = truth[found == c]
        assert len(members) and np.bincount(members).max() / len(members) > 0.9


def test_the_fleet_is_reproducible_and_devices_share_no_sentence() -> None:
    # Arrange
    pool = _pool()
    # Act
    a = writer_fleet(pool, 6, train_per_device=40, held_per_device=10, topics=3, seed=4)
    b = writer_fleet(pool, 6, train_per_device=40, held_per_device=10, topics=3, seed=4)
    # Assert
    assert [e.texts for e in a.train] == [e.texts for e in b.train]
    seen = [t for part in (*a.train, *a.held_out) for t in part.texts]
    assert len(seen) == len(set(seen)) == 6 * 50


def test_small_alpha_gives_each_owner_few_groups() -> None:
    # Arrange
    pool = _pool(1200)
    # Act
    fleet = writer_fleet(pool, 5, train_per_device=60, held_per_device=10, topics=3,
                         alpha=0.05, seed=1)
    # Assert: for most devices, most sentences come from their largest group
    index = {t: i for i, t in enumerate(pool.texts)}
    shares = [np.bincount(g).max() / len(g) for g in
              (fleet.groups[[index[t] for t in part.texts]] for part in fleet.train)]
    assert np.median(shares) > 0.8


def test_a_pool_too_small_for_the_fleet_is_refused() -> None:
    with pytest.raises(ValueError, match="need"):
        writer_fleet(_pool(100), 5, train_per_device=40, held_per_device=10, topics=3)
