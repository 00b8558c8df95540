"""The task definition both sides derive the model, the scope and the round plans from.

A task names a local Hugging Face model directory (each device holds its own copy of the frozen
base), the kind of head, the trainable scope, the published format and the ZO hyperparameters.
Version 0 of the trainable state is whatever the coordinator's snapshot 0 holds (it initializes
heads and adapters once, deterministically); devices load the base and then that snapshot.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, NamedTuple

from .aggregate import AggregationConfig
from .scope_options import ScopeOptions, TernaryOptions, options_for

#: Version of the TaskSpec JSON layout. 1: before `spec_version` existed (options an untyped
#: object); 2: typed scope options (the same JSON object, validated per scope kind); 3: per-tensor
#: step scales (`step_scales`, empty before); 4: an lr schedule (`Hyper.decay_rounds`,
#: `Hyper.lr_final_ratio`; absent before, a constant lr). A spec of an older version is read and
#: upgraded; a newer one is refused.
SPEC_VERSION = 4

#: Extra activation memory (MB) a device may spend stacking probes in one forward, unless the
#: task says otherwise (`Hyper.probe_memory_mb`; `seedfed.shared.probes`).
DEFAULT_PROBE_MEMORY_MB = 32.0

ModelKind = Literal["causal_lm", "seq_cls"]
Format = Literal["fp32", "fp16", "bf16", "int8", "int4", "ternary"]
FORMATS: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4", "ternary")


@dataclass(frozen=True)
class LoraOptions:
    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("query", "value")
    train_head: bool = True  # also train the classification head (peft modules_to_save)

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.r}")
        if not self.target_modules:
            raise ValueError("LoRA needs at least one target module name")


@dataclass(frozen=True)
class Hyper:
    """ZO hyperparameters of every round of the task."""

    lr: float = 1e-4
    eps: float = 1e-3
    steps: int = 10
    perturbations: int = 1
    batch_size: int = 16
    clip: float | None = None
    one_sided: bool = False
    #: Probes a device stacks along the batch per forward (None: as many as its memory budget
    #: allows). Task creation refuses a value whose activations exceed `probe_memory_mb`.
    probe_copies: int | None = None
    #: Extra activation memory (MB) a device may spend on stacked probes.
    probe_memory_mb: float = DEFAULT_PROBE_MEMORY_MB
    #: Cosine-decay the planned lr over rounds 1..decay_rounds, from `lr` to
    #: `lr * lr_final_ratio`, which every later round keeps (None: every round plans `lr`).
    #: The coordinator writes each round's lr into its plan, so devices and replay read it
    #: from there: a schedule changes no wire message and no replay rule.
    decay_rounds: int | None = None
    lr_final_ratio: float = 0.1

    def __post_init__(self) -> None:
        for name in ("lr", "eps"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be positive and finite, got {v}")
        for name in ("steps", "perturbations", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive or None, got {self.clip}")
        copies = self.perturbations + 1 if self.one_sided else 2 * self.perturbations
        if self.probe_copies is not None and not 1 <= self.probe_copies <= copies:
            raise ValueError(f"probe_copies must be between 1 and the {copies} probes of a step "
                             f"(perturbations {self.perturbations}), got {self.probe_copies}")
        if not (math.isfinite(self.probe_memory_mb) and self.probe_memory_mb >= 0):
            raise ValueError(f"probe_memory_mb must be finite and >= 0, got "
                             f"{self.probe_memory_mb}")
        if self.decay_rounds is not None and self.decay_rounds < 1:
            raise ValueError(f"decay_rounds must be >= 1 or None, got {self.decay_rounds}")
        if not (math.isfinite(self.lr_final_ratio) and 0 < self.lr_final_ratio <= 1):
            raise ValueError(f"lr_final_ratio must be in (0, 1], got {self.lr_final_ratio}")

    def lr_of_round(self, number: int) -> float:
        """The lr the plan of round `number` (1-based) carries: `lr`, or on the cosine from
        `lr` at round 1 to `lr * lr_final_ratio` at round `decay_rounds` and after. binary64,
        computed only by the coordinator (the plan carries the result)."""
        if number < 1:
            raise ValueError(f"rounds are numbered from 1, got {number}")
        if self.decay_rounds is None:
            return self.lr
        final = self.lr * self.lr_final_ratio
        if number > self.decay_rounds:
            return final
        t = (number - 1) / max(1, self.decay_rounds - 1)  # 0 at round 1 (a one-round decay too)
        return final + (self.lr - final) * 0.5 * (1.0 + math.cos(math.pi * t))


class RoundHyper(NamedTuple):
    """What a round's plan carries beyond its seeds' values (`TaskSpec.round_hyper`)."""

    lr: float
    steps: int
    perturbations: int


@dataclass(frozen=True)
class TaskSpec:
    """A task definition. `scope_options` holds the typed options of `scope`
    (`seedfed.shared.scope_options`); a JSON object (or None) is accepted on input, as stored
    specs and older callers give it, and validated into them."""

    model_path: str
    model_kind: ModelKind = "seq_cls"
    num_labels: int = 2
    label_texts: tuple[str, ...] = ()  # e.g. ("negative", "positive"): head initialized from them
    scope: str = "lora"
    scope_options: ScopeOptions = field(default_factory=ScopeOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    format: Format = "fp32"
    hyper: Hyper = field(default_factory=Hyper)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    max_seq_len: int = 128
    #: (substring, c_t) pairs: a scoped tensor whose canonical name contains the substring
    #: trains as theta0_t + c_t * phi_t (probes fl32(eps c_t) z, updates fl32(coef c_t) z;
    #: `ScopedTensor.step_scale`); the first matching pair wins, unmatched tensors keep 1.0.
    #: Lets one plan lr move a head and a far more sensitive body tensor at once.
    step_scales: tuple[tuple[str, float], ...] = ()
    spec_version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        if self.spec_version != SPEC_VERSION:
            raise ValueError(f"spec_version {self.spec_version} is not {SPEC_VERSION}; read "
                             "older specs with TaskSpec.from_dict, which upgrades them")
        # frozen: the typed form replaces what was given (a JSON object, None, or options)
        object.__setattr__(self, "scope_options", options_for(self.scope, self.scope_options))
        object.__setattr__(self, "step_scales", _step_scales(self.step_scales))
        if self.model_kind not in ("causal_lm", "seq_cls"):
            raise ValueError(f"model_kind must be causal_lm or seq_cls, got {self.model_kind!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.model_kind == "seq_cls" and self.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2, got {self.num_labels}")
        if self.label_texts and len(self.label_texts) != self.num_labels:
            raise ValueError(f"{len(self.label_texts)} label texts for {self.num_labels} labels")
        if self.scope == "scales" and self.format not in ("int8", "int4"):
            # QZO trains the group scales of a quantized model: a float model has none.
            raise ValueError(f"scope 'scales' needs format int8 or int4, got {self.format!r}")
        # scope 'lora' on int8/int4: the adapters are applied to the float model first and the
        # base Linear layers under them quantized afterwards (QLoRA's layout: a quantized shared
        # base, float adapters), so nothing needs refusing here (`shared.models.build_model`).
        if self.scope == "ternary" and self.model_kind == "causal_lm" and \
                getattr(self.scope_options, "train_head", False):
            # A causal LM's head (lm_head) is no classification head; the latents train.
            raise ValueError("scope 'ternary': train_head applies to seq_cls tasks only")
        # A ternary seq_cls task: the coordinator sets the prototype head on the ternary
        # forward and every snapshot carries it (`shared.ternary.build_packed_model`).

    def round_hyper(self, number: int, version: int) -> RoundHyper:
        """(lr, steps, seeds per step) of the plan of round `number`, opened at `version`.

        `Hyper.lr_of_round`, `steps` and `perturbations`, except in the head epochs of a
        ternary task with alternate epochs: there `head_lr` (on the same schedule),
        `head_steps` and `head_perturbations` where the options set them. Computed by the
        coordinator only: the plan carries all three (its lr, its steps x perturbations seed
        matrix), so devices, uploads and replay read them from there."""
        h, opts = self.hyper, self.scope_options
        if isinstance(opts, TernaryOptions) and opts.mask.head_epoch(opts.mask.epoch_of(version)):
            head = replace(h, lr=h.lr if opts.head_lr is None else opts.head_lr)
            return RoundHyper(head.lr_of_round(number), opts.head_steps or h.steps,
                              opts.head_perturbations or h.perturbations)
        return RoundHyper(h.lr_of_round(number), h.steps, h.perturbations)

    def largest_plan(self) -> tuple[int, int]:
        """(steps, perturbations): the largest seed matrix any round of the task plans (what
        upload and body limits must admit)."""
        h, opts = self.hyper, self.scope_options
        if isinstance(opts, TernaryOptions) and opts.alternate:
            return (max(h.steps, opts.head_steps or 0),
                    max(h.perturbations, opts.head_perturbations or 0))
        return h.steps, h.perturbations

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the spec (scope options: only the fields off their default)."""
        return {**asdict(self), "scope_options": self.scope_options.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskSpec:
        """A spec from its JSON object, of this `SPEC_VERSION` or an older one (upgraded)."""
        d = dict(d)
        version = d.pop("spec_version", 1)
        if not isinstance(version, int) or not 1 <= version <= SPEC_VERSION:
            raise ValueError(f"spec_version {version!r} is not one this seedfed reads "
                             f"(1..{SPEC_VERSION})")
        # 1 -> 2: the same option names, now typed (`__post_init__` checks them against the
        # scope's options class).
        d["lora"] = LoraOptions(**{**d.get("lora", {}),
                                   "target_modules": tuple(d.get("lora", {}).get(
                                       "target_modules", LoraOptions().target_modules))})
        d["hyper"] = Hyper(**d.get("hyper", {}))
        d["aggregation"] = AggregationConfig(**d.get("aggregation", {}))
        d["label_texts"] = tuple(d.get("label_texts", ()))
        # 2 -> 3: no step scales (every c_t = 1, the same bits as before). 3 -> 4: no lr
        # schedule (Hyper's defaults: a constant lr, the same plans as before).
        d["step_scales"] = _step_scales(d.get("step_scales", ()))
        return cls(**d)


def _step_scales(pairs: Any) -> tuple[tuple[str, float], ...]:
    """Validated `TaskSpec.step_scales` from pairs or their JSON form (lists of two)."""
    out: list[tuple[str, float]] = []
    for pair in pairs or ():
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"step_scales entries are (pattern, scale) pairs, got {pair!r}")
        pattern, c = pair
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"step scale pattern must be a non-empty string, got {pattern!r}")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (
                math.isfinite(c) and c > 0):
            raise ValueError(f"step scale of {pattern!r} must be positive and finite, got {c!r}")
        out.append((pattern, float(c)))
    if len({p for p, _ in out}) != len(out):
        raise ValueError("step_scales names a pattern twice")
    return tuple(out)
