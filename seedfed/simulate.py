"""`seedfed simulate`: a coordinator and a fleet of virtual devices, driven by the ServerApp's
strategy.

The glue above both sides: it opens a coordinator (SQLite in the run directory by default),
creates the task, and runs the ServerApp strategy (`SeedfedStrategy`, the one round loop of
every deployment) against N virtual devices running the ClientApp, delivered by one of two
engines: Flower's Simulation Engine (`engine="flower"`, a Ray actor per CPU) or the in-process
grid (`engine="inprocess"`, `seedfed.inprocess`: the same messages, no transport, for fleets
whose device work is milliseconds and for the accuracy benchmark). After every round it scores
the committed version on a held-out test split (the devices never see it) and updates a
progress bar. At the end the run directory holds `report.json`, `report.png` (`seedfed.report`),
`task.json` and `snapshots/v{N}.safetensors`, which `seedfed evaluate --run DIR` scores.

Any fleet size: a file's partition is computed once per process (`device_data.fleet_shares`,
every device >= 2 examples), a round costs what its sampled devices do (their Contexts, their
sync phase), and a round in which every sampled device fails stops the run with the first
failure (`FleetFailedError`, a non-zero exit) instead of planning it again and again.

Personalization (docs/personalization.md): every device keeps a personal part
(`--personal`, default `residual`; `off` for none) and reports in the sync phase its held-out
accuracy with the shared model, with shared + personal, and with a local-only head. The default
data is the per-device taste task (`tastes`, client/tastes.py); `report.json`'s `devices` lists
the three accuracies of the devices of the last sync phase and the PNG plots them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from seedfed.personal_report import DeviceRow, fleet_accuracy
from seedfed.report import Report, RoundRow
from seedfed.shared.protocol.scope_options import options_for
from seedfed.shared.protocol.task import Hyper, TaskSpec

log = logging.getLogger(__name__)

DEFAULT_DATA = "builtin"
#: The per-device taste task (client.tastes.TASTES): the default of `seedfed simulate`.
TASTES = "tastes"
#: Built-in sources whose recipe and label texts are the preference task's.
PREFERENCE_SOURCES: tuple[str, ...] = (DEFAULT_DATA, TASTES)
ENGINES: tuple[str, ...] = ("flower", "inprocess")
#: Seconds the Simulation Engine's grid sleeps between polls for the devices' replies. Flower's
#: default (0.1 s) suits real fleets; a simulated phase whose devices answer in milliseconds
#: would wait on it for most of the phase (docs/performance.md, section 5).
PULL_INTERVAL_S = 0.005


@dataclass(frozen=True)
class SimulationConfig:
    out: Path
    devices: int = 10
    rounds: int = 30
    steps: int | None = None  # None: the recipe's
    perturbations: int | None = None
    model: str | None = None  # a local Hugging Face directory; None: pretrained MiniLM
    # "tastes" (per-device tastes), "builtin" (one owner's taste) or a TSV/JSONL path
    data: str = TASTES
    alpha: float = 0.5
    scope: str = "head"  # "head" (the recipe's head-only scope), "lora", "full", ...
    seed: int = 0
    #: Independent training runs of one fleet (a benchmark's repeats): another task secret, so
    #: other round seeds; the data, split and partition stay those of `seed`.
    training_run: int = 0
    db: str | None = None  # database URL; None: SQLite in the run directory
    devices_per_round: int | None = None
    lr: float | None = None  # None: the task default for the dataset
    eps: float | None = None
    batch_size: int | None = None
    eval_size: int = 400  # held-out test examples scored after every round
    # CPUs the Simulation Engine may use: one Ray actor (virtual device at a time) per core
    cpus: int = field(default_factory=lambda: os.cpu_count() or 2)
    sync_after_round: bool = True
    round_timeout_s: float = 600.0
    engine: str = "flower"  # "flower" (Simulation Engine) or "inprocess" (seedfed.inprocess)
    pool: int = 0  # > 0: the fleet shares this many training examples (DeviceData.pool)
    eval_every: int = 10  # score the held-out split every this many rounds (and the last)
    # run the devices' sync phase (catch up, verify the checksum, score the local held-out
    # set) every this many rounds and the last; None: with the scoring (`eval_every`), the
    # rounds whose report row has accuracies. In between a device replays the entry it
    # missed with its next plan, to the same bits (the feature cache's rows do not depend on
    # when a sentence was first encoded: shared.models.FEATURE_GROUP), so the final checksum
    # is the same for any value; a phase costs a round trip to every device
    sync_every: int | None = None
    eval_on_validation: bool = False  # score the validation split (tuning) instead of test
    format: str | None = None  # published format (fp32, int8, int4, ...); None: the recipe's
    #: overrides of the scope's options (e.g. a ternary mask's selection, fraction); None: none
    scope_options: dict[str, Any] | None = None
    #: (substring, c_t) step scales (`TaskSpec.step_scales`); None: the recipe's
    step_scales: tuple[tuple[str, float], ...] | None = None
    personal: str = "residual"  # each device's personal part (client.personal); "off": none
    label_skew: float = 0.0  # > 0: label-skewed split of a file (DeviceData.label_skew)
    #: where encoded sentence features are kept (seedfed.features.store_root): "auto" (the
    #: user's cache, shared by every run: a repeated run skips the encoding), "run" (this run's
    #: directory only) or a directory
    feature_cache: str = "auto"

    def __post_init__(self) -> None:
        from seedfed.client.personal import METHODS

        if self.personal not in METHODS:
            raise ValueError(f"personal must be one of {METHODS}, got {self.personal!r}")
        if not self.feature_cache:
            raise ValueError("feature_cache must be 'auto', 'run' or a directory")
        if not 0 <= self.label_skew < 1:
            raise ValueError(f"label_skew must be in [0, 1), got {self.label_skew}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        for name in ("devices", "rounds", "steps", "perturbations", "cpus", "eval_every",
                     "sync_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.alpha > 0:
            raise ValueError(f"Dirichlet alpha must be positive, got {self.alpha}")
        if self.eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {self.eval_size}")
        if self.devices_per_round is not None and not 1 <= self.devices_per_round <= self.devices:
            raise ValueError(f"devices_per_round must be in [1, {self.devices}], got "
                             f"{self.devices_per_round}")


def task_spec_for(config: SimulationConfig, label_texts: tuple[str, ...]) -> TaskSpec:
    """The task a simulation trains: the measured recipe (client/recipes.py) for the data,
    with the command line's overrides. `--scope head` is the recipe's head-only scope; any
    other scope name is a scope of shared.scopes with the conservative task defaults for lr
    and eps."""
    base = _recipe(config.data, config.model, config.format or "fp32", config.scope).spec
    scope, options, hyper = base.scope, base.scope_options, base.hyper
    step_scales = base.step_scales
    if config.scope not in RECIPE_SCOPES:
        # the recipe's lr/eps and step scales were tuned for its scope (a head-sized lr
        # makes LoRA diverge, and its scales name the recipe's tensors): other scopes
        # start from the conservative task defaults unless told otherwise
        scope, options, step_scales = config.scope, options_for(config.scope), ()
        hyper = replace(hyper, lr=Hyper().lr, eps=Hyper().eps, decay_rounds=None)
    if config.scope_options:
        options = options_for(scope, {**options.to_dict(), **config.scope_options})
    if config.step_scales is not None:
        step_scales = tuple((str(p), float(c)) for p, c in config.step_scales)
    given = {"lr": config.lr, "eps": config.eps, "batch_size": config.batch_size,
             "steps": config.steps, "perturbations": config.perturbations}
    hyper = replace(hyper, **{k: v for k, v in given.items() if v is not None})
    if hyper.decay_rounds is not None:
        # the recipe's schedule spans the run, however many rounds it is given
        hyper = replace(hyper, decay_rounds=config.rounds)
    return replace(base, label_texts=label_texts, num_labels=len(label_texts), scope=scope,
                   scope_options=options, hyper=hyper, format=config.format or base.format,
                   step_scales=step_scales)


#: `--scope` values that name a recipe's own scope rather than a scope of shared.scopes.
RECIPE_SCOPES = ("head", "body")
#: Rounds and fleet size of a run whose scope has no measured recipe.
DEFAULT_ROUNDS, DEFAULT_DEVICES = 30, 10


def _recipe(data: str, model: str | None, fmt: str, scope: str = "head") -> Any:
    from seedfed.client import recipes

    if scope == "body" and (fmt == "ternary" or data in PREFERENCE_SOURCES or data == TASTES):
        raise ValueError("--scope body is the SST-2 recipe's body scope (LoRA on MiniLM's top "
                         "FFN output; fp32, int8, int4): give --data a labelled TSV/JSONL, or "
                         "name a scope (lora, named, ...) for this task")
    if fmt == "ternary":  # TerMeZO on a ternary (BitLinear) classifier
        return recipes.ternary_recipe(model, sst2=data not in PREFERENCE_SOURCES)
    if data in PREFERENCE_SOURCES:
        base = (recipes.tastes_recipe if data == TASTES else recipes.preference_recipe)(model)
        return replace(base, spec=replace(base.spec, format=fmt))
    return recipes.sst2_recipe(model, fmt=fmt, scope="body" if scope == "body" else "head")


def recipe_fleet(data: str, model: str | None, fmt: str | None, scope: str = "head",
                 ) -> tuple[int, int | None]:
    """(rounds, devices per round) when the command line names neither: the measured recipe's
    for the data, format and scope (client/recipes.py): a labelled file runs the SST-2
    recipe's 300 rounds of 20 devices, the taste task its 30 of 20, the body and ternary
    recipes theirs. A scope of shared.scopes (`--scope lora`, ...) has no recipe: 30 rounds
    with every device."""
    if scope not in RECIPE_SCOPES and fmt != "ternary":
        return DEFAULT_ROUNDS, None
    r = _recipe(data, model, fmt or "fp32", scope)
    return r.rounds, r.per_round


def recipe_devices(data: str, model: str | None = None, fmt: str | None = None,
                   scope: str = "head") -> int:
    """The fleet size when the command line gives none: the measured recipe's (10 for a
    scope without a recipe)."""
    if scope not in RECIPE_SCOPES and fmt != "ternary":
        return DEFAULT_DEVICES
    return _recipe(data, model, fmt or "fp32", scope).devices


class Evaluator:
    """Scores committed versions on the held-out test split, outside the fleet."""

    def __init__(self, spec: TaskSpec, examples: Any, features: Any = None) -> None:
        """`features`: the run's shared feature store (None: the evaluator's own cache)."""
        from seedfed.shared.model.models import build_model, expect_texts, share_features

        self.examples = examples
        self.packed: Any = None
        #: The snapshot format scored: a ternary task is scored as its devices hold it (the
        #: packed model from the published ternary snapshot), every other on the fp32 state.
        self.fmt: str | None = None
        if spec.scope == "ternary":
            from seedfed.client.ternary import SNAPSHOT_FORMAT, PackedTernary

            self.packed, self.fmt = PackedTernary(spec), SNAPSHOT_FORMAT
        else:
            self.bundle = build_model(spec, initialize=False)
            share_features(self.bundle.model, features)
            # the held-out texts fill the feature cache's canonical groups (speed only)
            expect_texts(self.bundle.model, self.bundle.tokenizer, examples.texts,
                         spec.max_seq_len)

    def __call__(self, snapshot: bytes, chk: str, version: int = 0) -> float:
        from seedfed.client.evaluate import accuracy
        from seedfed.client.sync import load_state

        if self.packed is not None:
            self.packed.load_snapshot(snapshot, version, chk)
            return accuracy(self.packed.bundle, self.examples).accuracy
        load_state(self.bundle.scope, snapshot, chk)
        return accuracy(self.bundle, self.examples).accuracy

    def score(self, coordinator: Any, task_id: str, version: int) -> float:
        """Accuracy of the coordinator's `version` of the task."""
        data, chk = coordinator.snapshot(task_id, version, self.fmt)
        return self(data, chk, version)


