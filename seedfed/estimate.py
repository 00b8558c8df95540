"""How long a simulation will take, measured before it starts.

A recipe's duration depends on the machine, the scope and the fleet, so a constant would be
wrong somewhere. Instead `estimate_duration` builds the task's model once (timed: each process
of the fleet loads it too), runs one device's local step of the task (every probe of the plan's
seeds and the update, the device's own `LocalTrainer` with its probe batching) on a real batch
of the data, times it, and scales that by the run: rounds x devices per round x local steps,
divided by the devices that run at once. Beside the shared step a device trains its personal
part every round and, in the sync phases, scores its held-out examples; both are timed too.
Then the held-out scoring of the shared model, and the encoding of the fleet's sentences where
the model caches its frozen part (a head's features): only what the feature cache lacks, found
by looking a sample of the sentences up in it. A task whose plans differ by round (a ternary
task's alternate mask epochs) is timed per kind of plan; a ternary task runs on the packed
model its devices hold. Transport and coordinator time are not in it (with a head scope they
are a few tenths of a second a round).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from seedfed.client.data import Examples
from seedfed.client.evaluate import accuracy
from seedfed.client.objective_batches import endless_batches
from seedfed.client.trainer import LocalTrainer
from seedfed.shared.model.classifier import expect_texts, pooled_classifier, share_features
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.model.features import FEATURE_GROUP, FeatureStore
from seedfed.shared.model.objectives import task_losses
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.protocol.scope_options import TernaryOptions
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

#: The Simulation Engine's own costs, which no in-process timing sees: starting Ray (its
#: processes and actors; ~5 s for `ray.init` alone on 2 cores), and moving one message to an
#: actor and its reply back (the driver's share of a round beyond its devices' compute: 0.31 s
#: for 20 devices in the SST-2 recipe on 2 cores). Measured with `seedfed simulate --data
#: sst2/train.tsv --rounds 60` against its report's device times.
ENGINE_START_S = 10.0
ENGINE_MESSAGE_S = 0.015


@dataclass(frozen=True)
class DurationEstimate:
    #: one device's local step, measured (the faster of the timed steps; where the run's plans
    #: differ, the mean over its steps)
    step_s: float
    device_steps: int  # rounds x devices per round x local steps
    parallel: int  # devices computing at once
    eval_s: float  # all the held-out scoring of the run
    #: encoding the fleet's sentences the feature cache does not hold yet, where the model
    #: caches what its scope leaves frozen (a head's features; 0 otherwise)
    encode_s: float = 0.0
    #: the rest of every device round, over the devices that run at once: catching up (one
    #: log entry replayed, its checksum), the personal part's training, storing the state
    round_rest_s: float = 0.0
    #: the devices' sync-phase scoring of their held-out examples, over those at once
    sync_s: float = 0.0
    #: reading the devices' rows back from the feature cache (each process that serves a
    #: device reads its data's rows once)
    read_s: float = 0.0
    #: loading the model once (each process of the fleet does, at once)
    startup_s: float = 0.0
    #: the Simulation Engine's own time: starting Ray and moving each message
    #: (`ENGINE_START_S`, `ENGINE_MESSAGE_S`); 0 in process
    engine_s: float = 0.0
    #: the coordinator's part of every round (open it, take the uploads, close it), measured
    #: on a coordinator of the task
    coordinator_s: float = 0.0
    #: share of the fleet's sentences the feature cache lacked (of a sample looked up)
    uncached: float = 1.0

    @property
    def seconds(self) -> float:
        return (self.step_s * self.device_steps / self.parallel + self.eval_s + self.encode_s
                + self.round_rest_s + self.sync_s + self.startup_s + self.coordinator_s
                + self.read_s + self.engine_s)

    def describe(self) -> str:
        step = f"{self.step_s:.2f} s" if self.step_s >= 0.1 else f"{self.step_s * 1e3:.1f} ms"
        text = (f"expected duration ~{_minutes(self.seconds)}: one device step measured at "
                f"{step} x {self.device_steps:,} device steps / {self.parallel} at once")
        parts = [(self.round_rest_s, "catch-up, personal parts and state of the device "
                  "rounds"), (self.coordinator_s, "coordinator"), (self.sync_s, "sync phases"),
                 (self.read_s, "reading cached features"), (self.engine_s, "Simulation Engine"),
                 (self.eval_s, "held-out scoring"), (self.startup_s, "model loading")]
        text += "".join(f", + {_minutes(s)} {what}" for s, what in parts if s >= 1)
        if self.encode_s >= 1:
            text += (f", + {_minutes(self.encode_s)} encoding the {self.uncached:.0%} of the "
                     "fleet's sentences the feature cache lacks (once)")
        return text


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def plan_kinds(spec: TaskSpec, rounds: int) -> list[tuple[int, int, int, int]]:
    """The run's distinct plans, in the order they first open: (version it first opens at,
    local steps, seeds per step, rounds that plan it). One for most tasks; a ternary task
    with alternate mask epochs plans its head epochs and its latent epochs differently
    (`TaskSpec.round_hyper`). Round r opens at version r - 1 (a round commits one version)."""
    kinds: dict[tuple[bool, int, int], list[int]] = {}
    opts = spec.scope_options
    for number in range(1, rounds + 1):
        version = number - 1
        h = spec.round_hyper(number, version)
        head = isinstance(opts, TernaryOptions) and opts.mask.head_epoch(
            opts.mask.epoch_of(version))
        kinds.setdefault((head, h.steps, h.perturbations), [version, 0])[1] += 1
    return [(v, steps, p, n) for (_, steps, p), (v, n) in kinds.items()]


def estimate_duration(spec: TaskSpec, train: Examples, held_out: Examples, *, rounds: int,
                      per_round: int, parallel: int, evals: int, repeats: int = 3,
                      sentences: int = 0, personal: str | None = None, syncs: int = 0,
                      store: FeatureStore | None = None,
                      time_coordinator: bool = False, engine: str = "inprocess",
                      ) -> DurationEstimate:
    """Time one local step of each of the run's plans (`plan_kinds`) of `spec` on a batch of
    `train` (`repeats` times; the first also pays one-off costs such as a head's feature
    cache, so the fastest counts) and one scoring of `held_out`, then scale them by the run.
    A ternary task is timed as its devices run it: on the packed model, loaded from the
    snapshot the coordinator's model publishes at the plan's version, a new batch each step
    (the median counts). `sentences`: the fleet's sentences the run encodes, timed on
    sentences of `train` (`_encode_s`) and counted as far as `store` (the run's feature
    store; None: none) lacks them. `personal`: the devices' personal part (a method of
    `client.personal`; None or "off": none), trained every device round; `syncs`: the sync
    phases, in which each device of the round scores its held-out examples.
    `time_coordinator`: also time the coordinator's rounds (`_coordinator_round_s`).
    `engine`: "flower" adds the Simulation Engine's start and per-message time."""
    if repeats < 1 or rounds < 1 or per_round < 1 or parallel < 1 or evals < 0 or syncs < 0:
        raise ValueError("repeats, rounds, per_round and parallel must be >= 1, evals and "
                         "syncs >= 0")
    started = time.perf_counter()
    coordinator = build_model(spec, initialize=True)
    startup_s = time.perf_counter() - started
    uncached, read_s = (_uncached(coordinator, train, spec.max_seq_len, store) if sentences
                        else (0.0, 0.0))
    compute_s, device_steps, bundle = 0.0, 0, coordinator
    for version, steps, perturbations, count in plan_kinds(spec, rounds):
        coordinator.scope.enter_version(version)  # a ternary task's mask epoch (else a no-op)
        bundle, trainer = _device_at(spec, coordinator, version)
        step_s = _step_s(spec, bundle, trainer, train, version, perturbations, repeats)
        compute_s += step_s * count * per_round * steps
        device_steps += count * per_round * steps
    at_once = max(1, min(parallel, per_round))
    eval_s = sync_s = 0.0
    if len(held_out) and (evals or syncs):
        # timed twice: the first scoring also encodes the sample where the model caches its
        # frozen part (a head's features), later ones only run what the versions change
        sample = held_out.subset(range(min(len(held_out), 64)))
        first, repeat = (_timed(accuracy, bundle, sample) for _ in range(2))
        if evals:
            eval_s = (first + repeat * (evals - 1)) * len(held_out) / len(sample)
        # a device scores at most 64 held-out examples (device_data.MAX_LOCAL_EVAL), with the
        # shared model and, with a personal part, twice more (shared + personal, local only)
        sync_s = repeat * (3 if personal not in (None, "off") else 1) * syncs * per_round \
            / at_once
    round_rest_s = 0.0
    if spec.scope != "ternary":  # a packed device's round is timed whole by `_step_s`
        last = plan_kinds(spec, rounds)[-1]
        round_rest_s = _round_rest_s(spec, coordinator, train, last[2], personal, repeats) \
            * rounds * per_round / at_once
    encode_s = 0.0
    if sentences and spec.scope != "ternary":  # a packed device caches nothing
        encode_s = _encode_s(coordinator, train, spec.max_seq_len) * sentences * uncached \
            / max(1, parallel)
    coordinator_s = _coordinator_round_s(spec, per_round) * rounds if time_coordinator else 0.0
    engine_s = 0.0
    if engine == "flower":
        engine_s = ENGINE_START_S + ENGINE_MESSAGE_S * per_round * (rounds + syncs)
    return DurationEstimate(step_s=compute_s / device_steps, device_steps=device_steps,
                            parallel=at_once, eval_s=eval_s, encode_s=encode_s,
                            round_rest_s=round_rest_s, sync_s=sync_s, startup_s=startup_s,
                            uncached=uncached, coordinator_s=coordinator_s,
                            read_s=read_s * sentences, engine_s=engine_s)


