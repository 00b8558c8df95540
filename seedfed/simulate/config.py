"""The typed configuration of `seedfed simulate`, validated, and the task and data it names.

A run names a recipe (`seedfed.shared.protocol.recipes`; default: the one for its data), a
scope only where it trains another one, and overrides of the recipe's TaskSpec fields and
scope options (`overrides`, `parse_set`'s qualified keys). The fleet settings left unset
(devices, rounds, devices per round, Dirichlet alpha) are the recipe's, filled in when the
config is made, so a config always holds the numbers the run uses (and `report.json` says).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seedfed.client.backends.base import BackendConfig
from seedfed.shared.protocol.recipes import (
    PREFERENCE_LABEL_TEXTS,
    SST2_LABEL_TEXTS,
    Resolved,
    lm_counterpart,
    parse_set,
    resolve_recipe,
)
from seedfed.shared.protocol.recipes import recipe as named
from seedfed.shared.protocol.task import TaskSpec

DEFAULT_DATA = "builtin"
#: The per-device taste task (client.tastes.TASTES): the default of `seedfed simulate`.
TASTES = "tastes"
#: Built-in sources whose label texts are the preference task's.
PREFERENCE_SOURCES: tuple[str, ...] = (DEFAULT_DATA, TASTES)
ENGINES: tuple[str, ...] = ("flower", "inprocess")
#: The `--set` section of a simulation's own settings (`run.eval_size`, or `eval_size`).
SETTINGS = "run"
#: The value of a fleet setting (devices, rounds, devices_per_round, alpha) that means "the
#: recipe's": a config holds the recipe's number there once made.
RECIPE = 0
#: Fields given by their own options or by the recipe, not by `--set`.
NOT_SET = ("out", "recipe", "overrides", "scope", "model")


def default_recipe(data: str, fmt: str | None = None) -> str:
    """The recipe a run without `--recipe` trains: the one measured for its data (and for a
    ternary format, the ternary recipe with the data's labels)."""
    if fmt == "ternary":
        return "ternary-tastes" if data in PREFERENCE_SOURCES else "ternary"
    if data == TASTES:
        return "tastes"
    return "preference" if data == DEFAULT_DATA else "sst2"


@dataclass(frozen=True)
class SimulationConfig:
    out: Path = field(metadata={"help": "run directory"})
    #: a recipe of `seedfed.shared.protocol.recipes`; None: `default_recipe(data, format)`
    recipe: str | None = None
    #: TaskSpec and scope-option overrides: `parse_set`'s qualified keys and typed values
    overrides: tuple[tuple[str, Any], ...] = ()
    #: a scope other than the recipe's (`head`, `lora`, `full`, ...); None: the recipe's
    scope: str | None = None
    model: str | None = None  # a local Hugging Face directory; None: pretrained MiniLM
    format: str | None = field(default=None, metadata={
        "help": "published format (fp32, int8, int4, ternary, ...); None: the recipe's"})
    # the fleet: RECIPE (0) is the recipe's, filled in when the config is made
    devices: int = field(default=RECIPE, metadata={
        "help": "virtual devices (default: the recipe's)"})
    rounds: int = field(default=RECIPE, metadata={"help": "rounds (default: the recipe's)"})
    devices_per_round: int | None = field(default=RECIPE, metadata={
        "help": "devices sampled per round (default: the recipe's, at most --devices; none: "
                "every device)"})
    alpha: float = field(default=RECIPE, metadata={
        "help": "Dirichlet alpha of the non-IID split (default: the recipe's)"})
    data: str = field(default=TASTES, metadata={
        "help": "tastes (per-device tastes), builtin (one owner's taste) or a TSV/JSONL path"})
    seed: int = field(default=0, metadata={
        "help": "seed of the data split, the task secret and the sampling"})
    #: Independent training runs of one fleet (a benchmark's repeats): another task secret, so
    #: other round seeds; the data, split and partition stay those of `seed`.
    training_run: int = field(default=0, metadata={"help": "another task secret, same data"})
    db: str | None = field(default=None, metadata={
        "help": "coordinator database URL (default: SQLite in the run directory)"})
    eval_size: int = field(default=400, metadata={
        "help": "held-out test examples scored"})
    #: CPUs the Simulation Engine may use: one Ray actor (virtual device at a time) per core
    cpus: int = field(default_factory=lambda: os.cpu_count() or 2, metadata={
        "help": "CPUs for the Simulation Engine (default: every core)"})
    sync_after_round: bool = field(default=True, metadata={
        "help": "run the devices' sync phase"})
    round_timeout_s: float = field(default=600.0, metadata={"help": "seconds a round may take"})
    device: str = field(default="auto", metadata={
        "help": "where the devices' torch backend runs: auto (cuda when torch sees one, else "
                "cpu), cpu, cuda or cuda:N"})
    engine: str = field(default="flower", metadata={
        "help": "flower (Simulation Engine) or inprocess (seedfed.inprocess)"})
    pool: int = field(default=0, metadata={
        "help": "> 0: the fleet shares this many training examples (DeviceData.pool)"})
    eval_every: int = field(default=10, metadata={
        "help": "score the held-out split every N rounds and the last"})
    #: run the devices' sync phase (catch up, verify the checksum, score the local held-out
    #: set) every this many rounds and the last; None: with the scoring (`eval_every`), the
    #: rounds whose report row has accuracies. In between a device replays the entry it
    #: missed with its next plan, to the same bits (the feature cache's rows do not depend on
    #: when a sentence was first encoded: features.FEATURE_GROUP), so the final checksum
    #: is the same for any value; a phase costs a round trip to every device
    sync_every: int | None = field(default=None, metadata={
        "help": "run the sync phase every N rounds and the last (default: eval_every)"})
    eval_on_validation: bool = field(default=False, metadata={
        "help": "score the validation split (tuning) instead of test"})
    personal: str = field(default="residual", metadata={
        "help": "each device's personal part: residual, ditto, fedper or off"})
    label_skew: float = field(default=0.0, metadata={
        "help": "> 0: label-skewed split of a file; each device's majority class share"})
    #: where encoded sentence features are kept (seedfed.features.store_root): "auto" (the
    #: user's cache, shared by every run: a repeated run skips the encoding), "run" (this run's
    #: directory only) or a directory
    feature_cache: str = field(default="auto", metadata={
        "help": "auto (the user's cache), run (this run's directory) or a directory"})

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
        BackendConfig(torch_device=self.device)  # auto, cpu, cuda or cuda:N
        for name in ("cpus", "eval_every", "sync_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("devices", "rounds", "devices_per_round", "alpha"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {self.eval_size}")
        if self.scope == "body":
            raise ValueError("--scope body is a recipe: say --recipe body")
        fleet = self.resolved().fleet  # the recipe's fleet where none is given
        for name in ("devices", "rounds", "devices_per_round", "alpha"):
            object.__setattr__(self, name, getattr(fleet, name))
        if self.recipe is None:
            object.__setattr__(self, "recipe", lm_counterpart(
                default_recipe(self.data, self.format), self.model))

    def resolved(self, label_texts: tuple[str, ...] | None = None) -> Resolved:
        """The recipe with this run's scope, overrides and fleet settings applied (`label_texts`:
        the data's, which replace the recipe's)."""
        given: dict[str, Any] = dict(self.overrides)
        for name in ("devices", "rounds", "devices_per_round", "alpha"):
            if getattr(self, name) != RECIPE:
                given[f"{SETTINGS}.{name}"] = getattr(self, name)
        if self.format is not None:
            given["spec.format"] = self.format
        if label_texts is not None:
            given["spec.label_texts"] = label_texts
        return resolve_recipe(self.recipe or default_recipe(self.data, self.format), given,
                              model=self.model, scope=self.scope, settings=SETTINGS)


def set_keys(items: list[str], scope: str | None, recipe: str | None, data: str,
             fmt: str | None, model: str | None = None) -> dict[str, Any]:
    """`--set` items of `seedfed simulate` as `parse_set` overrides: TaskSpec fields, the
    options of the run's scope (`scope`, else the recipe's: on a causal LM `model`, its LM
    counterpart's) and SimulationConfig's settings that have no option of their own
    (`run.eval_size`, ...)."""
    kind = scope or named(lm_counterpart(recipe or default_recipe(data, fmt), model)).scope
    return parse_set(items, kind, settings=(SETTINGS, SimulationConfig), exclude=NOT_SET)


def split_settings(given: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """`set_keys`'s output as (SimulationConfig keyword arguments, task overrides)."""
    own = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith(SETTINGS + ".")}
    return own, tuple((k, v) for k, v in given.items() if not k.startswith(SETTINGS + "."))


def task_spec_for(config: SimulationConfig, label_texts: tuple[str, ...]) -> TaskSpec:
    """The task a simulation trains: its recipe with its scope and overrides, on the data's
    label texts."""
    return config.resolved(label_texts).spec


def label_texts(data: str, num_labels: int) -> tuple[str, ...]:
    """The label texts of the data: the preference task's, SST-2's for two labels, else
    `class i`."""
    if data in PREFERENCE_SOURCES:
        return PREFERENCE_LABEL_TEXTS
    if num_labels == 2:
        return SST2_LABEL_TEXTS
    return tuple(f"class {i}" for i in range(num_labels))


def data_splits(config: SimulationConfig) -> Any:
    """The run's train, validation and test splits."""
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


def device_data(config: SimulationConfig) -> Any:
    """The fleet's data settings (each device adds its partition id)."""
    from seedfed.client.device_data import DeviceData

    return DeviceData(source=config.data, alpha=config.alpha, seed=config.seed,
                      num_partitions=config.devices, pool=config.pool,
                      label_skew=config.label_skew)


def simulation_secret(seed: int, training_run: int = 0) -> str:
    """The task secret of a simulation with `--seed seed`: every round's seeds derive from it,
    so two runs with one seed train the same seeds and end on the same checksum. Only a
    simulation does this; a real coordinator draws a fresh random secret per task (whoever
    knows it can predict every round's seeds and DP noise)."""
    name = f"seedfed-simulate/{seed}" + (f"/run-{training_run}" if training_run else "")
    return hashlib.sha256(name.encode()).hexdigest()[:32]
