"""A device's personal part: a small head of its own, trained by ZO on its own data, never sent.

The shared model (what the fleet trains and the coordinator publishes) stays the one every device
syncs to. On top of it a device keeps parameters that live only on the device, chosen by
measurement (docs/personalization.md) among three forms of one thing, a linear map from the
features the shared head sees to the class logits:

- `residual` (the default): logits = shared head(f) + personal residual(f). The residual starts
  at zero and is pulled back to zero by an L2 penalty, so a device with no personal signal
  scores exactly the shared model, and every later shared version reaches the device at once
  (the residual is added to whatever the device syncs to).
- `ditto`: a personal copy of the head, initialized from the shared head when the device first
  trains and regularized towards the current shared head (Ditto, Li et al. 2021).
- `fedper`: a personal copy of the head, initialized from the shared head once and then trained
  freely (FedPer / FedRep: shared body, personal head); it no longer follows the fleet.

Each form applies only where the device has evidence (`client.personal_gate`): inputs far from
every example the personal part trained on keep the shared model's logits.

A device also trains a *local-only* head (from the task's prototype head, on its own data only,
with the same ZO budget): the evaluation's reference for "what this device could learn alone".

Training is ZO (SPSA with Rademacher directions) like the shared steps, but on the head's input
features only: one forward of a batch through the frozen model (a sentence-transformers model
answers it from its feature cache) and 2P probes that are one small matrix product each. The
features of one batch at a time are held, so a device stays at inference memory.

The personal state (safetensors) carries the task id and a fingerprint of the model it was
trained on (`model_fingerprint`: the exact bits of the model's frozen weights, so a restart under
another thread count or kernel keeps it); a state of another task, another model or a corrupt
file is refused with a clear message and rebuilt from scratch, never applied, and the shared
state is never touched.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from seedfed.client import data as data_mod
from seedfed.client.device_data import on_model_device
from seedfed.client.personal_gate import EvidenceGate, gated
from seedfed.shared.model.factory import ModelBundle
from seedfed.shared.model.head import classifier_module
from seedfed.shared.protocol.errors import ScopeError, SeedfedError
from torch import nn

log = logging.getLogger(__name__)

#: The personal forms (see the module docstring); "off": no personal part.
METHODS: tuple[str, ...] = ("residual", "ditto", "fedper", "off")
#: `format` in a personal state file's metadata.
FORMAT = "seedfed-personal/1"
#: `identity` in a personal state file's metadata: how its `fingerprint` names the model
#: (`model_fingerprint`). A state without it carries the earlier, rounded fingerprint
#: (`legacy_fingerprints`): accepted when it is this model's, and rewritten with the exact one
#: at the device's next save.
IDENTITY = "exact-frozen-sha256"
#: Texts per forward when computing features for the personal head (the batch a device
#: scores its held-out set with, `device_data.local_accuracy`: no larger activations).
FEATURE_BATCH = 32


class PersonalStateError(SeedfedError, ValueError):
    """A stored personal state that this device must not apply (another task or model,
    another method, corrupt)."""


@dataclass(frozen=True)
class PersonalConfig:
    """How a device trains its personal part (device-side settings; never part of the task).

    Defaults measured on the per-device-taste task's validation split
    (`seedfed bench personalization`, docs/personalization.md)."""

    method: str = "residual"
    steps: int = 16  # ZO steps per round the device trains in
    perturbations: int = 16
    lr: float = 4.0
    eps: float = 1e-2
    batch_size: int = 32
    decay: float = 1e-3  # L2 pull: residual towards 0, ditto towards the shared head
    reference: bool = True  # also train the local-only reference head
    #: c of the bias entries (theta = c phi, SPSA on phi: the bias's probes are eps c z and its
    #: steps c^2 lr), as the recipes' `HEAD_STEP_SCALES` do for the shared head: the bias's
    #: constant feature gives it the largest curvature, which otherwise caps the lr that the
    #: weights' directions can take (docs/accuracy.md, "Why each setting")
    bias_scale: float = 0.1
    #: Apply the personal part only to inputs near the examples it trained on, the shared model
    #: elsewhere (`client.personal_gate`; docs/personalization.md, "The evidence gate").
    gate: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"personal method must be one of {METHODS}, got {self.method!r}")
        for name in ("steps", "perturbations", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "eps", "bias_scale"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not (math.isfinite(self.decay) and self.decay >= 0):
            raise ValueError(f"decay must be >= 0, got {self.decay}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class PersonalScores:
    """One device's held-out accuracies: the shared model, shared + personal, local only."""

    shared: float
    personal: float
    local: float | None
    examples: int


