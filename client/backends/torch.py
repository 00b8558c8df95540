"""The PyTorch backend: a task's model in eager torch, on the CPU or a GPU.

Two model kinds share it: `Fp32Model`, whose trainable state is float32 values (every scope
but ternary: full, LoRA, named, a quantized model's scales), and `client.ternary.PackedTernary`,
a ternary task's packed model (a BitNet classifier or causal LM). `TorchBackend` puts either
behind `client.backends.base.Backend`: batches drawn from the device's data, the plan's probes
run by `client.trainer.LocalTrainer`, the state checked back at the plan's version, scoring,
and the personal part (an fp32 classifier's).

`torch_device` places the model and every batch (`resolve_torch_device`: auto is cuda when
torch sees one, else cpu). The math does not depend on it: the stream runs in torch integer
ops on a GPU tensor's device (`shared.model.stream`), and checksums hash the same float32
bytes, copied to the host. A ternary task's packed kernels run on the CPU only.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from seedfed.client import data as data_mod
from seedfed.client.backends.base import (
    FP32,
    DeviceStateError,
    StoredState,
    SyncResult,
    Trained,
)
from seedfed.client.device_data import DeviceData, local_accuracy
from seedfed.client.objective_batches import endless_batches
from seedfed.client.personal import PersonalConfig, PersonalPart
from seedfed.client.personal_lm import LabelPersonalPart, LMPersonalPart, lm_fingerprint
from seedfed.client.sync import catch_up, load_state, state_bytes
from seedfed.client.ternary import PackedTernary, is_ternary
from seedfed.client.trainer import Batch, LocalTrainer
from seedfed.shared.model.classifier import expect_texts, share_features
from seedfed.shared.model.factory import ModelBundle, build_model
from seedfed.shared.model.features import FeatureStore
from seedfed.shared.model.objectives import task_losses
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.protocol.errors import LogEntryMismatchError, UserError
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan
from torch import nn

log = logging.getLogger(__name__)


def resolve_torch_device(name: str, *, ternary: bool = False) -> torch.device:
    """The torch device `name` (auto, cpu, cuda, cuda:N) names on this machine; a CUDA one
    that torch cannot use is a UserError saying what to do. A ternary task runs on the CPU
    (auto picks it; cuda is refused)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and not ternary else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if ternary:
            raise UserError(f"device {name}: a ternary task's packed model runs on the CPU",
                            "run it with --device cpu (or auto)")
        if not torch.cuda.is_available():
            raise UserError(f"device {name}: torch sees no CUDA device on this machine",
                            "run with --device cpu (or auto), or install a CUDA build of "
                            "torch on a machine with a GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {name}: this machine has {torch.cuda.device_count()} "
                            "CUDA devices", "give cuda:N with N below that, or cuda")
    return device


def calibrate_replay_rate(sizes: Sequence[tuple[str, int]], seeds: int = 8, repeats: int = 3,
                          max_elements: int = 1 << 22) -> float:
    """Elements x seeds per second of replay on this CPU, before the device has replayed
    anything: one entry of `seeds` seeds applied and verified (`replay.apply_seeds`, then
    `replay.checksum`, as a device's replay does per entry) on zeroed scratch tensors of the
    scope's (name, size) list, the first ones up to `max_elements` in all; median of `repeats`.
    Per-tensor overhead and the checksum count, so a scope of many small tensors (LoRA) is
    not mistaken for one long vector; the replay's own kernels run, so a faster replay shows
    up here without a change."""
    chosen: list[ScopedTensor] = []
    total = 0
    for name, n in sizes:
        take = min(n, max_elements - total)
        if take <= 0:
            break
        chosen.append(ScopedTensor(name, torch.zeros(take, dtype=torch.float32)))
        total += take
    if not chosen:
        raise ValueError("calibration needs at least one tensor of at least one element")
    scratch = Scope(nn.Module(), chosen)
    coefs = [1e-3 * (i + 1) for i in range(seeds)]
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        apply_seeds(scratch, list(range(r * seeds, (r + 1) * seeds)), coefs)
        checksum(scratch)
        times.append(time.perf_counter() - t0)
    return total * seeds / max(statistics.median(times), 1e-9)


