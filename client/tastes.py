"""Tasks where devices differ: per-device tastes (built in) and a label-skewed split of a file.

**Per-device tastes** (data source `tastes`). The built-in preference task
(`seedfed.client.preference`) gives every device one owner's taste. Here each device is its own
owner. Suggestions fall into six topics (`TOPICS`: the outdoors, cooking, live music, shopping,
screens, crowds; five activities each), and every device draws which topics it likes and which
it dislikes from that common pool: each opinion follows the population's majority (the first
three liked, the last three not) with probability `MAJORITY`, else goes against it. So tastes
overlap -- a shared model that learns the majority is right about three topics in four -- but
they conflict too, and only a model of the device's own gets a conflicting topic right.

A device's owner has labelled suggestions of only `SEEN_TOPICS` of the six topics (a phone
owner rates what they were offered); its held-out examples cover all six. So a device alone
knows nothing of its unseen topics, the fleet's shared model knows the majority's view of them,
and a personal part on top of the shared model can get both right: what the task is built to
show (docs/personalization.md).

**Label skew** (`DeviceData.label_skew` > 0, any labelled file such as SST-2). Device i's
majority class is `i mod num_labels`; that class makes up `label_skew` of its examples and the
other classes share the rest. A shared model fits the union; a personal part can learn the
device's own prior.

Everything is a pure function of (seed, device index): every process derives the same tastes.
"""

from __future__ import annotations

import functools

import numpy as np
from seedfed.client.data import Examples
from seedfed.client.preference import OPENERS, TIMES

#: The data source name of the per-device taste task.
TASTES = "tastes"
#: Topic -> its activities. The population likes the first three topics, not the last three.
TOPICS: dict[str, tuple[str, ...]] = {
    "outdoors": ("a hike up the forest trail", "kayaking on the lake",
                 "a camping trip in the mountains", "a bike ride along the river",
                 "birdwatching in the nature reserve"),
    "cooking": ("baking sourdough bread", "cooking a new curry recipe", "a pasta-making class",
                "trying a recipe from the farmers market", "a knife skills workshop"),
    "music": ("a jazz concert in the old town", "a live folk music night",
              "an open-air classical concert", "jamming with the guitar group",
              "a choir rehearsal"),
    "shopping": ("a trip to the shopping mall", "the clearance sale at the outlet store",
                 "the black friday sales", "a home shopping channel deal",
                 "browsing the new phone models"),
    "screens": ("a marathon of reality TV", "binge-watching the new series",
                "a video game tournament", "scrolling the latest social media trends",
                "a mobile game event"),
    "crowds": ("a crowded nightclub party", "the stadium match with fifty thousand fans",
               "a packed theme park queue", "a busy rooftop bar crawl",
               "a street festival with huge crowds"),
}
TOPIC_NAMES: tuple[str, ...] = tuple(TOPICS)
#: Topics the population likes (the rest it dislikes).
MAJORITY_LIKED: frozenset[str] = frozenset({"outdoors", "cooking", "music"})
#: Probability that a device's opinion of a topic is the population's.
MAJORITY = 0.75
#: Topics a device has labelled suggestions of (its training examples).
SEEN_TOPICS = 3
#: Examples a device labels for training and for its own held-out score.
TRAIN_PER_DEVICE = 48
HELD_OUT_PER_DEVICE = 48
#: Streams of the generator: tastes, training examples, held-out examples, validation.
_TASTE, _TRAIN, _HELD_OUT, _VALIDATION = 0, 1, 2, 3