def _step_s(spec: TaskSpec, bundle: ModelBundle, trainer: LocalTrainer, train: Examples,
            version: int, perturbations: int, repeats: int) -> float:
    """Seconds of one local step of a plan with `perturbations` seeds at `version`."""
    h = spec.hyper
    batches = endless_batches(spec, bundle.tokenizer, train.texts, train.labels, h.batch_size,
                              np.random.default_rng(0))
    # An fp32 device caches what its scope leaves frozen (a head's features) for its whole
    # data set before its first step (a simulation's shared feature store), so the
    # steady-state step is a repeat of one batch after the first; a packed ternary device
    # encodes each batch's new sentences as they come, so it is timed on new batches.
    fresh = spec.scope == "ternary"
    if not fresh:
        batches = itertools.repeat(next(batches))
    plan = RoundPlan(task_id="estimate", round=0, version=version,
                     seeds=[[1 + i for i in range(perturbations)]], lr=h.lr, eps=h.eps,
                     batch_size=h.batch_size, clip=h.clip, one_sided=h.one_sided,
                     scope=spec.scope)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            trainer.run(plan, batches)
            times.append(time.perf_counter() - started)
    return statistics.median(times) if fresh else min(times)


def _round_rest_s(spec: TaskSpec, coordinator: ModelBundle, train: Examples,
                  perturbations: int, personal: str | None, repeats: int) -> float:
    """Seconds of a device round beyond its local steps, measured on a device of the task
    (`client.device.Device`, its own model, its data in the feature cache as in a simulation):
    the whole `Device.train` (steps, personal part, state stored; its store swapped each time,
    as a fleet's process does between the devices it serves) less the steps, plus replaying
    one log entry of the plan's seeds with its checksum."""
    from seedfed.client.backends.torch import TorchBackend
    from seedfed.client.device import Device, MemoryStore
    from seedfed.client.device_data import DeviceData
    from seedfed.client.personal import PersonalConfig
    from seedfed.client.sync import state_bytes

    h = spec.hyper
    backend = TorchBackend(spec)
    device = Device(spec, "estimate", MemoryStore(), personal=None if personal in (
        None, "off") else PersonalConfig(method=str(personal)), backend=backend)
    device.load_snapshot(state_bytes(coordinator.scope), 0, checksum(coordinator.scope))
    expect_texts(backend.bundle.model, backend.bundle.tokenizer, train.texts, spec.max_seq_len,
                 now=True)
    seeds = [1 + i for i in range(perturbations)]
    plan = RoundPlan(task_id="estimate", round=1, version=0, seeds=[seeds] * h.steps, lr=h.lr,
                     eps=h.eps, batch_size=h.batch_size, clip=h.clip, one_sided=h.one_sided,
                     scope=spec.scope)
    whole, steps = [], []
    with torch.no_grad():
        for _ in range(max(2, repeats)):  # the first also starts the personal part
            device.store = MemoryStore(device.store.load())
            whole.append(_timed(device.train, plan, train, DeviceData()))
            steps.append(_timed(backend.model.trainer.run, plan,
                                itertools.repeat(next(endless_batches(
                                    spec, backend.bundle.tokenizer, train.texts, train.labels,
                                    h.batch_size, np.random.default_rng(0))))))
        coefs = [1e-12] * perturbations  # a throwaway model: any entry costs the same

        def replay() -> None:
            apply_seeds(coordinator.scope, seeds, coefs)
            checksum(coordinator.scope)

        replay_s = _timed(replay)
    return max(0.0, min(whole[1:]) - min(steps[1:])) + replay_s


