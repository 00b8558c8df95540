"""How long a simulation will take, measured before it starts.

A recipe's duration depends on the machine, the scope and the fleet, so a constant would be
wrong somewhere. Instead `estimate_duration` builds the task's model once, runs one device's
local step of the task (every probe of the plan's seeds and the update, the device's own
`LocalTrainer` with its probe batching) on a real batch of the data, times it, and scales
that by the run: rounds x devices per round x local steps, divided by the devices that run at
once, plus the held-out scoring; and, apart, the one-off encoding of the devices' sentences
where the model caches its frozen part (a head's features). A task whose plans differ by round
(a ternary task's alternate mask epochs) is timed per kind of plan; a ternary task runs on the
packed model its devices hold. It is an estimate of device compute, not of transport or
coordinator time (docs/performance.md: with a head scope the rounds' waiting is most of a
warm run).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from seedfed.client.data import Examples, train_batches
from seedfed.client.evaluate import accuracy
from seedfed.client.trainer import LocalTrainer, classification_loss
from seedfed.shared.models import (
    FEATURE_GROUP,
    ModelBundle,
    build_model,
    expect_texts,
    pooled_classifier,
)
from seedfed.shared.replay import checksum
from seedfed.shared.scope_options import TernaryOptions
from seedfed.shared.task import TaskSpec
from seedfed.shared.wire import RoundPlan


@dataclass(frozen=True)
class DurationEstimate:
    #: one device's local step, measured (the faster of the timed steps; where the run's plans
    #: differ, the mean over its steps)
    step_s: float
    device_steps: int  # rounds x devices per round x local steps
    parallel: int  # devices computing at once
    eval_s: float  # all the held-out scoring of the run
    #: encoding every training sentence once, where the model caches what its scope leaves
    #: frozen (a head's features; 0 otherwise): an upper bound, since a feature cache that
    #: already holds the sentences skips it; not part of `seconds`
    encode_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.step_s * self.device_steps / self.parallel + self.eval_s

    def describe(self) -> str:
        step = f"{self.step_s:.2f} s" if self.step_s >= 0.1 else f"{self.step_s * 1e3:.1f} ms"
        text = (f"expected duration ~{self.seconds / 60:.1f} min of device compute: one device "
                f"step measured at {step} x {self.device_steps:,} device steps "
                f"/ {self.parallel} at once, + {self.eval_s:.0f} s of held-out scoring")
        if self.encode_s >= 1:
            text += (f"; + up to ~{self.encode_s / 60:.1f} min encoding the devices' "
                     "sentences once (none where the feature cache holds them)")
        return text


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
                      sentences: int = 0) -> DurationEstimate:
    """Time one local step of each of the run's plans (`plan_kinds`) of `spec` on a batch of
    `train` (`repeats` times; the first also pays one-off costs such as a head's feature
    cache, so the fastest counts) and one scoring of `held_out`, then scale them by the run.
    A ternary task is timed as its devices run it: on the packed model, loaded from the
    snapshot the coordinator's model publishes at the plan's version, a new batch each step
    (the median counts). `sentences`: the fleet's training sentences, whose one-off encoding
    (`DurationEstimate.encode_s`) is timed on sentences of `train` (`_encode_s`)."""
    if repeats < 1 or rounds < 1 or per_round < 1 or parallel < 1 or evals < 0:
        raise ValueError("repeats, rounds, per_round and parallel must be >= 1, evals >= 0")
    coordinator = build_model(spec, initialize=True)
    h = spec.hyper
    compute_s, device_steps = 0.0, 0
    for version, steps, perturbations, count in plan_kinds(spec, rounds):
        coordinator.scope.enter_version(version)  # a ternary task's mask epoch (else a no-op)
        bundle, trainer = _device_at(spec, coordinator, version)
        batches = train_batches(train, bundle.tokenizer, h.batch_size, spec.max_seq_len,
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
        compute_s += (statistics.median(times) if fresh else min(times)) * count * per_round * steps
        device_steps += count * per_round * steps
    eval_s = 0.0
    if evals and len(held_out):
        # timed twice: the first scoring also encodes the sample where the model caches its
        # frozen part (a head's features), later ones only run what the versions change
        sample = held_out.subset(range(min(len(held_out), 64)))
        first, repeat = (_timed(accuracy, bundle, sample) for _ in range(2))
        eval_s = (first + repeat * (evals - 1)) * len(held_out) / len(sample)
    encode_s = 0.0
    if sentences and spec.scope != "ternary":  # a packed device caches nothing
        encode_s = _encode_s(coordinator, train, spec.max_seq_len) * sentences / parallel
    return DurationEstimate(step_s=compute_s / device_steps, device_steps=device_steps,
                            parallel=max(1, min(parallel, per_round)), eval_s=eval_s,
                            encode_s=encode_s)


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
        return coordinator, LocalTrainer(coordinator.model, coordinator.scope,
                                         classification_loss, max_copies=h.probe_copies,
                                         budget_mb=h.probe_memory_mb)
    from safetensors.torch import save

    from seedfed.client.ternary import PackedTernary
    from seedfed.shared.ternary import publish_ternary

    device = PackedTernary(spec)
    snapshot = publish_ternary(coordinator.scope.read(), coordinator.scope)
    device.load_snapshot(save(snapshot), version, checksum(coordinator.scope))
    return device.bundle, device.trainer


def evaluations(rounds: int, eval_every: int) -> int:
    """How many times a run of `rounds` scores its held-out split (every `eval_every` rounds
    and after the last)."""
    return math.ceil(rounds / eval_every)