def _data_splits(config: SimulationConfig) -> Any:
    if config.data == TASTES:
        # no common split: the shared model's own test set is every device's held-out set
        # pooled (the devices never train on it), its validation set a disjoint draw
        from seedfed.client import data as data_mod
        from seedfed.client import tastes

        per = tastes.HELD_OUT_PER_DEVICE
        return data_mod.Splits(
            train=tastes.pooled_examples(config.seed, config.devices, per, validation=True),
            validation=tastes.pooled_examples(config.seed, config.devices, per,
                                              validation=True),
            test=tastes.pooled_examples(config.seed, config.devices, per))
    from seedfed.client.device_data import dataset_splits

    return dataset_splits(config.data)


def _write_tsv(path: Path, examples: Any) -> None:
    lines = ["label\tsentence"]
    lines += [f"{int(y)}\t{' '.join(t.split())}" for t, y in zip(examples.texts, examples.labels,
                                                                strict=True)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _label_texts(data: str, num_labels: int) -> tuple[str, ...]:
    if data in PREFERENCE_SOURCES:
        from seedfed.client import preference

        return tuple(preference.PREFERENCE_LABEL_TEXTS)
    if num_labels == 2:
        from seedfed.client.recipes import SST2_LABEL_TEXTS

        return SST2_LABEL_TEXTS
    return tuple(f"class {i}" for i in range(num_labels))


def simulation_secret(seed: int, training_run: int = 0) -> str:
    """The task secret of a simulation with `--seed seed`: every round's seeds derive from it,
    so two runs with one seed train the same seeds and end on the same checksum. Only a
    simulation does this; a real coordinator draws a fresh random secret per task (whoever
    knows it can predict every round's seeds and DP noise)."""
    name = f"seedfed-simulate/{seed}" + (f"/run-{training_run}" if training_run else "")
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def run(config: SimulationConfig, on_round: Callable[[RoundRow, int], None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None) -> Report:
    """Run the whole simulation; returns the report (also written to the run directory).
    `on_round(row, rounds)` after every round; `on_prefill(done, total)` as the fleet's
    sentences are encoded into the feature store before round 1."""
    _quiet_transformers()
    from seedfed.device_times import DEVICE_TIMES, DeviceTimes
    from seedfed.features import SharedFeatures, store_root
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.flower_strategy import FleetConfig, SeedfedStrategy
    from seedfed.server.settings import Settings

    started = time.perf_counter()
    out = config.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    splits = _data_splits(config)
    spec = task_spec_for(config, _label_texts(config.data, splits.train.num_labels))
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
        _write_tsv(out / "test.tsv", splits.test)  # `seedfed evaluate --run DIR --data` this
        report = _new_report(config, spec, task_id, int(status.scope_numel))
        fleet = FleetConfig.from_status(status, min_devices=config.devices,
                                        sync_after_round=config.sync_after_round,
                                        sync_every=config.sync_every or config.eval_every,
                                        final_round=config.rounds, sample_seed=config.seed,
                                        stop_when_all_fail=True)
        strategy = SeedfedStrategy(coordinator, task_id, fleet)
        features = SharedFeatures(store_root(config.feature_cache, out))
        evaluator = Evaluator(spec, test, features) if len(test) else None
        evaluate_fn = _RoundScorer(config, report, coordinator, task_id, strategy, evaluator,
                                   on_round, DeviceTimes(out / DEVICE_TIMES))
        if config.engine == "flower" and _prefills(config):
            # before round 1: none of it counts against a timeout
            from seedfed.client.device_data import fleet_texts
            from seedfed.features import prefill

            prefill(features, spec, fleet_texts(_device_data(config)), config.cpus, on_prefill)
        with _quiet_flower():
            _drive(config, strategy, evaluate_fn, features)
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
    from seedfed.report import plot  # matplotlib is imported inside

    plot(report, out / "report.png")
    return report


def _new_report(config: SimulationConfig, spec: TaskSpec, task_id: str,
                scope_numel: int) -> Report:
    steps, perturbations = spec.largest_plan()  # alternate epochs: the larger of the two
    per_device = steps * perturbations
    k = config.devices_per_round or config.devices
    return Report(config={k_: str(v) if isinstance(v, Path) else v
                          for k_, v in asdict(config).items()},
                  task_id=task_id, scope_numel=scope_numel, scalars_per_device=per_device,
                  fedavg_bytes_per_round=2 * 4 * scope_numel * k,
                  upload_budget_bytes_per_device=4 * per_device + 256)


class _RoundScorer:
    """The strategy's `evaluate_fn`: scores the committed version on the held-out split after
    every round (round 0: version 0) and turns the strategy's record into a report row."""

    def __init__(self, config: SimulationConfig, report: Report, coordinator: Any,
                 task_id: str, strategy: Any, evaluator: Evaluator | None,
                 on_round: Callable[[RoundRow, int], None] | None,
                 times: Any = None) -> None:
        self.config, self.report, self.coordinator = config, report, coordinator
        self.times = times
        self.task_id, self.strategy, self.evaluator = task_id, strategy, evaluator
        self.on_round = on_round
        self.round_started = time.perf_counter()

    def __call__(self, server_round: int, _arrays: Any) -> Any:
        from flwr.app import MetricRecord

        acc = None
        due = server_round % self.config.eval_every == 0 or server_round == self.config.rounds
        if self.evaluator is not None and due:
            st = self.coordinator.task_status(self.task_id)
            acc = self.evaluator.score(self.coordinator, self.task_id, st.version)
        if server_round == 0:
            self.report.initial_accuracy = acc
            row = RoundRow(0, 0, 0, None, acc, 0, 0, 0.0, None, 0.0)
        else:
            rec = self.strategy.history[-1]
            row = RoundRow(round=rec.round, version=rec.version, participants=rec.participants,
                           loss=rec.loss, accuracy=acc, upload_bytes=rec.upload_bytes,
                           download_bytes=rec.download_bytes,
                           upload_bytes_per_device=(rec.upload_bytes / rec.participants
                                                    if rec.participants else 0.0),
                           local_accuracy=rec.local_accuracy,
                           seconds=time.perf_counter() - self.round_started,
                           device_compute_s=None if self.times is None else self.times.take())
            fleet_accuracy(row, rec.device_accuracy)
            self.report.rounds.append(row)
            self.report.device_checksums = {str(n): c for n, c in rec.device_checksums.items()}
            if rec.device_accuracy:
                self.report.devices = [DeviceRow(n, *acc) for n, acc
                                       in sorted(rec.device_accuracy.items())]
        self.round_started = time.perf_counter()
        if self.on_round is not None:
            self.on_round(row, self.config.rounds)
        return None if acc is None else MetricRecord({"accuracy": acc})


def _device_data(config: SimulationConfig) -> Any:
    """The fleet's data settings (each device adds its partition id)."""
    from seedfed.client.device_data import DeviceData

    return DeviceData(source=config.data, alpha=config.alpha, seed=config.seed,
                      num_partitions=config.devices, pool=config.pool,
                      label_skew=config.label_skew)


def _prefills(config: SimulationConfig) -> bool:
    """Whether the Simulation Engine's run encodes the fleet's sentences before round 1: when
    the run is likely to sample most devices (1 - (1 - k/n)^rounds >= 1/2), so that the
    encoding is needed anyway and round 1 would otherwise pay for most of it. A large fleet
    sampled for a few rounds leaves it to the devices: a round then encodes only its own
    devices' sentences, a cost of the devices per round, not of the fleet."""
    per_round = config.devices_per_round or config.devices
    return 1 - (1 - per_round / config.devices) ** config.rounds >= 0.5


def _drive(config: SimulationConfig, strategy: Any, evaluate_fn: _RoundScorer,
           features: Any = None) -> None:
    """Run `config.rounds` rounds of the strategy against the fleet, on the chosen engine;
    `features`: the feature store the devices' processes share (None: none)."""
    from flwr.app import ArrayRecord

    from seedfed.client.flower_app import make_client_app
    from seedfed.client.personal import PersonalConfig

    client_app = make_client_app(_device_data(config), PersonalConfig(method=config.personal),
                                 features)
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

    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": config.cpus, "num_gpus": 0,
                             "object_store_memory": 256 * 1024 * 1024,
                             # workers' model-loading chatter stays out of the progress bar
                             "logging_level": "ERROR", "log_to_driver": False}}
    run_simulation(server_app=server_app, client_app=client_app,
                   num_supernodes=config.devices, backend_config=backend)  # type: ignore[arg-type]
    if failed:
        raise failed[0]


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class _quiet_flower:
    """Flower logs every message exchange at INFO; the progress bar says what matters."""

    def __enter__(self) -> None:
        self._logger = logging.getLogger("flwr")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def expected_duration(config: SimulationConfig) -> Any:
    """`seedfed.estimate.DurationEstimate` of the run, measured on this machine before it
    starts (one device step of each of the task's plans, the personal part and the scoring,
    scaled; the encoding the feature cache lacks)."""
    from seedfed.estimate import estimate_duration, evaluations
    from seedfed.features import SharedFeatures, store_root

    splits = _data_splits(config)
    spec = task_spec_for(config, _label_texts(config.data, splits.train.num_labels))
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
        sentences=_sentences_encoded(config), personal=config.personal,
        syncs=syncs if config.sync_after_round else 0,
        store=SharedFeatures(store_root(config.feature_cache, config.out.resolve())),
        time_coordinator=True, engine=config.engine)


