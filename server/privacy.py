"""Client-level differential privacy accounting for the Gaussian mechanism (RDP).

What is released each round (`seedfed.shared.protocol.aggregate.dp_aggregate`): the sum of the
device vectors, each clipped to L2 norm C, plus Gaussian noise of standard deviation z * C (z = the
task's `dp_noise_multiplier`), divided by the round's quorum, a number fixed before the round.
Adding or removing one device (all of its data) changes that sum by at most C, so each round is
one Gaussian mechanism of noise multiplier z under add/remove-one-device adjacency. Uniform
weights make the bound hold whatever `num_examples` a device claims; rules whose sensitivity is
not C (trimmed mean, median) are refused with DP at task creation (`AggregationConfig`).

The Gaussian mechanism with multiplier z has Renyi DP of order a equal to a / (2 z^2) (Mironov
2017); T rounds compose additively, and (epsilon, delta) follows from the conversion of Canonne,
Kamath and Steinke 2020 (Proposition 12 of arXiv:2004.00010 v4, also used by Google's
dp-accounting): epsilon = min_a [T a / (2 z^2) + log((a - 1) / a) - (log delta + log a) / (a - 1)].
Every device is assumed to take part in every round (no subsampling amplification), so the
figure is an upper bound for devices that skip rounds. `tests/server/test_privacy.py` checks the
noise scale and this epsilon against dp-accounting's RDP and PLD accountants.
"""

from __future__ import annotations

import math

DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1.0 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128.0, 256.0, 512.0, 1024.0])


def gaussian_rdp(noise_multiplier: float, order: float) -> float:
    if noise_multiplier <= 0:
        raise ValueError(f"noise multiplier must be positive, got {noise_multiplier}")
    if order <= 1:
        raise ValueError(f"RDP order must be > 1, got {order}")
    return order / (2.0 * noise_multiplier**2)


def rdp_to_epsilon(rdp: float, order: float, delta: float) -> float:
    """(epsilon, delta) from an RDP guarantee of `order` (Canonne-Kamath-Steinke 2020)."""
    return max(0.0, rdp + math.log1p(-1.0 / order)
               - (math.log(delta) + math.log(order)) / (order - 1.0))


def epsilon(noise_multiplier: float, rounds: int, delta: float,
            orders: tuple[float, ...] = DEFAULT_ORDERS) -> float:
    """(epsilon, delta)-DP after `rounds` Gaussian releases; inf without noise, 0 with no round."""
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if rounds == 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return min(rdp_to_epsilon(rounds * gaussian_rdp(noise_multiplier, a), a, delta)
               for a in orders)
