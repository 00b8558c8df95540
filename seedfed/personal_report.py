"""Personalization in a simulation's report: the per-device accuracies and their fleet totals.

Each device with a personal part reports, in the sync phase, its held-out accuracy with the
shared model alone, with shared + personal, and with a local-only head (client/personal.py;
numbers only). `seedfed simulate` keeps the last report of every device (`report.json`
`devices`, `DeviceRow`), the fleet's mean and worst decile per round (`fleet_accuracy`) and in
total (`personalization_summary`) and prints them as a table (`seedfed.simulate.report` plots them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from seedfed.shared.protocol.fleet_stats import worst_decile


@dataclass
class DeviceRow:
    """One device's held-out accuracy at the end of the run (report.json `devices`)."""

    device: int
    shared_accuracy: float
    personal_accuracy: float | None
    local_accuracy: float | None


def personalization_summary(devices: list[DeviceRow]) -> dict[str, Any] | None:
    """Fleet totals of the per-device accuracies: mean and worst decile of each kind, and the
    share of devices at least as accurate personalized as with the shared model."""
    rows = [d for d in devices if d.personal_accuracy is not None]
    if not rows:
        return None
    out: dict[str, Any] = {"devices": len(rows)}
    for kind in ("shared", "personal", "local"):
        values = [getattr(d, f"{kind}_accuracy") for d in rows]
        if any(v is None for v in values):
            continue
        out[f"{kind}_accuracy_mean"] = sum(values) / len(values)
        out[f"{kind}_accuracy_worst_decile"] = worst_decile(values)
    out["share_personal_at_least_shared"] = sum(
        1 for d in rows if (d.personal_accuracy or 0.0) >= d.shared_accuracy) / len(rows)
    return out


def fleet_accuracy(row: Any, scores: dict[int, tuple[float, float | None, float | None]],
                   ) -> None:
    """Fill a round row's shared vs personalized means and worst deciles from the devices'
    reports (devices without a personal part left out)."""
    pairs = [(a, p) for a, p, _ in scores.values() if p is not None]
    if not pairs:
        return
    shared, personal = [a for a, _ in pairs], [p for _, p in pairs]
    row.shared_accuracy_mean = sum(shared) / len(shared)
    row.shared_accuracy_worst_decile = worst_decile(shared)
    row.personal_accuracy_mean = sum(personal) / len(personal)
    row.personal_accuracy_worst_decile = worst_decile(personal)


def devices_table(devices: list[DeviceRow]) -> Any:
    """The per-device accuracies and the fleet's totals as a rich table."""
    from rich.table import Table

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    table = Table(title="per device: held-out accuracy")
    for name in ("device", "shared", "shared + personal", "local only"):
        table.add_column(name, justify="right", no_wrap=True)
    for d in devices:
        table.add_row(str(d.device), fmt(d.shared_accuracy), fmt(d.personal_accuracy),
                      fmt(d.local_accuracy))
    summary = personalization_summary(devices)
    if summary is not None:
        for label, key in (("mean", "mean"), ("worst decile", "worst_decile")):
            table.add_row(label, *(fmt(summary.get(f"{kind}_accuracy_{key}"))
                                   for kind in ("shared", "personal", "local")))
    return table