def _sentences_encoded(config: SimulationConfig) -> int:
    """The fleet's sentences a run needs encoded: all of them where it prefills or is likely
    to sample most devices, else those of the devices it is expected to sample."""
    from seedfed.client import tastes
    from seedfed.client.device_data import fleet_texts

    data = _device_data(config)
    if config.data == TASTES:  # every device generates its own: one device's, times the fleet
        fleet = sum(len(x) for x in tastes.device_examples(config.seed, 0)) * config.devices
    else:
        fleet = len(fleet_texts(data))
    per_round = config.devices_per_round or config.devices
    sampled = 1 - (1 - per_round / config.devices) ** config.rounds
    return fleet if config.engine == "flower" and _prefills(config) else round(fleet * sampled)


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


def score_version(run_dir: Path, version: int, data: str | Path | None = None,
                  limit: int | None = None) -> Any:
    """`seedfed evaluate --run DIR --version V`: score version V (0: the base the fleet
    started from) of a simulation's task, read from the run's own coordinator (its database
    and model store), in the format its devices load; `data` defaults to the run's test.tsv."""
    from seedfed.client.data import load_labelled
    from seedfed.client.evaluate import Score
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings

    run_dir = Path(run_dir)
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
        spec = TaskSpec.from_dict(json.loads((run_dir / "task.json").read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError) as e:
        raise FileNotFoundError(f"{run_dir} is not a finished simulation run: {e}") from e
    examples = load_labelled(data or run_dir / "test.tsv")
    if limit is not None:
        examples = examples.subset(range(min(limit, len(examples))))
    db = report.get("config", {}).get("db") or f"sqlite:///{run_dir.resolve() / 'coordinator.db'}"
    coordinator = Coordinator.open(Settings(database_url=db, store_dir=run_dir.resolve() / "store"))
    try:
        latest = coordinator.task_status(report["task_id"]).version
        if not 0 <= version <= latest:
            raise ValueError(f"version {version} is not in 0..{latest} (the run's versions)")
        acc = Evaluator(spec, examples).score(coordinator, report["task_id"], version)
    finally:
        coordinator.close()
    return Score(acc, len(examples), round(acc * len(examples)))
