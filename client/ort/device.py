"""The device core on ONNX Runtime: sync, ZO training and scoring with numpy, no torch.

`OrtDevice` does what `client.device.Device` does for an fp32 head-scope task, with the same
rules so the coordinator cannot tell the two apart:

- sync: replay the log entries (`shared.npzo.np_replay`, the bits of `shared.replay`) when they
  reach the target from here, else load a snapshot (safetensors of flat float32 tensors);
  every sync ends on the coordinator's checksum or raises and trusts nothing;
- train: the batches `client.data.batch_indices` draws from the same generator
  ([data seed, partition, round]), every probe of a step on the step's batch, probes
  theta + scale c_t z(seed) built from the shared stream (`shared.philox`; c_t the task's
  per-tensor step scale, `TaskSpec.step_scales`, 1 unless it names the tensor), C probes per
  `top.onnx` run, the scalar rule and the local update of `shared.npzo`; the state is back at
  the plan's version afterwards;
- evaluate: accuracy and mean loss on a local held-out set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors
from seedfed.client import data as data_mod
from seedfed.client.device_data import DeviceData
from seedfed.client.ort.bundle import BundleError
from seedfed.client.ort.runtime import OrtModel, example_losses, mean_losses
from seedfed.shared.protocol import npzo
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    SeedfedError,
    WireFormatError,
)
from seedfed.shared.protocol.philox import add_dense
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

#: A snapshot download: () -> (file bytes, the state checksum the coordinator published).
Fetch = Callable[[], tuple[bytes, str]]
#: Texts per encoder run when scoring.
EVAL_BATCH = 32


class OrtDeviceError(SeedfedError, RuntimeError):
    """The device cannot reach the requested version with what it holds and was sent."""


@dataclass(frozen=True)
class OrtSync:
    version: int
    checksum: str
    method: str  # "none" | "replay" | "snapshot"


@dataclass(frozen=True)
class OrtTrained:
    """A round's upload: the scalar matrix (steps x P), the aggregation weight, the loss."""

    scalars: np.ndarray
    num_examples: int
    loss: float
    runs: int  # top.onnx runs (probes / copies per run)


def read_state(data: bytes, model: OrtModel) -> npzo.NpState:
    """A snapshot's tensors as a numpy state, checked against the bundle's tensors."""
    try:
        raw = load_safetensors(data)
    except (SafetensorError, ValueError) as e:
        raise WireFormatError(f"snapshot is not valid safetensors: {e}") from e
    want = {t.name: t.numel for t in model.manifest.tensors}
    if set(raw) != set(want):
        raise WireFormatError(f"snapshot tensors {sorted(raw)[:5]} do not match the bundle's "
                              f"{sorted(want)[:5]}")
    state = {k: np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for k, v in raw.items()}
    bad = [k for k, v in state.items() if v.size != want[k]]
    if bad:
        raise WireFormatError(f"snapshot tensor {bad[0]} has {state[bad[0]].size} elements, "
                              f"the bundle {want[bad[0]]}")
    return state


