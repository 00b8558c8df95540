"""Client-level differential privacy accounting for the Gaussian mechanism (RDP).

Each round releases the aggregate of device vectors clipped to L2 norm C plus Gaussian noise of
standard deviation sigma * C * (max weight / total weight), which bounds one device's
influence with noise multiplier sigma. The Gaussian mechanism with multiplier sigma has Renyi
DP of order a equal to a / (2 sigma^2) (Mironov 2017); T rounds compose additively, and
(epsilon, delta) follows from epsilon = min_a [T a / (2 sigma^2) + log(1/delta) / (a - 1)].
Every device is assumed to take part in every round (no subsampling amplification), so the
figure is an upper bound.
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
    return min(rounds * gaussian_rdp(noise_multiplier, a) + math.log(1.0 / delta) / (a - 1.0)
               for a in orders)