def _coordinator_round_s(spec: TaskSpec, per_round: int, rounds: int = 3) -> float:
    """Seconds of the coordinator's part of one round, measured on a coordinator of the task
    (SQLite in a temporary directory): open the round, the catch-up its devices are sent (the
    last entry), accept `per_round` uploads in one transaction and close the round; the
    median of `rounds` rounds after a first one."""
    import tempfile

    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings
    from seedfed.shared.protocol.wire import Upload

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="seedfed-estimate-") as tmp:
        coordinator = Coordinator.open(Settings(database_url=f"sqlite:///{tmp}/c.db",
                                                store_dir=Path(tmp) / "store"))
        try:
            task = coordinator.create_task(spec, quorum=1, devices_per_round=per_round)
            devices = [coordinator.enroll(task)[0] for _ in range(per_round)]
            times = []
            for _ in range(rounds + 1):
                started = time.perf_counter()
                plan = coordinator.open_round(task)
                if plan.version:
                    coordinator.log_since(task, plan.version - 1)
                g = rng.standard_normal((plan.steps, plan.perturbations)).astype(np.float32)
                coordinator.submit_many(task, [(d, Upload.build(plan, g, 100, 0.5), None)
                                               for d in devices])
                coordinator.close_round(task)
                times.append(time.perf_counter() - started)
        finally:
            coordinator.close()
    return statistics.median(times[1:])