@functools.lru_cache(maxsize=1024)
def _draw(seed: int, device: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(liked, disliked, seen) topics of a device; see `device_taste`."""
    rng = np.random.default_rng([seed, device, _TASTE])
    while True:
        liked = tuple(t for t in TOPIC_NAMES
                      if (t in MAJORITY_LIKED) == (rng.random() < MAJORITY))
        disliked = tuple(t for t in TOPIC_NAMES if t not in liked)
        seen = {TOPIC_NAMES[i] for i in rng.permutation(len(TOPIC_NAMES))[:SEEN_TOPICS]}
        if seen & set(liked) and seen & set(disliked):
            return liked, disliked, tuple(t for t in TOPIC_NAMES if t in seen)


def device_taste(seed: int, device: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(liked topics, disliked topics) of a device: a partition of `TOPIC_NAMES`, each
    opinion the majority's with probability `MAJORITY`. Drawn again (same generator) until
    the device likes at least one and dislikes at least one of its seen topics, so it has
    training examples of both labels."""
    liked, disliked, _ = _draw(seed, device)
    return liked, disliked


def seen_topics(seed: int, device: int) -> tuple[str, ...]:
    """The topics the device's training examples are about (`SEEN_TOPICS` of the six)."""
    return _draw(seed, device)[2]


def taste_examples(seed: int, device: int, n: int, stream: int) -> Examples:
    """n balanced suggestions labelled by the device's own taste: of its seen topics for
    training, of all six otherwise."""
    if n < 2:
        raise ValueError(f"need at least 2 examples, got {n}")
    liked, disliked = device_taste(seed, device)
    if stream == _TRAIN:
        seen = seen_topics(seed, device)
        liked, disliked = (tuple(t for t in liked if t in seen),
                           tuple(t for t in disliked if t in seen))
    rng = np.random.default_rng([seed, device, stream])
    labels = rng.permutation(np.arange(n) % 2).astype(np.int64)
    texts = []
    for y in labels:
        side = liked if y == 1 else disliked
        activities = TOPICS[side[rng.integers(len(side))]]
        parts = [OPENERS[rng.integers(len(OPENERS))], activities[rng.integers(len(activities))],
                 TIMES[rng.integers(len(TIMES))]]
        texts.append(" ".join(p for p in parts if p) + rng.choice(np.array([".", "!", "?"])))
    return Examples(tuple(texts), labels)


def device_examples(seed: int, device: int) -> tuple[Examples, Examples]:
    """A device's (training, held-out) examples of the taste task."""
    return (taste_examples(seed, device, TRAIN_PER_DEVICE, _TRAIN),
            taste_examples(seed, device, HELD_OUT_PER_DEVICE, _HELD_OUT))


def pooled_examples(seed: int, devices: int, per_device: int, validation: bool = False,
                    ) -> Examples:
    """Held-out examples of every device, pooled: the shared model's own test set (or, with
    `validation`, a disjoint draw for tuning)."""
    stream = _VALIDATION if validation else _HELD_OUT
    parts = [taste_examples(seed, d, per_device, stream) for d in range(devices)]
    return Examples(tuple(t for p in parts for t in p.texts),
                    np.concatenate([p.labels for p in parts]))


def label_skew_partition(labels: np.ndarray, n_devices: int, skew: float,
                         rng: np.random.Generator, size: int | None = None,
                         ) -> list[np.ndarray]:
    """Example indices per device, label-skewed: device i draws `skew` of its `size` examples
    from class `i mod C` and the rest evenly from the other classes, no example on two
    devices. The default size is the largest every class can supply (at most an equal
    share)."""
    if not 0 < skew < 1:
        raise ValueError(f"label skew must be in (0, 1), got {skew}")
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if n_devices < 1 or classes.size < 2:
        raise ValueError(f"need >= 1 device and >= 2 classes, got {n_devices}, {classes.size}")
    if size is None:
        counts = {int(c): int((labels == c).sum()) for c in classes}
        majors = {int(c): sum(1 for d in range(n_devices) if classes[d % classes.size] == c)
                  for c in classes}
        # per example of a device's size, class c is needed skew times by each device it is
        # the majority of and (1 - skew) / (C - 1) times by each of the others
        need = {c: majors[c] * skew + (n_devices - majors[c]) * (1 - skew) / (classes.size - 1)
                for c in counts}
        size = min(labels.size // n_devices, *(int(counts[c] / need[c]) - 1 for c in counts))
    queues = {int(c): list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    out = []
    for d in range(n_devices):
        major = int(classes[d % classes.size])
        others = [int(c) for c in classes if c != major]
        want = {major: int(round(skew * size))}
        rest = size - want[major]
        for j, c in enumerate(others):
            want[c] = rest // len(others) + (1 if j < rest % len(others) else 0)
        picked: list[int] = []
        for c, k in want.items():
            if len(queues[c]) < k:
                raise ValueError(f"class {c} has too few examples for {n_devices} devices of "
                                 f"{size} at skew {skew}; lower the size or the skew")
            picked += [int(i) for i in queues[c][:k]]
            del queues[c][:k]
        out.append(np.sort(np.asarray(picked, dtype=np.int64)))
    return out
