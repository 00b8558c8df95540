"""The tasks where devices differ (client/tastes.py): per-device tastes and label skew."""

from __future__ import annotations

import numpy as np
import pytest
from seedfed.client import tastes
from seedfed.client.device_data import DeviceData, load_device_examples


def _topic(text: str) -> str:
    return next(t for t, acts in tastes.TOPICS.items() if any(a in text for a in acts))


def test_tastes_are_a_pure_function_of_seed_and_device() -> None:
    # Arrange / Act
    first = [tastes.device_examples(0, d) for d in range(3)]
    again = [tastes.device_examples(0, d) for d in range(3)]
    # Assert
    for (a_train, a_held), (b_train, b_held) in zip(first, again, strict=True):
        assert a_train.texts == b_train.texts and (a_train.labels == b_train.labels).all()
        assert a_held.texts == b_held.texts


def test_every_device_labels_by_its_own_taste_and_trains_on_its_seen_topics_only() -> None:
    for d in range(20):
        # Arrange
        liked, disliked = tastes.device_taste(0, d)
        seen = set(tastes.seen_topics(0, d))
        # Act
        train, held = tastes.device_examples(0, d)
        # Assert
        assert set(liked) | set(disliked) == set(tastes.TOPIC_NAMES)
        assert not set(liked) & set(disliked)
        assert len(seen) == tastes.SEEN_TOPICS
        for text, y in zip(train.texts + held.texts, np.concatenate([train.labels, held.labels]),
                           strict=True):
            assert (_topic(text) in liked) == (y == 1)
        assert {_topic(t) for t in train.texts} <= seen
        assert train.labels.mean() == held.labels.mean() == 0.5


def test_tastes_overlap_but_conflict_across_the_fleet() -> None:
    # Arrange / Act
    opinions = np.array([[t in tastes.device_taste(0, d)[0] for t in tastes.TOPIC_NAMES]
                         for d in range(200)])
    majority = np.array([t in tastes.MAJORITY_LIKED for t in tastes.TOPIC_NAMES])
    # Assert: most opinions are the majority's, every topic has dissenters
    agree = (opinions == majority).mean()
    assert 0.65 < agree < 0.85
    assert ((opinions != majority).any(axis=0)).all()


def test_the_device_data_source_tastes_gives_each_device_its_own_examples() -> None:
    # Arrange
    data = [DeviceData(source=tastes.TASTES, partition_id=d, num_partitions=4)
            for d in range(2)]
    # Act
    (a, a_held), (b, _) = (load_device_examples(x) for x in data)
    # Assert
    assert a.texts != b.texts
    assert (len(a), len(a_held)) == (tastes.TRAIN_PER_DEVICE, tastes.HELD_OUT_PER_DEVICE)


def test_label_skew_gives_each_device_its_majority_class() -> None:
    # Arrange
    labels = np.array([0, 1] * 500)
    # Act
    parts = tastes.label_skew_partition(labels, 4, 0.9, np.random.default_rng(0), size=100)
    # Assert
    for d, idx in enumerate(parts):
        assert len(idx) == 100
        assert (labels[idx] == d % 2).mean() == pytest.approx(0.9)
    assert len(np.unique(np.concatenate(parts))) == 400  # no example on two devices


def test_label_skew_refuses_what_it_cannot_split() -> None:
    # Arrange
    labels = np.array([0] * 50 + [1] * 5)
    # Act / Assert
    with pytest.raises(ValueError, match="too few"):
        tastes.label_skew_partition(labels, 2, 0.5, np.random.default_rng(0), size=20)
    with pytest.raises(ValueError, match="skew"):
        tastes.label_skew_partition(labels, 2, 1.0, np.random.default_rng(0))
