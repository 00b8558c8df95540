"""A small built-in personal-preference task, generated in code so the demo runs anywhere.

A device owner marks suggestions as welcome (1) or not (0). This owner enjoys being outdoors,
cooking and live music and does not care for shopping, screens or crowds -- a taste the base
model cannot know, so zero-shot accuracy from the generic label descriptions sits near chance
and the fleet has to learn it, while the topics are clear enough in sentence embeddings that
a few hundred ZO rounds on a few devices make accuracy visibly rise.

Sentences combine an opener, an activity and a time phrase; every choice comes from an explicit
numpy Generator, so `preference_examples(n, seed)` is a pure function.
"""

from __future__ import annotations

import numpy as np
from seedfed.client.data import Examples

LIKED: tuple[str, ...] = (
    "a hike up the forest trail", "kayaking on the lake", "a camping trip in the mountains",
    "a bike ride along the river", "birdwatching in the nature reserve",
    "a picnic in the park", "trail running at sunrise", "a swim in the sea",
    "baking sourdough bread", "cooking a new curry recipe", "a pasta-making class",
    "trying a recipe from the farmers market", "a jazz concert in the old town",
    "a live folk music night", "an open-air classical concert", "jamming with the guitar group",
    "gardening in the allotment", "a walk through the botanical garden",
)
DISLIKED: tuple[str, ...] = (
    "a trip to the shopping mall", "the clearance sale at the outlet store",
    "browsing the new phone models", "a marathon of reality TV", "binge-watching the new series",
    "a video game tournament", "scrolling the latest social media trends",
    "a crowded nightclub party", "the stadium match with fifty thousand fans",
    "a packed theme park queue", "a fast food challenge", "a home shopping channel deal",
    "the black friday sales", "an online betting promotion", "a celebrity gossip show",
    "a busy rooftop bar crawl", "a new streaming subscription", "a mobile game event",
)
OPENERS: tuple[str, ...] = (
    "How about", "Reminder:", "Your friend suggests", "Would you like to try",
    "Recommended for you:", "Don't miss", "Plan for", "Someone invited you to",
    "New idea:", "Your calendar has room for",
)
TIMES: tuple[str, ...] = (
    "this weekend", "tomorrow morning", "on Saturday", "after work", "tonight",
    "next Sunday", "this afternoon", "on your day off", "later this week", "",
)


def preference_examples(n: int, seed: int) -> Examples:
    """n balanced, shuffled preference sentences drawn from `seed`."""
    if n < 2:
        raise ValueError(f"need at least 2 examples, got {n}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 2).astype(np.int64)
    texts = []
    for y in labels:
        pool = LIKED if y == 1 else DISLIKED
        parts = [OPENERS[rng.integers(len(OPENERS))], pool[rng.integers(len(pool))],
                 TIMES[rng.integers(len(TIMES))]]
        texts.append(" ".join(p for p in parts if p) + rng.choice(np.array([".", "!", "?"])))
    return Examples(tuple(texts), labels)