class OrtDevice:
    """One device of one task on an ORT bundle (the task's exported forward)."""

    def __init__(self, spec: TaskSpec, task_id: str, model: OrtModel) -> None:
        model.manifest.check_spec(spec)
        names = [t.name for t in model.manifest.tensors]
        bad = npzo.unmatched_step_scales(spec.step_scales, names)
        if bad:
            raise BundleError(f"step scale pattern {bad[0]!r} matches no tensor of the "
                              f"bundle ({', '.join(names)})")
        self.spec, self.task_id, self.model = spec, task_id, model
        self.state: npzo.NpState | None = None
        self.version: int | None = None
        self.checksum = ""

    # -- state -------------------------------------------------------------------------------
    def invalidate(self) -> None:
        self.state, self.version, self.checksum = None, None, ""

    def load_snapshot(self, data: bytes, version: int, checksum: str) -> OrtSync:
        """Load a snapshot of `version`; refused (nothing changes) unless it hashes to
        `checksum`."""
        state = read_state(data, self.model)
        got = npzo.np_checksum(state)
        if got != checksum:
            raise ChecksumMismatchError(f"snapshot hashes to {got[:16]}..., the coordinator "
                                        f"published {checksum[:16]}...; refusing it")
        self.state, self.version, self.checksum = state, version, got
        return OrtSync(version, got, "snapshot")

    def state_bytes(self) -> bytes:
        if self.state is None:
            raise OrtDeviceError("the device holds no state")
        return save_safetensors(self.state)

    def sync(self, target: int, *, entries: Sequence[npzo.LogEntry] = (),
             fetch: Fetch | None = None) -> OrtSync:
        """Reach `target`: nothing to do, replay `entries`, else load `fetch()`'s snapshot."""
        if self.version == target and self.state is not None:
            return OrtSync(target, self.checksum, "none")
        if self.state is not None and self.version is not None and self.version < target:
            needed = sorted((e for e in entries if self.version <= e.base_version < target),
                            key=lambda e: e.base_version)
            if [e.base_version for e in needed] == list(range(self.version, target)):
                try:
                    version, chk = npzo.np_replay(self.state, needed, task_id=self.task_id,
                                                  version=self.version,
                                                  step_scales=self.spec.step_scales)
                except (ChecksumMismatchError, LogEntryMismatchError):
                    pass  # the state is back where it was; the snapshot below settles it
                else:
                    self.version, self.checksum = version, chk
                    return OrtSync(version, chk, "replay")
        if fetch is None:
            raise OrtDeviceError(f"task {self.task_id}: v{self.version} -> v{target} cannot "
                                 "be replayed from what was sent; send a snapshot")
        try:
            data, chk = fetch()
            return self.load_snapshot(data, target, chk)
        except SeedfedError:
            self.invalidate()
            raise

    # -- a round -----------------------------------------------------------------------------
    def copies_per_run(self, probes: int, batch: int) -> int:
        """Probes stacked per top.onnx run: the task's `probe_copies`, else as many as fit
        `probe_memory_mb` (the stacked tensors and their logits), at most the step's."""
        hyper = self.spec.hyper
        if hyper.probe_copies is not None:
            return max(1, min(probes, hyper.probe_copies))
        per_copy = 4 * (sum(t.numel for t in self.model.manifest.tensors)
                        + batch * (self.model.manifest.hidden_size + self.spec.num_labels))
        fits = int(hyper.probe_memory_mb * 2**20) // max(per_copy, 1)
        return max(1, min(probes, fits))

    def _probe_state(self, theta: npzo.NpState, probe: npzo.Probe) -> npzo.NpState:
        if probe is None:
            return theta
        seed, scale = probe
        pairs = self.spec.step_scales
        return {k: add_dense(v, k, [seed],
                             [float(np.float32(npzo.scaled_multiple(
                                 scale, npzo.step_scale_of(k, pairs))))])
                for k, v in theta.items()}

    def probe_losses(self, theta: npzo.NpState, texts: Sequence[str], labels: np.ndarray,
                     probes: Sequence[npzo.Probe]) -> tuple[list[float], int]:
        """L(theta + scale z(seed)) of each probe on one batch, in order; and the runs."""
        feats = self.model.features(texts)
        n = self.copies_per_run(len(probes), len(texts))
        out: list[float] = []
        runs = 0
        for start in range(0, len(probes), n):
            group = [self._probe_state(theta, p) for p in probes[start:start + n]]
            stacked = {k: np.stack([g[k] for g in group]) for k in theta}
            out += [float(v) for v in mean_losses(self.model.logits(feats, stacked), labels)]
            runs += 1
        return out, runs

    def train(self, plan: RoundPlan, examples: data_mod.Examples, data: DeviceData,
              ) -> OrtTrained:
        """Run the plan's steps from the plan's version; the state stays at that version."""
        if self.state is None or self.version != plan.version:
            raise OrtDeviceError(f"device is at v{self.version}, the plan at v{plan.version}")
        rng = np.random.default_rng([data.seed, data.partition_id, plan.round])
        batches: Iterator[np.ndarray] = data_mod.batch_indices(len(examples), plan.batch_size,
                                                               rng)
        theta = {k: v.copy() for k, v in self.state.items()}  # local steps move this copy only
        g = np.zeros((plan.steps, plan.perturbations), dtype=np.float32)
        losses: list[float] = []
        runs = 0
        for step, seeds in enumerate(plan.seeds):
            idx = next(batches)
            probes = npzo.step_probes(seeds, plan.eps, plan.one_sided)
            values, n = self.probe_losses(theta, [examples.texts[i] for i in idx],
                                          examples.labels[idx], probes)
            runs += n
            g[step] = npzo.step_scalars(values, len(seeds), plan.eps, plan.one_sided,
                                        plan.clip)
            coefs = npzo.update_coefficients(g[step], plan.lr, plan.perturbations)
            npzo.np_apply_seeds(theta, seeds, coefs.tolist(), self.spec.step_scales)
            losses.append(float(np.mean(values)))
        # Same weight rule as the torch device: the local training set's size (FedAvg's n_k).
        return OrtTrained(g, len(examples), float(np.mean(losses)), runs)

    def evaluate(self, examples: data_mod.Examples) -> tuple[float, float]:
        """(accuracy, mean loss) of the state it holds on labelled examples; (0, 0) for none."""
        if self.state is None:
            raise OrtDeviceError("the device holds no state to score")
        return score_state(self.model, self.state, examples)


def score_state(model: OrtModel, state: npzo.NpState, examples: data_mod.Examples,
                ) -> tuple[float, float]:
    """(accuracy, mean loss) of a trainable state on the bundle's forward; (0, 0) for no
    examples (a device's held-out set; `seedfed evaluate --device` on a stored state)."""
    if len(examples) == 0:
        return 0.0, 0.0
    stacked = {k: v[None] for k, v in state.items()}
    correct, loss_sum = 0, 0.0
    for start in range(0, len(examples), EVAL_BATCH):
        texts = examples.texts[start:start + EVAL_BATCH]
        labels = examples.labels[start:start + EVAL_BATCH]
        logits = model.logits(model.features(texts), stacked)
        loss_sum += float(example_losses(logits, labels)[0].sum(dtype=np.float32))
        correct += int((logits[0].argmax(axis=-1) == labels).sum())
    return correct / len(examples), loss_sum / len(examples)