class Head:
    """A linear map features -> logits as one flat float32 vector (weight rows, then bias)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.labels, self.hidden = weight.shape
        self.theta = torch.cat([weight.reshape(-1), bias.reshape(-1)]).float().clone()

    @property
    def weight(self) -> torch.Tensor:
        return self.theta[: self.labels * self.hidden].view(self.labels, self.hidden)

    @property
    def bias(self) -> torch.Tensor:
        return self.theta[self.labels * self.hidden:]


def head_module(model: nn.Module) -> nn.Linear:
    """The Linear layer that produces the logits in a forward: the classifier, or under peft
    (a LoRA task whose head trains) its `modules_to_save` copy."""
    try:
        return classifier_module(model)
    except ScopeError:
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and name.endswith(
                    ("classifier.modules_to_save.default", "score.modules_to_save.default")):
                return mod
        raise


def shared_head(model: nn.Module) -> Head:
    """The shared model's head as it stands (the version the device synced to), on the CPU
    where the personal part trains whatever device the model runs on."""
    head = head_module(model)
    bias = head.bias if head.bias is not None else torch.zeros(head.out_features)
    return Head(head.weight.detach().cpu(), bias.detach().cpu())


def _logits(theta: torch.Tensor, feats: torch.Tensor, labels: int) -> torch.Tensor:
    """Logits of one head vector (..., L*H + L) on features (B, H): (..., B, L)."""
    hidden = feats.shape[1]
    w = theta[..., : labels * hidden].reshape(*theta.shape[:-1], labels, hidden)
    b = theta[..., labels * hidden:]
    return torch.matmul(feats, w.transpose(-1, -2)) + b.unsqueeze(-2)


@torch.no_grad()
def features(bundle: ModelBundle, examples: data_mod.Examples,
             batch_size: int = FEATURE_BATCH) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(features the head sees, labels) of the examples, one batch at a time, in order."""
    head = head_module(bundle.model)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, args, _o: captured.append(args[0].detach()))
    try:
        for batch in data_mod.eval_batches(examples, bundle.tokenizer, batch_size,
                                           bundle.spec.max_seq_len):
            inputs = on_model_device({k: v for k, v in batch.items() if k != "labels"},
                                     bundle.model)
            captured.clear()
            bundle.model(**inputs)
            feats = captured[-1].float().cpu()  # the personal head lives on the CPU
            yield feats.reshape(-1, feats.shape[-1]), batch["labels"]
    finally:
        handle.remove()


@torch.no_grad()
def model_fingerprint(bundle: ModelBundle) -> str:
    """What a personal state was trained on, exactly: the task's model kind, labels and label
    texts, the head's width, and a SHA-256 of the exact bytes (name, dtype, shape, values) of
    every frozen parameter, the tensors the shared scope does not train (another base model
    differs there). Only bits the model files fix: nothing computed, so the fingerprint is
    the same under any thread count or kernel (a forward's float noise, such as the prototype
    head's, never enters it). Hashed tensor by tensor from the parameters' own memory: no
    copy of the model."""
    spec = bundle.spec
    digest = hashlib.sha256()
    for name, p in _frozen(bundle):
        t = p.detach().contiguous()
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).cpu().numpy().data)
    head = _head_or_none(bundle)
    desc = {"identity": IDENTITY, "model_kind": spec.model_kind, "num_labels": spec.num_labels,
            "label_texts": list(spec.label_texts),
            "hidden": head.in_features if head is not None else None,
            "frozen": digest.hexdigest()}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _head_or_none(bundle: ModelBundle) -> nn.Linear | None:
    """The classification head; None for a causal LM, which has none (its LM head is part of
    the frozen model the fingerprint hashes)."""
    if bundle.spec.model_kind == "causal_lm":
        return None
    return head_module(bundle.model)


def _frozen(bundle: ModelBundle) -> list[tuple[str, torch.Tensor]]:
    """The parameters neither the shared scope nor the head trains, in the model's order."""
    trained = {t.tensor.data_ptr() for t in bundle.scope}
    head = _head_or_none(bundle)
    head_ptrs = {p.data_ptr() for p in head.parameters()} if head is not None else set()
    return [(name, p) for name, p in bundle.model.named_parameters()
            if p.data_ptr() not in trained and p.data_ptr() not in head_ptrs]


