"""Fleet statistics of the devices' reported accuracies: the mean and the worst decile.

One definition for every reader: the coordinator's task stats (`TaskStats.rounds`, the
dashboard), `seedfed simulate`'s report and the personalization benchmark. Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("the mean of no values is undefined")
    return sum(values) / len(values)


def worst_decile(values: Sequence[float]) -> float:
    """The mean of the lowest tenth of `values`, at least one value (of 10 devices: the worst
    one; of 25: the worst two). What the fleet's worst-served devices get, which a mean hides."""
    if not values:
        raise ValueError("the worst decile of no values is undefined")
    k = max(1, len(values) // 10)
    return sum(sorted(values)[:k]) / k


@dataclass(frozen=True)
class FleetAccuracy:
    """Mean and worst decile of one kind of accuracy over the devices that reported it."""

    devices: int
    mean: float
    worst_decile: float


def fleet_accuracy(values: Sequence[float]) -> FleetAccuracy | None:
    """The fleet's mean and worst decile of `values`; None when no device reported one."""
    if not values:
        return None
    return FleetAccuracy(len(values), mean(values), worst_decile(values))