class Fp32Model:
    """A task's model whose trainable state is float32 values: every scope but ternary."""

    snapshot_format = FP32

    def __init__(self, spec: TaskSpec, device: torch.device) -> None:
        self.bundle: ModelBundle = build_model(spec, initialize=False)
        if device.type != "cpu":
            self.bundle.model.to(device)
            stale = [t.name for t in self.bundle.scope if t.tensor.device != device]
            if stale:
                raise DeviceStateError(f"trainable tensor {stale[0]} did not move to {device}")
        loss, copy_losses = task_losses(spec, self.bundle.tokenizer)
        self.trainer = LocalTrainer(self.bundle.model, self.bundle.scope, loss,
                                    copy_losses=copy_losses, max_copies=spec.hyper.probe_copies,
                                    budget_mb=spec.hyper.probe_memory_mb)
        self.version: int | None = None
        self.checksum = ""

    def forget(self) -> None:
        self.version, self.checksum = None, ""

    def load_snapshot(self, data: bytes, version: int, checksum: str) -> None:
        self.checksum = load_state(self.bundle.scope, data, checksum)
        self.version = version

    def replay(self, *, task_id: str, entries: Sequence[LogEntry], target: int) -> SyncResult:
        if self.version is None:
            raise LogEntryMismatchError(f"task {task_id}: no state to replay into")
        result = catch_up(self.bundle.scope, task_id=task_id, version=self.version,
                          entries=entries, target=target)
        self.version, self.checksum = result.version, result.checksum
        return result