@torch.no_grad()
def legacy_fingerprints(bundle: ModelBundle, prototype: Head, *, slack: float = 2e-3,
                        max_ambiguous: int = 10) -> set[str]:
    """The fingerprints a `seedfed-personal/1` state written before `IDENTITY` may carry for
    this model: that scheme hashed the prototype head rounded to 3 significant digits, which
    a kernel's float noise can move across a rounding boundary. Every value of the prototype
    within `slack` (relative, in units of its last kept digit) of a boundary is tried both
    ways (at most `max_ambiguous` of them: 2^10 hashes), so a state written by this model
    under another thread count is recognised, and one of another model is not."""
    spec = bundle.spec
    frozen = [[name, list(p.shape), _sample(p)] for name, p in _frozen(bundle)]
    base = {"model_kind": spec.model_kind, "num_labels": spec.num_labels,
            "label_texts": list(spec.label_texts), "hidden": prototype.hidden,
            "frozen": frozen}
    rounded = [float(f"{v:.3g}") for v in prototype.theta.tolist()]
    ambiguous: list[tuple[int, float]] = []
    for i, v in enumerate(prototype.theta.tolist()):
        if v == 0.0 or not math.isfinite(v):
            continue
        unit = 10.0 ** (math.floor(math.log10(abs(v))) - 2)  # the 3rd significant digit's
        frac = abs(v) / unit % 1.0
        if abs(frac - 0.5) < slack:  # near a rounding boundary: the other side's value
            other = math.copysign((math.floor(abs(v) / unit) + (frac < 0.5)) * unit, v)
            ambiguous.append((i, float(f"{other:.3g}")))
    out = set()
    for choice in itertools.product((False, True), repeat=min(len(ambiguous), max_ambiguous)):
        values = list(rounded)
        for (i, other), flip in zip(ambiguous, choice, strict=False):
            if flip:
                values[i] = other
        desc = base | {"prototype": values}
        out.add(hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest())
    return out


