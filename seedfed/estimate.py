"""How long a simulation will take, measured before it starts.

A recipe's duration depends on the machine, the scope and the fleet, so a constant would be
wrong somewhere. Instead `estimate_duration` builds the task's model once, runs one device's
local step of the task (every probe of the plan's seeds and the update, the device's own
`LocalTrainer` with its probe batching) on a real batch of the data, times it, and scales
that by the run: rounds x devices per round x local steps, divided by the devices that run at
once, plus the held-out scoring. It is an estimate of device compute, not of transport or
coordinator time (both small beside it for the recipes; docs/accuracy.md).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from seedfed.client.data import Examples, train_batches
from seedfed.client.evaluate import accuracy
from seedfed.client.trainer import LocalTrainer, classification_loss
from seedfed.shared.models import build_model
from seedfed.shared.task import TaskSpec
from seedfed.shared.wire import RoundPlan


@dataclass(frozen=True)
class DurationEstimate:
    step_s: float  # one device's local step, measured (the faster of the timed steps)
    device_steps: int  # rounds x devices per round x local steps
    parallel: int  # devices computing at once
    eval_s: float  # all the held-out scoring of the run

    @property
    def seconds(self) -> float:
        return self.step_s * self.device_steps / self.parallel + self.eval_s

    def describe(self) -> str:
        return (f"expected duration ~{self.seconds / 60:.1f} min of device compute: one device "
                f"step measured at {self.step_s:.2f} s x {self.device_steps:,} device steps "
                f"/ {self.parallel} at once, + {self.eval_s:.0f} s of held-out scoring")


def estimate_duration(spec: TaskSpec, train: Examples, held_out: Examples, *, rounds: int,
                      per_round: int, parallel: int, evals: int, repeats: int = 2,
                      ) -> DurationEstimate:
    """Time one local step of `spec` on a batch of `train` (`repeats` times; the first also
    pays one-off costs such as a head's feature cache, so the fastest counts) and one scoring
    of `held_out`, then scale them by the run."""
    if repeats < 1 or rounds < 1 or per_round < 1 or parallel < 1 or evals < 0:
        raise ValueError("repeats, rounds, per_round and parallel must be >= 1, evals >= 0")
    bundle = build_model(spec, initialize=True)
    h = spec.hyper
    trainer = LocalTrainer(bundle.model, bundle.scope, classification_loss,
                           max_copies=h.probe_copies, budget_mb=h.probe_memory_mb)
    # One batch, repeated: a device caches what its scope leaves frozen (a head's features),
    # so the steady-state step is the one after the first.
    batch = next(train_batches(train, bundle.tokenizer, h.batch_size, spec.max_seq_len,
                               np.random.default_rng(0)))
    batches = itertools.repeat(batch)
    plan = RoundPlan(task_id="estimate", round=0, version=0,
                     seeds=[[1 + i for i in range(h.perturbations)]], lr=h.lr, eps=h.eps,
                     batch_size=h.batch_size, clip=h.clip, one_sided=h.one_sided,
                     scope=spec.scope)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            trainer.run(plan, batches)
            times.append(time.perf_counter() - started)
    eval_s = 0.0
    if evals and len(held_out):
        sample = held_out.subset(range(min(len(held_out), 64)))
        started = time.perf_counter()
        accuracy(bundle, sample)
        eval_s = (time.perf_counter() - started) * len(held_out) / len(sample) * evals
    return DurationEstimate(step_s=min(times), device_steps=rounds * per_round * h.steps,
                            parallel=max(1, min(parallel, per_round)),
                            eval_s=eval_s)


def evaluations(rounds: int, eval_every: int) -> int:
    """How many times a run of `rounds` scores its held-out split (every `eval_every` rounds
    and after the last)."""
    return math.ceil(rounds / eval_every)