class TorchBackend:
    """A task's model in torch on one device (`client.backends.base.Backend`)."""

    def __init__(self, spec: TaskSpec, *, torch_device: str = "cpu",
                 features: FeatureStore | None = None) -> None:
        """`features`: a feature store shared with other processes (a simulation's run
        directory, seedfed/features.py); None, every real device: its own cache only. Either
        way the cached rows are the same bits (seedfed.shared.model.features.FEATURE_GROUP)."""
        self.spec = spec
        self.device = resolve_torch_device(torch_device, ternary=is_ternary(spec))
        self.model: Fp32Model | PackedTernary = (
            PackedTernary(spec) if is_ternary(spec) else Fp32Model(spec, self.device))
        if isinstance(self.model, Fp32Model):
            share_features(self.model.bundle.model, features)
        self._warm = features is not None
        # Example sets already named to the feature cache (`expect_texts`), by identity.
        self._expected: dict[int, data_mod.Examples] = {}

    @property
    def version(self) -> int | None:
        return self.model.version

    @property
    def checksum(self) -> str:
        return self.model.checksum

    @property
    def snapshot_format(self) -> str:
        return self.model.snapshot_format

    @property
    def bundle(self) -> ModelBundle:
        """The model, tokenizer and scope (a ternary model's once a snapshot is loaded)."""
        return self.model.bundle

    @property
    def packed(self) -> PackedTernary | None:
        """A ternary task's packed model (None for other tasks)."""
        return self.model if isinstance(self.model, PackedTernary) else None

    # -- state ---------------------------------------------------------------------------------
    def forget(self) -> None:
        self.model.forget()

    def load_snapshot(self, data: bytes, version: int, checksum: str) -> None:
        self.model.load_snapshot(data, version, checksum)

    def replay(self, *, task_id: str, entries: Sequence[LogEntry], target: int) -> SyncResult:
        return self.model.replay(task_id=task_id, entries=entries, target=target)

    def restore(self, stored: StoredState) -> None:
        if isinstance(self.model, Fp32Model):
            if stored.state is None:
                raise DeviceStateError(f"no stored state of v{stored.version}")
            self.model.load_snapshot(stored.state, stored.version, stored.checksum)
            return
        if stored.snapshot is None or stored.snapshot_version is None:
            raise DeviceStateError(f"stored state of task {stored.task_id} holds no ternary "
                                   "snapshot; send one")
        self.model.restore(snapshot=stored.snapshot, snapshot_version=stored.snapshot_version,
                           snapshot_checksum=stored.snapshot_checksum, state=stored.state,
                           version=stored.version, checksum=stored.checksum)

    def stored(self, task_id: str) -> StoredState:
        m = self.model
        assert m.version is not None
        state = state_bytes(self.bundle.scope)
        if isinstance(m, Fp32Model):
            return StoredState(task_id, m.version, m.checksum, state)
        return StoredState(task_id, m.version, m.checksum, state, m.snapshot,
                           m.snapshot_version, m.snapshot_checksum)

    def state_sizes(self) -> list[tuple[str, int]]:
        if self.model.version is None and isinstance(self.model, PackedTernary):
            return []  # a packed model without a snapshot holds no scope yet
        return [(t.name, t.numel) for t in self.bundle.scope]

    def calibrate_replay_rate(self) -> float:
        return calibrate_replay_rate(self.state_sizes())

    # -- a round ---------------------------------------------------------------------------------
    def train(self, plan: RoundPlan, examples: data_mod.Examples, data: DeviceData) -> Trained:
        bundle = self.bundle
        self._expect(examples)
        rng = np.random.default_rng([data.seed, data.partition_id, plan.round])
        batches = endless_batches(bundle.spec, bundle.tokenizer, examples.texts,
                                  examples.labels, plan.batch_size, rng)
        result = self.model.trainer.run(plan, self._placed(batches))
        if checksum(bundle.scope) != self.checksum:  # the trainer must have put v back
            self.forget()
            raise DeviceStateError(f"local steps did not restore v{plan.version} exactly")
        # The aggregation weight is the size of the local training set (FedAvg's n_k, Flower's
        # num-examples), not the examples of this round's batches: every device probes the
        # same batch size, so weighting by batch would weigh a 14-example device like a
        # 1,400-example one, and with Dirichlet label skew the fleet would then train a
        # different objective than the union of its data (2 points of SST-2 accuracy;
        # docs/accuracy.md).
        return Trained(result.scalars, len(examples), result.loss, result.model_calls)

    def _placed(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """The batches on the model's device (drawn on the CPU: the same ids everywhere)."""
        if self.device.type == "cpu":
            return batches
        return ({k: v.to(self.device) for k, v in b.items()} for b in batches)

    def _expect(self, examples: data_mod.Examples) -> None:
        """Name the device's own examples to the feature cache once: the canonical groups it
        encodes are then filled with sentences it will need, not repeats. With a shared
        feature store (a simulation, whose processes serve every device's data) they are
        cached at once, in full groups or from the store. Speed only, never a bit."""
        if id(examples) not in self._expected and isinstance(self.model, Fp32Model):
            self._expected[id(examples)] = examples  # held: the id stays this object's
            expect_texts(self.bundle.model, self.bundle.tokenizer, examples.texts,
                         self.spec.max_seq_len, now=self._warm)

    def evaluate(self, examples: data_mod.Examples) -> tuple[float, float]:
        self._expect(examples)
        return local_accuracy(self.bundle, examples)

    def personal_part(self, config: PersonalConfig, task_id: str,
                      ) -> PersonalPart | LMPersonalPart | LabelPersonalPart | None:
        """A classifier's personal head (`client.personal`), a next-token LM's personal
        vocabulary bias (on a packed ternary LM too) or a label-words LM's personal class
        bias (`client.personal_lm`). A ternary classifier (or label-words LM) has none."""
        if self.spec.objective.kind == "next_token":
            if isinstance(self.model, Fp32Model):
                return LMPersonalPart.of(config, self.model.bundle, task_id)
            packed = self.model
            return LMPersonalPart(config, packed.model, packed.tokenizer,
                                  self.spec.max_seq_len, task_id,
                                  lm_fingerprint(packed.model, json.dumps(
                                      {"model_kind": self.spec.model_kind,
                                       "format": self.spec.format}, sort_keys=True)))
        if not isinstance(self.model, Fp32Model):
            return None
        if self.spec.objective.kind == "label_words":
            return LabelPersonalPart(config, self.model.bundle, task_id)
        return PersonalPart(config, self.model.bundle, task_id)