def _sample(t: torch.Tensor, n: int = 64) -> str:
    """SHA-256 of the exact bytes of n evenly strided elements of a tensor (the legacy
    fingerprint's sample of a frozen parameter)."""
    flat = t.detach().reshape(-1)
    picked = flat[:: max(1, flat.numel() // n)][:n].contiguous()
    return hashlib.sha256(picked.numpy().tobytes()).hexdigest()[:16]


class PersonalPart:
    """A device's personal head and its local-only reference, trained and scored by ZO."""

    def __init__(self, config: PersonalConfig, bundle: ModelBundle, task_id: str) -> None:
        if not config.enabled:
            raise ValueError("a PersonalPart needs a personal method, not 'off'")
        self.config, self.bundle, self.task_id = config, bundle, task_id
        # Built before any snapshot is loaded: the head is still the task's prototype head
        # (computed by build_model on both sides), the local-only reference's start.
        self.prototype = shared_head(bundle.model)
        self.fingerprint = model_fingerprint(bundle)
        self.personal: Head | None = None
        self.local: Head | None = None
        self.gate: EvidenceGate | None = None  # anchors of the last personal round
        self.rounds = 0
        self.refused: str | None = None  # why the last stored state was refused, if it was

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the personal part (and the reference): the device scores the shared model."""
        self.personal = self.local = None
        self.gate = None
        self.rounds = 0

    def to_bytes(self) -> bytes:
        """The personal state (an untrained or reset part: a file with no tensors, so a
        reset overwrites what a store kept)."""
        tensors: dict[str, torch.Tensor] = {}
        if self.personal is not None:
            tensors["personal"] = self.personal.theta
        if self.local is not None:
            tensors["local"] = self.local.theta
        if self.gate is not None:
            tensors["anchors"] = self.gate.anchors
        meta = {"format": FORMAT, "task": self.task_id, "fingerprint": self.fingerprint,
                "identity": IDENTITY,
                "method": self.config.method, "rounds": str(self.rounds),
                "labels": str(self.prototype.labels), "hidden": str(self.prototype.hidden)}
        if self.gate is not None:
            meta["radius"] = repr(self.gate.radius)
        return save(tensors, metadata=meta)

    def load_bytes(self, data: bytes) -> None:
        """Apply a stored personal state, or raise PersonalStateError and keep none."""
        try:
            tensors = load(data)
            meta = state_metadata(data)
        except (SafetensorError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise PersonalStateError(f"personal state is corrupt ({e})") from e
        if meta.get("format") != FORMAT:
            raise PersonalStateError(f"personal state has format {meta.get('format')!r}, "
                                     f"not {FORMAT!r}")
        if meta.get("task") != self.task_id:
            raise PersonalStateError(f"personal state belongs to task {meta.get('task')!r}, "
                                     f"not {self.task_id!r}")
        if meta.get("fingerprint") != self.fingerprint and (
                meta.get("identity") == IDENTITY
                or meta.get("fingerprint") not in legacy_fingerprints(self.bundle,
                                                                      self.prototype)):
            raise PersonalStateError("personal state was trained on another model (its "
                                     "fingerprint differs from this device's model)")
        if meta.get("method") != self.config.method:
            raise PersonalStateError(f"personal state is a {meta.get('method')!r} part, this "
                                     f"device trains {self.config.method!r}")
        gate = _stored_gate(tensors.pop("anchors", None), meta.get("radius"),
                            self.prototype.hidden)
        size = self.prototype.theta.numel()
        heads: dict[str, Head] = {}
        for name, theta in tensors.items():
            if name not in ("personal", "local") or theta.dtype != torch.float32 \
                    or theta.shape != (size,) or not bool(torch.isfinite(theta).all()):
                raise PersonalStateError(f"personal state tensor {name!r} is not {size} finite "
                                         "float32 values")
            head = Head(self.prototype.weight, self.prototype.bias)
            head.theta = theta.clone()
            heads[name] = head
        if "local" in heads and "personal" not in heads:
            raise PersonalStateError("personal state holds a reference but no personal part")
        self.personal, self.local = heads.get("personal"), heads.get("local")
        self.gate = gate
        try:
            self.rounds = int(meta.get("rounds", "0"))
        except ValueError as e:
            raise PersonalStateError(f"personal state is corrupt ({e})") from e

    def restore(self, data: bytes | None) -> None:
        """`load_bytes`, except that a refused state is logged and rebuilt from scratch."""
        self.refused = None
        if data is None:
            return
        try:
            self.load_bytes(data)
        except PersonalStateError as e:
            self.reset()
            self.refused = str(e)
            log.warning("%s; the personal part is rebuilt from scratch (the shared model is "
                        "unaffected)", e)

    # -- the forms -------------------------------------------------------------------------------
    def _start(self, shared: Head) -> Head:
        if self.config.method == "residual":
            return Head(torch.zeros_like(shared.weight), torch.zeros_like(shared.bias))
        return Head(shared.weight, shared.bias)  # ditto, fedper: a personal copy

    def _base_and_centre(self, shared: Head) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(head added to the personal one's logits, point the L2 penalty pulls towards)."""
        if self.config.method == "residual":
            return shared.theta, torch.zeros_like(shared.theta)
        if self.config.method == "ditto":
            return None, shared.theta
        return None, None  # fedper

    # -- training --------------------------------------------------------------------------------
    def train(self, examples: data_mod.Examples, rng: np.random.Generator) -> float:
        """One round of personal ZO steps (and of the reference's) on the device's training
        examples; returns the personal part's mean loss."""
        if len(examples) == 0:
            return 0.0
        shared = shared_head(self.bundle.model)
        if self.personal is None:
            self.personal = self._start(shared)
            self.local = Head(self.prototype.weight, self.prototype.bias) \
                if self.config.reference else None
        base, centre = self._base_and_centre(shared)
        cfg = self.config
        losses = []
        size = min(cfg.batch_size, len(examples))
        picks = [rng.choice(len(examples), size=size, replace=False) for _ in range(cfg.steps)]
        # The features of the round's examples, computed once (the shared version is fixed
        # for the round): at most steps x batch_size rows, whatever the device's data size.
        used = np.unique(np.concatenate(picks))
        rows = {int(i): j for j, i in enumerate(used)}
        parts = list(features(self.bundle, examples.subset(used)))
        all_feats = torch.cat([f for f, _ in parts])
        all_labels = torch.cat([y for _, y in parts])
        self.gate = EvidenceGate.of(all_feats)
        for pick in picks:
            idx = torch.tensor([rows[int(i)] for i in pick])
            feats, labels = all_feats[idx], all_labels[idx]
            z = torch.from_numpy(rng.integers(0, 2, size=(cfg.perturbations,
                                                          shared.theta.numel()))
                                 .astype(np.float32) * 2 - 1)
            losses.append(self._step(self.personal, feats, labels, z, base, centre))
            if self.local is not None:
                self._step(self.local, feats, labels, z, None, None)
        self.rounds += 1
        return float(np.mean(losses))

    def _step(self, head: Head, feats: torch.Tensor, labels: torch.Tensor, z: torch.Tensor,
              base: torch.Tensor | None, centre: torch.Tensor | None) -> float:
        """One SPSA step: all 2P probes in one batched product, theta -= lr * mean(g z)."""
        cfg = self.config
        if cfg.bias_scale != 1.0:  # the bias's directions scaled by c (theta = c phi)
            z = z.clone()
            z[:, -self.prototype.labels:] *= cfg.bias_scale
        probes = torch.cat([head.theta + cfg.eps * z, head.theta - cfg.eps * z])  # (2P, D)
        losses = self._loss(probes, feats, labels, base, centre)
        g = (losses[: cfg.perturbations] - losses[cfg.perturbations:]) / (2 * cfg.eps)
        head.theta -= cfg.lr * (g[:, None] * z).mean(dim=0)
        return float(losses.mean())

    def _loss(self, thetas: torch.Tensor, feats: torch.Tensor, labels: torch.Tensor,
              base: torch.Tensor | None, centre: torch.Tensor | None) -> torch.Tensor:
        n_labels = self.prototype.labels
        logits = _logits(thetas, feats, n_labels)  # (K, B, L)
        if base is not None:
            logits = logits + _logits(base, feats, n_labels)
        k = thetas.shape[0]
        ce = nn.functional.cross_entropy(logits.reshape(-1, n_labels), labels.repeat(k),
                                         reduction="none").view(k, -1).mean(dim=1)
        if centre is not None and self.config.decay > 0:
            ce = ce + self.config.decay * ((thetas - centre) ** 2).sum(dim=1)
        return ce

    # -- scoring ---------------------------------------------------------------------------------
    def personal_logits(self, feats: torch.Tensor, shared: Head) -> torch.Tensor:
        """Logits of shared + personal (the shared model's own while nothing is trained)."""
        labels = self.prototype.labels
        if self.personal is None:
            return _logits(shared.theta, feats, labels)
        base = _logits(shared.theta, feats, labels)
        out = _logits(self.personal.theta, feats, labels)
        if self.config.method == "residual":
            out = out + base
        return gated(out, base, self.gate if self.config.gate else None, feats)

    @torch.no_grad()
    def score(self, examples: data_mod.Examples) -> PersonalScores | None:
        """Held-out accuracy of the shared model, shared + personal, and the local-only head."""
        if len(examples) == 0:
            return None
        shared = shared_head(self.bundle.model)
        right = {"shared": 0, "personal": 0, "local": 0}
        labels_n = self.prototype.labels
        for feats, labels in features(self.bundle, examples):
            right["shared"] += int((_logits(shared.theta, feats, labels_n).argmax(-1)
                                    == labels).sum())
            right["personal"] += int((self.personal_logits(feats, shared).argmax(-1)
                                      == labels).sum())
            if self.local is not None:
                right["local"] += int((_logits(self.local.theta, feats, labels_n).argmax(-1)
                                       == labels).sum())
        n = len(examples)
        return PersonalScores(right["shared"] / n, right["personal"] / n,
                              right["local"] / n if self.local is not None else None, n)


def _stored_gate(anchors: torch.Tensor | None, radius: str | None, hidden: int
                 ) -> EvidenceGate | None:
    """The evidence gate of a stored state (none in a state written before the gate, or
    before the first personal round), or PersonalStateError."""
    if anchors is None and radius is None:
        return None
    try:
        if anchors is None or radius is None or anchors.dim() != 2 or anchors.shape[1] != hidden:
            raise ValueError(f"anchors and radius must come together, {hidden} features wide")
        return EvidenceGate(anchors.clone(), float(radius))
    except ValueError as e:
        raise PersonalStateError(f"personal state's evidence gate is corrupt ({e})") from e


def state_metadata(data: bytes) -> dict[str, Any]:
    """The `__metadata__` of a safetensors buffer (header: 8-byte length, then JSON)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("metadata is not an object")
    return dict(meta)
