"""`report.png` of a simulation: accuracy and loss per round, upload against FedAvg, and every
device's held-out accuracy, shared vs personalized.

Readable at any fleet size: devices are ranked (sorted by their shared-model accuracy, the x
axis is the rank, not a 19-digit Flower node id), drawn as points rather than grouped bars, and
every legend sits below its panel, clear of the data. The upload panel is linear, the mean
bytes one device uploads per round beside what FedAvg's device would send (its trainable
tensors in float32), with the ratio written on it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from seedfed.personal_report import DeviceRow, personalization_summary


@dataclass
class RoundRow:
    round: int
    version: int | None
    participants: int
    loss: float | None
    accuracy: float | None
    upload_bytes: int
    download_bytes: int
    upload_bytes_per_device: float
    local_accuracy: float | None
    seconds: float
    #: seconds the round's device calls (train + sync, every device) spent in the ClientApp
    device_compute_s: float | None = None
    # over the devices that reported a personal part: mean and worst decile (the mean of the
    # lowest tenth, at least one device) of the held-out accuracy, shared vs personalized
    shared_accuracy_mean: float | None = None
    shared_accuracy_worst_decile: float | None = None
    personal_accuracy_mean: float | None = None
    personal_accuracy_worst_decile: float | None = None


@dataclass
class Report:
    config: dict[str, Any]
    task_id: str
    scope_numel: int
    scalars_per_device: int
    fedavg_bytes_per_round: int
    upload_budget_bytes_per_device: int
    rounds: list[RoundRow] = field(default_factory=list)
    initial_accuracy: float | None = None
    final_version: int = 0
    final_checksum: str = ""
    device_checksums: dict[str, str] = field(default_factory=dict)
    wall_seconds: float = 0.0
    devices: list[DeviceRow] = field(default_factory=list)
    #: what "accuracy" is in this run: a classifier's (and label words') class accuracy, or a
    #: next-token LM's next-word top-3 accuracy (`metric_name`)
    metric: str = "held-out accuracy"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["upload_ratio_to_fedavg"] = self.upload_ratio()
        d["wall_s"] = self.wall_seconds
        d["device_compute_s"] = sum(r.device_compute_s or 0.0 for r in self.rounds)
        d["personalization"] = personalization_summary(self.devices)
        return d

    def upload_ratio(self) -> float | None:
        """Mean upload per device per round over FedAvg's upload (fp32 trainable tensors)."""
        per_device = [r.upload_bytes_per_device for r in self.rounds if r.participants]
        if not per_device:
            return None
        return (sum(per_device) / len(per_device)) / (4 * self.scope_numel)


#: Legend placement of every panel: centred below the axes, outside the data.
_BELOW = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.16), "frameon": False,
          "fontsize": 8}