class _ReadOnly:
    """A feature store seen without writing to it (the estimate's lookups leave no trace)."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def get(self, namespace: str, keys: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        return self.store.get(namespace, keys)

    def put(self, namespace: str, rows: Mapping[bytes, torch.Tensor]) -> None:
        pass


def _uncached(bundle: ModelBundle, train: Examples, max_len: int,
              store: FeatureStore | None, sample: int = 256) -> tuple[float, float]:
    """(share of `train`'s sentences, a sample, that `store` lacks: the part of the fleet's
    encoding a run will pay; seconds to read one cached sentence's row back, which every
    device pays for its data in each process that serves it). (1, 0) without a store or for
    a model that caches nothing."""
    inner = pooled_classifier(bundle.model)
    if store is None or inner is None or inner.frozen_prefix == 0 or not len(train):
        return 1.0, 0.0
    texts = list(dict.fromkeys(train.texts))[:sample]
    share_features(bundle.model, _ReadOnly(store))
    took = 0.0
    try:
        for _attempt in range(2):  # the first also indexes the store (once per process)
            inner.clear_cache()
            expect_texts(bundle.model, bundle.tokenizer, texts, max_len)
            started = time.perf_counter()
            missing = inner.warm()  # reads what the store holds, encodes the rest
            took = time.perf_counter() - started
            if missing:
                break
    finally:
        share_features(bundle.model, None)
        inner.clear_cache()
    # read time: a sample the store holds in full (the usual warm run), else none counted
    return missing / len(texts), (took / len(texts) if not missing else 0.0)


def _encode_s(bundle: ModelBundle, train: Examples, max_len: int, repeats: int = 3) -> float:
    """Seconds to encode one sentence of `train` into the feature cache (0: the model caches
    nothing). Timed on one canonical group of the sample's most common length (a device
    encodes its whole data set in full groups; a sample's many short groups would be padded)
    and scaled per token to the sample's mean length."""
    inner = pooled_classifier(bundle.model)
    if inner is None or inner.frozen_prefix == 0 or bundle.tokenizer is None or not len(train):
        return 0.0
    ids = bundle.tokenizer(list(train.texts), truncation=True, max_length=max_len)["input_ids"]
    length = Counter(len(i) for i in ids).most_common(1)[0][0]
    group = [t for t, i in zip(train.texts, ids, strict=True) if len(i) == length][:FEATURE_GROUP]
    times = []
    for _ in range(repeats):
        inner.clear_cache()
        expect_texts(bundle.model, bundle.tokenizer, group, max_len)
        times.append(_timed(inner.warm))
    inner.clear_cache()
    per_token = min(times) / (FEATURE_GROUP * length)  # a short group is padded to a full one
    return per_token * statistics.fmean(len(i) for i in ids)


def _timed(fn: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def _device_at(spec: TaskSpec, coordinator: ModelBundle, version: int,
               ) -> tuple[ModelBundle, LocalTrainer]:
    """The model a device trains at `version` and its trainer: the coordinator's own model,
    or for a ternary task a packed device loaded from the snapshot it publishes."""
    if spec.scope != "ternary":
        h = spec.hyper
        loss, copy_losses = task_losses(spec, coordinator.tokenizer)
        return coordinator, LocalTrainer(coordinator.model, coordinator.scope, loss,
                                         copy_losses=copy_losses, max_copies=h.probe_copies,
                                         budget_mb=h.probe_memory_mb)
    from safetensors.torch import save

    from seedfed.client.ternary import PackedTernary
    from seedfed.shared.model.ternary import publish_ternary

    device = PackedTernary(spec)
    snapshot = publish_ternary(coordinator.scope.read(), coordinator.scope)
    device.load_snapshot(save(snapshot), version, checksum(coordinator.scope))
    return device.bundle, device.trainer


def evaluations(rounds: int, eval_every: int) -> int:
    """How many times a run of `rounds` scores its held-out split (every `eval_every` rounds
    and after the last)."""
    return math.ceil(rounds / eval_every)
