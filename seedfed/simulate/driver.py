"""`seedfed simulate`: a coordinator and a fleet of virtual devices, driven by the ServerApp's
strategy.

The glue above both sides: it opens a coordinator (SQLite in the run directory by default),
creates the task, and runs the ServerApp strategy (`SeedfedStrategy`, the one round loop of
every deployment) against N virtual devices running the ClientApp, delivered by one of two
engines: Flower's Simulation Engine (`engine="flower"`, a Ray actor per CPU) or the in-process
grid (`engine="inprocess"`, `seedfed.inprocess`: the same messages, no transport, for fleets
whose device work is milliseconds and for the accuracy benchmark). After every round it scores
the committed version on a held-out test split (the devices never see it) and updates a
progress bar (`seedfed.simulate.progress`). At the end the run directory holds `report.json`,
`report.png` (`seedfed.simulate.report`), `task.json` and `snapshots/v{N}.safetensors`, which
`seedfed evaluate --run DIR` scores. The task is the run's recipe with its overrides
(`seedfed.simulate.config`); scoring is `seedfed.simulate.scoring`.

Any fleet size: a file's partition is computed once per process (`device_data.fleet_shares`,
every device >= 2 examples), a round costs what its sampled devices do (their Contexts, their
sync phase), and a round in which every sampled device fails stops the run with the first
failure (`FleetFailedError`, a non-zero exit) instead of planning it again and again.

Personalization (docs/personalization.md): every device keeps a personal part
(`--set personal=...`, default `residual`; `off` for none) and reports in the sync phase its
held-out accuracy with the shared model, with shared + personal, and with a local-only head.
The default data is the per-device taste task (`tastes`, client/tastes.py); `report.json`'s
`devices` lists the three accuracies of the devices of the last sync phase and the PNG plots
them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from seedfed.shared.protocol.task import TaskSpec
from seedfed.simulate.config import (
    SimulationConfig,
    data_splits,
    device_data,
    label_texts,
    simulation_secret,
    task_spec_for,
)
from seedfed.simulate.report import Report, RoundRow, metric_name
from seedfed.simulate.scoring import Evaluator, RoundScorer

log = logging.getLogger(__name__)

#: Seconds the Simulation Engine's grid sleeps between polls for the devices' replies. Flower's
#: default (0.1 s) suits real fleets; a simulated phase whose devices answer in milliseconds
#: would wait on it for most of the phase (docs/performance.md, section 5).
PULL_INTERVAL_S = 0.005


def run(config: SimulationConfig, on_round: Callable[[RoundRow, int], None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None) -> Report:
    """Run the whole simulation; returns the report (also written to the run directory).
    `on_round(row, rounds)` after every round; `on_prefill(done, total)` as the fleet's
    sentences are encoded into the feature store before round 1."""
    quiet_transformers()
    from seedfed.device_times import DEVICE_TIMES, DeviceTimes
    from seedfed.features import SharedFeatures, store_root
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.flower_strategy import FleetConfig, SeedfedStrategy
    from seedfed.server.settings import Settings

    started = time.perf_counter()
    out = config.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    splits = data_splits(config)
    spec = task_spec_for(config, label_texts(config.data, splits.train.num_labels))
    held = splits.validation if config.eval_on_validation else splits.test
    test = held.subset(range(min(config.eval_size, len(held))))
    settings = Settings(database_url=config.db or f"sqlite:///{out / 'coordinator.db'}",
                        store_dir=out / "store")
    coordinator = Coordinator.open(settings)
    try:
        task_id = coordinator.create_task(spec, name=f"simulate-{out.name}",
                                          quorum=1, round_timeout_s=config.round_timeout_s,
                                          devices_per_round=config.devices_per_round,
                                          secret=simulation_secret(config.seed,
                                                                   config.training_run))
        status = coordinator.task_status(task_id)
        (out / "task.json").write_text(json.dumps(spec.to_dict(), indent=2))
        write_tsv(out / "test.tsv", splits.test)  # `seedfed evaluate --run DIR --data` this
        report = new_report(config, spec, task_id, int(status.scope_numel))
        fleet = FleetConfig.from_status(status, min_devices=config.devices,
                                        sync_after_round=config.sync_after_round,
                                        sync_every=config.sync_every or config.eval_every,
                                        final_round=config.rounds, sample_seed=config.seed,
                                        stop_when_all_fail=True)
        strategy = SeedfedStrategy(coordinator, task_id, fleet)
        features = SharedFeatures(store_root(config.feature_cache, out))
        evaluator = Evaluator(spec, test, features) if len(test) else None
        evaluate_fn = RoundScorer(config, report, coordinator, task_id, strategy, evaluator,
                                   on_round, DeviceTimes(out / DEVICE_TIMES))
        if config.engine == "flower" and prefills(config):
            # before round 1: none of it counts against a timeout
            from seedfed.client.device_data import fleet_texts
            from seedfed.features import prefill

            prefill(features, spec, fleet_texts(device_data(config)), config.cpus, on_prefill)
        with quiet_flower():
            drive(config, strategy, evaluate_fn, features)
        final = coordinator.task_status(task_id)
        report.final_version, report.final_checksum = final.version, final.checksum
        # in the format devices load (a ternary task: the packed snapshot, which alone
        # rebuilds the model; `seedfed evaluate --run` reads either)
        data, chk = coordinator.snapshot(task_id, final.version,
                                         "ternary" if spec.scope == "ternary" else None)
        snaps = out / "snapshots"
        snaps.mkdir(exist_ok=True)
        (snaps / f"v{final.version}.safetensors").write_bytes(data)
        (snaps / f"v{final.version}.sha256").write_text(chk + "\n")
    finally:
        coordinator.close()
    report.wall_seconds = time.perf_counter() - started
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2))
    from seedfed.simulate.report import plot  # matplotlib is imported inside

    plot(report, out / "report.png")
    return report


def new_report(config: SimulationConfig, spec: TaskSpec, task_id: str,
                scope_numel: int) -> Report:
    steps, perturbations = spec.largest_plan()  # alternate epochs: the larger of the two
    per_device = steps * perturbations
    k = config.devices_per_round or config.devices
    return Report(config={k_: str(v) if isinstance(v, Path) else v
                          for k_, v in asdict(config).items()},
                  task_id=task_id, scope_numel=scope_numel, scalars_per_device=per_device,
                  fedavg_bytes_per_round=2 * 4 * scope_numel * k,
                  upload_budget_bytes_per_device=4 * per_device + 256,
                  metric=metric_name(str(spec.objective.kind)))


def write_tsv(path: Path, examples: Any) -> None:
    lines = ["label\tsentence"]
    lines += [f"{int(y)}\t{' '.join(t.split())}" for t, y in zip(examples.texts, examples.labels,
                                                                strict=True)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def prefills(config: SimulationConfig) -> bool:
    """Whether the Simulation Engine's run encodes the fleet's sentences before round 1: when
    the run is likely to sample most devices (1 - (1 - k/n)^rounds >= 1/2), so that the
    encoding is needed anyway and round 1 would otherwise pay for most of it. A large fleet
    sampled for a few rounds leaves it to the devices: a round then encodes only its own
    devices' sentences, a cost of the devices per round, not of the fleet."""
    per_round = config.devices_per_round or config.devices
    return 1 - (1 - per_round / config.devices) ** config.rounds >= 0.5