def plot(report: Report, path: Path) -> None:
    """The run's report as one PNG (two panels, three with per-device accuracies)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if report.devices else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6), layout="constrained")
    _accuracy_and_loss(axes[0], report)
    _upload(axes[1], report)
    if report.devices:
        plot_devices(axes[2], report.devices, report.metric)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _accuracy_and_loss(ax: Any, report: Report) -> None:
    from matplotlib.ticker import MaxNLocator

    acc = [(0, report.initial_accuracy)] if report.initial_accuracy is not None else []
    acc += [(r.round, r.accuracy) for r in report.rounds if r.accuracy is not None]
    handles = []
    if acc:
        handles += ax.plot([a for a, _ in acc], [b for _, b in acc], "o-", color="tab:blue",
                           markersize=4, label=f"{report.metric} (shared model)")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(report.metric, color="tab:blue")
    losses = [(r.round, r.loss) for r in report.rounds if r.loss is not None]
    if losses:
        twin = ax.twinx()
        handles += twin.plot([a for a, _ in losses], [b for _, b in losses], "-",
                             color="tab:red", linewidth=0.8, alpha=0.6,
                             label="mean device training loss")
        twin.set_ylabel("mean device loss", color="tab:red")
        # the noisy loss behind the accuracy: the twin's axes drawn first, ours see-through
        twin.set_zorder(ax.get_zorder() - 1)
        ax.patch.set_visible(False)
    ax.set_title("Accuracy and loss per round")
    if handles:
        ax.legend(handles=handles, ncols=1, **_BELOW)


def _upload(ax: Any, report: Report) -> None:
    """Two horizontal bars on a linear scale: seedfed's mean upload per device per round and
    FedAvg's, each labelled with its bytes, and the ratio between them written between."""
    from matplotlib.ticker import EngFormatter

    per_device = [r.upload_bytes_per_device for r in report.rounds if r.participants]
    fedavg = 4 * report.scope_numel
    mean = sum(per_device) / len(per_device) if per_device else 0.0
    top = max(mean, fedavg, 1)
    ax.barh(["seedfed", "FedAvg"], [mean, fedavg], color=["tab:green", "tab:gray"],
            height=0.4)
    ax.invert_yaxis()  # seedfed on top
    ax.set_xlim(0, top * 1.3)
    for y, value in enumerate((mean, fedavg)):
        ax.text(value + 0.02 * top, y, f"{value:,.0f} B", va="center", fontsize=9)
    ax.xaxis.set_major_formatter(EngFormatter(unit="B", sep=" "))
    ax.set_xlabel("bytes one device uploads per round (linear scale)")
    ax.set_title("Upload per device per round")
    if per_device:
        ax.text(0.02 * top, 0.5, f"seedfed = {_ratio(mean / fedavg)} FedAvg", va="center",
                fontsize=11, fontweight="bold")
        ax.text(0.5, -0.2, f"seedfed: {report.scalars_per_device:,} float32 scalars + a "
                f"header; FedAvg: the trained tensors ({report.scope_numel:,} float32 values)",
                transform=ax.transAxes, ha="center", va="top", fontsize=8)


def _ratio(ratio: float) -> str:
    """The upload ratio as a reader takes it in: 0.744 x, or 1/39,000 x for a large scope."""
    if ratio >= 0.1:
        return f"{ratio:.3f} x"
    return f"1/{1 / ratio:,.0f} x"


def metric_name(objective: str) -> str:
    """The name of a run's accuracy for its task's objective."""
    return "next-word top-3 accuracy" if objective == "next_token" else "held-out accuracy"


def plot_devices(ax: Any, devices: list[DeviceRow], metric: str = "held-out accuracy") -> None:
    """Every device's held-out accuracy, ranked by its shared-model accuracy: shared (line),
    shared + personal and local only (points), the fleet means dashed."""
    from matplotlib.ticker import MaxNLocator

    ranked = sorted(devices, key=lambda d: (d.shared_accuracy, d.personal_accuracy or 0.0))
    ranks = list(range(1, len(ranked) + 1))
    kinds = [("shared", "shared_accuracy", "tab:gray", "-", "."),
             ("shared + personal", "personal_accuracy", "tab:blue", "", "o"),
             ("local only", "local_accuracy", "tab:orange", "", "x")]
    small = len(ranked) > 60  # many devices: smaller marks, so neighbours do not merge
    for label, attr, color, line, marker in kinds:
        points = [(x, getattr(d, attr)) for x, d in zip(ranks, ranked, strict=True)
                  if getattr(d, attr) is not None]  # a device without a personal part: none
        if not points:
            continue
        values = [v for _, v in points]
        mean = sum(values) / len(values)
        ax.plot([x for x, _ in points], values, linestyle=line or "none", marker=marker,
                color=color, zorder=3 if line else 2,  # the ranked shared line on top
                markersize=3 if small else 5, linewidth=1.2, alpha=0.85,
                label=f"{label} (mean {mean:.3f})")
        ax.axhline(mean, color=color, linestyle="--", linewidth=0.8)
    ax.set_xlim(0.5, len(ranked) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=10))
    ax.set_ylim(0, 1.04)
    ax.set_xlabel(f"device rank by shared-model accuracy ({len(ranked)} devices)")
    ax.set_ylabel(f"device {metric}")
    ax.set_title("Per device: shared vs personalized")
    ax.legend(ncols=1, **_BELOW)
