"""The ONNX Runtime backend: sync, ZO probes and scoring with numpy, no torch.

`OrtBackend` runs an fp32 task on its exported bundle (`bundle`, `runtime`) behind
`client.backends.base.Backend`, with the same rules as the torch backend, so the coordinator
cannot tell the two apart. The bundle is a sentence encoder's head (`OrtModel`) or a causal
LM's LoRA adapters (`OrtLM`); either way the trainable tensors are named float32 arrays here
and graph inputs there:

- replay the log entries (`shared.protocol.npzo.np_replay`, the bits of `shared.model.replay`)
  or load a snapshot (safetensors of flat float32 tensors), checksum verified;
- train: the batches `client.data.batch_indices` draws from the same generator
  ([data seed, partition, round]), every probe of a step on the step's batch (a causal LM's:
  the token ids `client.objective_batches` gives the torch device), probes
  theta + scale c_t z(seed) built from the shared stream (`shared.protocol.philox`; c_t the
  task's per-tensor step scale, `TaskSpec.step_scales`, 1 unless it names the tensor), C probes
  per `top.onnx` / `lm.onnx` run, the scalar rule and the local update of `npzo`; the state is
  back at the plan's version afterwards;
- evaluate: accuracy and mean loss on a local held-out set, as the torch device's
  `local_accuracy` defines them for the objective (a next-token LM: next-word top-1 accuracy
  and the mean loss per token).

No personal part: `personal_part` answers None.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors
from seedfed.client import data as data_mod
from seedfed.client.backends.base import (
    FP32,
    DeviceStateError,
    StoredState,
    SyncResult,
    Trained,
)
from seedfed.client.backends.ort.bundle import BundleError
from seedfed.client.backends.ort.runtime import OrtLM, OrtModel, example_losses, mean_losses
from seedfed.client.device_data import DeviceData
from seedfed.shared.protocol import npzo
from seedfed.shared.protocol.errors import (
    ChecksumMismatchError,
    LogEntryMismatchError,
    WireFormatError,
)
from seedfed.shared.protocol.philox import add_dense
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan

if TYPE_CHECKING:
    from seedfed.client.backends.base import PersonalHead
    from seedfed.client.personal import PersonalConfig

#: Texts per encoder run when scoring.
EVAL_BATCH = 32


def read_state(data: bytes, model: OrtModel | OrtLM) -> npzo.NpState:
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


class OrtBackend:
    """A task's forward on an ORT bundle (the task's exported model)."""

    snapshot_format = FP32

    def __init__(self, spec: TaskSpec, model: OrtModel | OrtLM) -> None:
        model.manifest.check_spec(spec)
        names = [t.name for t in model.manifest.tensors]
        bad = npzo.unmatched_step_scales(spec.step_scales, names)
        if bad:
            raise BundleError(f"step scale pattern {bad[0]!r} matches no tensor of the "
                              f"bundle ({', '.join(names)})")
        self.spec, self.model = spec, model
        self.state: npzo.NpState | None = None
        self.version: int | None = None
        self.checksum = ""

    # -- state -------------------------------------------------------------------------------
    def forget(self) -> None:
        self.state, self.version, self.checksum = None, None, ""

    def load_snapshot(self, data: bytes, version: int, checksum: str) -> None:
        """Load a snapshot of `version`; refused (nothing changes) unless it hashes to
        `checksum`."""
        state = read_state(data, self.model)
        got = npzo.np_checksum(state)
        if got != checksum:
            raise ChecksumMismatchError(f"snapshot hashes to {got[:16]}..., the coordinator "
                                        f"published {checksum[:16]}...; refusing it")
        self.state, self.version, self.checksum = state, version, got

    def replay(self, *, task_id: str, entries: Sequence[npzo.LogEntry], target: int,
               ) -> SyncResult:
        """Replay the entries from its version to `target`; on a mismatch the state is back
        where it was (`np_replay`)."""
        if self.state is None or self.version is None:
            raise LogEntryMismatchError(f"task {task_id}: no state to replay into")
        needed = sorted((e for e in entries if self.version <= e.base_version < target),
                        key=lambda e: e.base_version)
        have = [e.base_version for e in needed]
        if have != list(range(self.version, target)):
            raise LogEntryMismatchError(
                f"task {task_id}: cannot replay v{self.version} -> v{target} from entries "
                f"starting at {have[:5]}; load a snapshot instead")
        version, chk = npzo.np_replay(self.state, needed, task_id=task_id,
                                      version=self.version, step_scales=self.spec.step_scales)
        self.version, self.checksum = version, chk
        return SyncResult(version, chk, "replay", len(needed))

    def restore(self, stored: StoredState) -> None:
        if stored.state is None:
            raise DeviceStateError(f"no stored state of v{stored.version}")
        self.load_snapshot(stored.state, stored.version, stored.checksum)

    def state_bytes(self) -> bytes:
        if self.state is None:
            raise DeviceStateError("the device holds no state")
        return save_safetensors(self.state)

    def stored(self, task_id: str) -> StoredState:
        assert self.version is not None
        return StoredState(task_id, self.version, self.checksum, self.state_bytes())

    def state_sizes(self) -> list[tuple[str, int]]:
        return [] if self.state is None else [(t.name, t.numel)
                                              for t in self.model.manifest.tensors]

    def calibrate_replay_rate(self, seeds: int = 8, repeats: int = 3) -> float:
        """Elements x seeds per second of `np_apply_seeds` + `np_checksum` (a replayed
        entry's work) on zeroed tensors shaped like the bundle's; median of `repeats`."""
        scratch = {t.name: np.zeros(t.numel, dtype=np.float32)
                   for t in self.model.manifest.tensors}
        total = sum(v.size for v in scratch.values())
        coefs = [1e-3 * (i + 1) for i in range(seeds)]
        times = []
        for r in range(repeats):
            t0 = time.perf_counter()
            npzo.np_apply_seeds(scratch, list(range(r * seeds, (r + 1) * seeds)), coefs,
                                self.spec.step_scales)
            npzo.np_checksum(scratch)
            times.append(time.perf_counter() - t0)
        return total * seeds / max(statistics.median(times), 1e-9)

    def personal_part(self, config: PersonalConfig, task_id: str) -> PersonalHead | None:
        return None

    # -- a round -----------------------------------------------------------------------------
    def copies_per_run(self, probes: int, batch: int, seq: int = 1) -> int:
        """Probes stacked per graph run: the task's `probe_copies`, else as many as fit
        `probe_memory_mb`, at most the step's. Per copy: the stacked tensors and the head's
        logits; a causal LM's copy also holds its T x V logits and log-probabilities and a
        few H-wide states per token (an estimate: the scalars do not depend on it)."""
        hyper = self.spec.hyper
        if hyper.probe_copies is not None:
            return max(1, min(probes, hyper.probe_copies))
        manifest = self.model.manifest
        per_token = manifest.hidden_size + self.spec.num_labels
        if manifest.lm is not None:
            per_token = 2 * manifest.lm.vocab_size + 8 * manifest.hidden_size
        per_copy = 4 * (sum(t.numel for t in manifest.tensors) + batch * seq * per_token)
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
        model = self.model
        if isinstance(model, OrtLM):
            batch = model.batch(texts, labels)
            n = self.copies_per_run(len(probes), len(texts), batch["input_ids"].shape[1])

            def losses(stacked: npzo.NpState) -> np.ndarray:
                return model.run(batch, stacked)["losses"]
        else:
            feats = model.features(texts)
            n = self.copies_per_run(len(probes), len(texts))

            def losses(stacked: npzo.NpState) -> np.ndarray:
                return mean_losses(model.logits(feats, stacked), labels)
        out: list[float] = []
        runs = 0
        for start in range(0, len(probes), n):
            group = [self._probe_state(theta, p) for p in probes[start:start + n]]
            out += [float(v) for v in losses({k: np.stack([g[k] for g in group])
                                              for k in theta})]
            runs += 1
        return out, runs

    def train(self, plan: RoundPlan, examples: data_mod.Examples, data: DeviceData) -> Trained:
        """Run the plan's steps from the plan's version; the state stays at that version."""
        if self.state is None or self.version != plan.version:
            raise DeviceStateError(f"device is at v{self.version}, the plan at v{plan.version}")
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
        # Same weight rule as the torch backend: the local training set's size (FedAvg's n_k).
        return Trained(g, len(examples), float(np.mean(losses)), runs)

    def evaluate(self, examples: data_mod.Examples) -> tuple[float, float]:
        """(accuracy, mean loss) of the state it holds on labelled examples; (0, 0) for none."""
        if self.state is None:
            raise DeviceStateError("the device holds no state to score")
        if isinstance(self.model, OrtLM):
            return score_lm(self.model, self.state, examples)
        return score_state(self.model, self.state, examples)


def score_lm(model: OrtLM, state: npzo.NpState, examples: data_mod.Examples,
             ) -> tuple[float, float]:
    """`local_accuracy` of a causal LM's LoRA state on its bundle: label words, accuracy of
    the class prediction and mean cross-entropy per example; next token, next-word top-1
    accuracy (at word-start targets) and mean loss per token. (0, 0) for no examples."""
    if len(examples) == 0:
        return 0.0, 0.0
    stacked = {k: v[None] for k, v in state.items()}
    starts = model.lm.starts() if model.objective == "next_token" else None
    correct = scored = tokens = 0
    loss_sum = 0.0
    for start in range(0, len(examples), EVAL_BATCH):
        texts = examples.texts[start:start + EVAL_BATCH]
        labels = examples.labels[start:start + EVAL_BATCH]
        batch = model.batch(texts, labels)
        out = model.run(batch, stacked)
        if starts is None:
            logits = out["logits"]
            loss_sum += float(example_losses(logits, labels)[0].sum(dtype=np.float32))
            correct += int((logits[0].argmax(axis=-1) == labels).sum())
            scored += len(texts)
            continue
        target = batch["labels"][:, 1:]
        keep = target != -100
        safe = np.maximum(target, 0)
        word = keep & starts[safe]
        loss_sum += float(out["token_nll"][0].sum(dtype=np.float32))
        tokens += int(keep.sum())
        scored += int(word.sum())
        correct += int(((out["top1"][0] == safe) & word).sum())
    if starts is None:
        return correct / scored, loss_sum / scored
    return (correct / scored if scored else 0.0), (loss_sum / tokens if tokens else 0.0)


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