def drive(config: SimulationConfig, strategy: Any, evaluate_fn: RoundScorer,
           features: Any = None) -> None:
    """Run `config.rounds` rounds of the strategy against the fleet, on the chosen engine;
    `features`: the feature store the devices' processes share (None: none)."""
    from flwr.app import ArrayRecord

    from seedfed.client.flower_app import make_client_app
    from seedfed.client.personal import PersonalConfig

    client_app = make_client_app(device_data(config), PersonalConfig(method=config.personal),
                                 features, config.device)
    if evaluate_fn.times is not None:
        from seedfed.device_times import TimedClientApp

        client_app = TimedClientApp(client_app, evaluate_fn.times.path)
    if config.engine == "inprocess":
        from seedfed.inprocess import InProcessGrid

        grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": config.devices}
                                          for i in range(config.devices)])
        strategy.start(grid, ArrayRecord(), num_rounds=config.rounds,
                       timeout=config.round_timeout_s, evaluate_fn=evaluate_fn)
        return
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    server_app = ServerApp()
    failed: list[BaseException] = []

    @server_app.main()
    def _main(grid: Grid, context: Any) -> None:
        if hasattr(grid, "pull_interval"):  # the Simulation Engine's InMemoryGrid
            grid.pull_interval = PULL_INTERVAL_S
        try:
            strategy.start(grid, ArrayRecord(), num_rounds=config.rounds,
                           timeout=config.round_timeout_s, evaluate_fn=evaluate_fn)
        except BaseException as e:
            failed.append(e)  # the engine logs a ServerApp's exception and returns normally
            raise

    gpus, per_actor = ray_gpus(config.device, config.cpus)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": per_actor},
               "init_args": {"num_cpus": config.cpus, "num_gpus": gpus,
                             "object_store_memory": 256 * 1024 * 1024,
                             # workers' model-loading chatter stays out of the progress bar
                             "logging_level": "ERROR", "log_to_driver": False}}
    run_simulation(server_app=server_app, client_app=client_app,
                   num_supernodes=config.devices, backend_config=backend)  # type: ignore[arg-type]
    if failed:
        raise failed[0]


def ray_gpus(device: str, actors: int) -> tuple[int, float]:
    """The GPUs the Simulation Engine gets and each actor's share, for devices on `device`.
    Ray hides every GPU from an actor that asks for none, so CUDA devices ask for a share:
    the `actors` actors (one per CPU) split the machine's GPUs."""
    if device == "cpu":
        return 0, 0.0
    import torch

    if device == "auto" and not torch.cuda.is_available():
        return 0, 0.0
    gpus = torch.cuda.device_count()
    return gpus, min(1.0, gpus / max(1, actors))


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class quiet_flower:
    """Flower logs every message exchange at INFO; the progress bar says what matters."""

    def __enter__(self) -> None:
        self._logger = logging.getLogger("flwr")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
