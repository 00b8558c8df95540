"""`seedfed simulate`'s console: the expected duration before the first round, a progress bar
while the rounds run, and the summary tables after them.
"""

from __future__ import annotations

from typing import Any

from seedfed.simulate.config import (
    TASTES,
    SimulationConfig,
    data_splits,
    device_data,
    label_texts,
    task_spec_for,
)
from seedfed.simulate.driver import prefills, run
from seedfed.simulate.report import Report, RoundRow


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def expected_duration(config: SimulationConfig) -> Any:
    """`seedfed.estimate.DurationEstimate` of the run, measured on this machine before it
    starts (one device step of each of the task's plans, the personal part and the scoring,
    scaled; the encoding the feature cache lacks)."""
    from seedfed.estimate import estimate_duration, evaluations
    from seedfed.features import SharedFeatures, store_root

    splits = data_splits(config)
    spec = task_spec_for(config, label_texts(config.data, splits.train.num_labels))
    held = splits.validation if config.eval_on_validation else splits.test
    per_round = min(config.devices_per_round or config.devices, config.devices)
    parallel = 1 if config.engine == "inprocess" else config.cpus
    every = config.sync_every or config.eval_every
    syncs = sum(1 for r in range(1, config.rounds + 1) if r % every == 0 or r == config.rounds)
    # a sample as large as a device's personal round draws (16 steps x 32), so it is timed
    # on as many distinct rows as a device of the fleet trains it on
    return estimate_duration(
        spec, splits.train.subset(range(min(len(splits.train), 512))),
        held.subset(range(min(config.eval_size, len(held)))), rounds=config.rounds,
        per_round=per_round, parallel=parallel,
        evals=evaluations(config.rounds, config.eval_every) if config.eval_size else 0,
        sentences=sentences_encoded(config), personal=config.personal,
        syncs=syncs if config.sync_after_round else 0,
        store=SharedFeatures(store_root(config.feature_cache, config.out.resolve())),
        time_coordinator=True, engine=config.engine)


def sentences_encoded(config: SimulationConfig) -> int:
    """The fleet's sentences a run needs encoded: all of them where it prefills or is likely
    to sample most devices, else those of the devices it is expected to sample."""
    from seedfed.client import tastes
    from seedfed.client.device_data import fleet_texts

    data = device_data(config)
    if config.data == TASTES:  # every device generates its own: one device's, times the fleet
        fleet = sum(len(x) for x in tastes.device_examples(config.seed, 0)) * config.devices
    else:
        fleet = len(fleet_texts(data))
    per_round = config.devices_per_round or config.devices
    sampled = 1 - (1 - per_round / config.devices) ** config.rounds
    return fleet if config.engine == "flower" and prefills(config) else round(fleet * sampled)


def ratio_words(ratio: float) -> str:
    """An upload ratio to FedAvg as a person reads it: `ratio 0.745 (1.3x less)`, `ratio
    1.95e-05 (51,282x less)`, `ratio 2.5 (2.5x more)`."""
    shown = f"{ratio:.3g}" if ratio >= 1e-3 else f"{ratio:.2e}"
    if ratio <= 0 or abs(ratio - 1) < 5e-3:
        return f"ratio {shown}" + (" (the same)" if ratio > 0 else "")
    factor, word = (1 / ratio, "less") if ratio < 1 else (ratio, "more")
    times = f"{factor:,.0f}" if factor >= 10 else f"{factor:.2g}"
    return f"ratio {shown} ({times}x {word})"


def run_with_progress(config: SimulationConfig) -> Report:
    """`run` with a rich progress bar (round, participants, loss, accuracy) and a summary."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    columns = [TextColumn("[bold]{task.description} {task.completed}/{task.total}"), BarColumn(),
               TextColumn("devices {task.fields[participants]}"),
               TextColumn("loss {task.fields[loss]}"),
               TextColumn("accuracy [bold green]{task.fields[accuracy]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("round", total=config.rounds, participants="-", loss="-",
                                accuracy="-")

        encoding: list[Any] = []

        def on_prefill(done: int, total: int) -> None:
            if not encoding:  # shown while the fleet's sentences are encoded (a cold cache)
                encoding.append(progress.add_task("encoding the fleet's sentences", total=total,
                                                  participants="-", loss="-", accuracy="-"))
            progress.update(encoding[0], completed=done)
            if done == total:
                progress.remove_task(encoding[0])

        def on_round(row: RoundRow, total: int) -> None:
            progress.update(bar, completed=row.round, participants=str(row.participants),
                            loss=_fmt(row.loss, ".4f"), accuracy=_fmt(row.accuracy, ".4f"))

        console.print(expected_duration(config).describe())
        report = run(config, on_round=on_round, on_prefill=on_prefill)
    console.print(summary_table(report))
    if report.devices:
        from seedfed.personal_report import devices_table

        console.print(devices_table(report.devices))
    ratio = report.upload_ratio()
    per_device = [r.upload_bytes_per_device for r in report.rounds if r.participants]
    if per_device and ratio is not None:
        mean = sum(per_device) / len(per_device)
        console.print(
            f"upload per device per round: {mean:,.0f} B for {report.scalars_per_device} "
            f"scalars (budget {report.upload_budget_bytes_per_device:,} B); FedAvg would send "
            f"{4 * report.scope_numel:,} B: {ratio_words(ratio)}")
    console.print(f"final version v{report.final_version}, checksum "
                  f"{report.final_checksum[:16]}..., {report.wall_seconds:.0f} s; run directory "
                  f"{config.out}")
    console.print(f"score it: seedfed evaluate --run {config.out} --data "
                  f"{config.out / 'test.tsv'}")
    return report


def summary_table(report: Report) -> Any:
    from rich.table import Table

    table = Table(title="seedfed simulate", caption=(
        f"up/dev: bytes one device uploaded (FedAvg: {4 * report.scope_numel:,}); "
        "down: all train + sync messages"))
    for name in ("round", "v", "devices", "loss", "test acc", "local acc", "up/dev B",
                 "down B", "s"):
        table.add_column(name, justify="right", no_wrap=True)
    if report.initial_accuracy is not None:
        table.add_row("0", "0", "-", "-", _fmt(report.initial_accuracy, ".3f"), "-", "-", "-",
                      "-")
    for r in report.rounds:
        table.add_row(str(r.round), str(r.version), str(r.participants), _fmt(r.loss, ".3f"),
                      _fmt(r.accuracy, ".3f"), _fmt(r.local_accuracy, ".3f"),
                      f"{r.upload_bytes_per_device:.0f}", f"{r.download_bytes:,}",
                      f"{r.seconds:.1f}")
    return table
