"""The task definition both sides derive the model, the scope and the round plans from.

A task names a local Hugging Face model directory (each device holds its own copy of the frozen
base), the kind of head, the trainable scope, the published format and the ZO hyperparameters.
Version 0 of the trainable state is whatever the coordinator's snapshot 0 holds (it initializes
heads and adapters once, deterministically); devices load the base and then that snapshot.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from seedfed.shared.protocol import ranges as R
from seedfed.shared.protocol.aggregate import DEFAULT_MAX_WEIGHT_RATIO, AggregationConfig
from seedfed.shared.protocol.objective import Objective, default_kind
from seedfed.shared.protocol.ranges import (
    Range,
    bounded,
    check_fields,
    check_names,
    check_value,
    help_of,
)
from seedfed.shared.protocol.scope_options import ScopeOptions, TernaryOptions, options_for

#: Version of the TaskSpec JSON layout. 1: before `spec_version` existed (options an untyped
#: object); 2: typed scope options (the same JSON object, validated per scope kind); 3: per-tensor
#: step scales (`step_scales`, empty before); 4: an lr schedule (`Hyper.decay_rounds`,
#: `Hyper.lr_final_ratio`; absent before, a constant lr). A spec of an older version is read and
#: upgraded; a newer one is refused.
SPEC_VERSION = 4

#: Extra activation memory (MB) a device may spend stacking probes in one forward, unless the
#: task says otherwise (`Hyper.probe_memory_mb`; `seedfed.client.probes`).
DEFAULT_PROBE_MEMORY_MB = 32.0

ModelKind = Literal["causal_lm", "seq_cls"]
Format = Literal["fp32", "fp16", "bf16", "int8", "int4", "ternary"]
FORMATS: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4", "ternary")


@dataclass(frozen=True)
class LoraOptions:
    """The LoRA adapters of a `lora` task (peft's LoraConfig fields of the same names)."""

    r: int = field(default=8, metadata=bounded(Range(1, R.MAX_LORA_RANK, integer=True), (
        "rank of each adapter: it adds r x (d_in + d_out) values per targeted matrix")))
    alpha: int = field(default=16, metadata=bounded(Range(1, R.MAX_LORA_ALPHA, integer=True),
                                                    "scaling numerator (the update is "
                                                    "alpha / r x B A)"))
    target_modules: tuple[str, ...] = field(default=("query", "value"), metadata={
        "help": "module name substrings the adapters wrap (1..256 names)"})
    #: also train the classification head (peft modules_to_save)
    train_head: bool = field(default=True, metadata={
        "help": "also train the classification head (peft modules_to_save)"})

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> what it does and its range."""
        return help_of(cls)

    def __post_init__(self) -> None:
        check_fields(self, "lora.")
        if self.r < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.r}")
        if not self.target_modules:
            raise ValueError("LoRA needs at least one target module name")
        check_names("lora.target_modules", self.target_modules, at_least=1)


@dataclass(frozen=True)
class Hyper:
    """ZO hyperparameters of every round of the task. Each number has a range, checked when
    the task is defined (`Hyper.help()` lists them; `seedfed.shared.protocol.ranges` says why)."""

    lr: float = field(default=1e-4, metadata=bounded(Range(R.MIN_LR, R.MAX_LR), (
        "learning rate: an entry's coefficient is -(lr / perturbations) x the aggregated "
        "scalar (the schedule starts here)")))
    eps: float = field(default=1e-3, metadata=bounded(Range(R.MIN_EPS, R.MAX_EPS), (
        "probe scale: a device evaluates the loss at theta +- eps x z")))
    steps: int = field(default=10, metadata=bounded(Range(1, R.MAX_STEPS, integer=True), (
        "local ZO steps per round (steps x perturbations <= "
        f"{R.MAX_SEEDS_PER_ROUND} seeds a round)")))
    perturbations: int = field(default=1, metadata=bounded(
        Range(1, R.MAX_PERTURBATIONS, integer=True), "seeds (perturbations) per step"))
    batch_size: int = field(default=16, metadata=bounded(
        Range(1, R.MAX_BATCH_SIZE, integer=True),
        f"examples per device step (batch_size x max_seq_len <= {R.MAX_BATCH_TOKENS} tokens)"))
    clip: float | None = field(default=None, metadata=bounded(
        Range(0, R.MAX_ABS_SCALAR, lo_open=True),
        "a device clips each scalar to [-clip, clip] (None: the wire bound alone)"))
    one_sided: bool = field(default=False, metadata={
        "help": "one-sided difference (L(theta + eps z) - L(theta)) / eps instead of two-sided"})
    #: Probes a device stacks along the batch per forward (None: as many as its memory budget
    #: allows). Task creation refuses a value whose activations exceed `probe_memory_mb`.
    probe_copies: int | None = field(default=None, metadata=bounded(
        Range(1, 2 * R.MAX_PERTURBATIONS, integer=True),
        "probes a device stacks per forward, at most the step's probes (None: its memory "
        "budget decides)"))
    #: Extra activation memory (MB) a device may spend on stacked probes.
    probe_memory_mb: float = field(default=DEFAULT_PROBE_MEMORY_MB, metadata=bounded(
        Range(0, R.MAX_PROBE_MEMORY_MB), "extra activation memory (MB) a device may spend "
                                         "on stacked probes"))
    #: Cosine-decay the planned lr over rounds 1..decay_rounds, from `lr` to
    #: `lr * lr_final_ratio`, which every later round keeps (None: every round plans `lr`).
    #: The coordinator writes each round's lr into its plan, so devices and replay read it
    #: from there: a schedule changes no wire message and no replay rule.
    decay_rounds: int | None = field(default=None, metadata=bounded(
        Range(1, R.MAX_INT32, integer=True),
        "cosine-decay the lr over rounds 1..decay_rounds (None: a constant lr)"))
    lr_final_ratio: float = field(default=0.1, metadata=bounded(
        Range(0, 1, lo_open=True), "the decayed lr's final value, as a share of lr"))

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> what it does and its range."""
        return help_of(cls)

    def __post_init__(self) -> None:
        check_fields(self, "hyper.")
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

    def lr_of_round(self, number: int, lr: float | None = None) -> float:
        """The lr the plan of round `number` (1-based) carries: `lr`, or on the cosine from
        `lr` at round 1 to `lr * lr_final_ratio` at round `decay_rounds` and after. binary64,
        computed only by the coordinator (the plan carries the result). `lr`: another start
        on the same schedule (a ternary task's head_lr); default the task's."""
        if number < 1:
            raise ValueError(f"rounds are numbered from 1, got {number}")
        lr = self.lr if lr is None else lr
        if self.decay_rounds is None:
            return lr
        final = lr * self.lr_final_ratio
        if number > self.decay_rounds:
            return final
        t = (number - 1) / max(1, self.decay_rounds - 1)  # 0 at round 1 (a one-round decay too)
        return final + (lr - final) * 0.5 * (1.0 + math.cos(math.pi * t))


class RoundHyper(NamedTuple):
    """What a round's plan carries beyond its seeds' values (`TaskSpec.round_hyper`)."""

    lr: float
    steps: int
    perturbations: int


@dataclass(frozen=True)
class TaskSpec:
    """A task definition. `scope_options` holds the typed options of `scope`
    (`seedfed.shared.protocol.scope_options`); a JSON object (or None) is accepted on input, as
    stored specs and older callers give it, and validated into them."""

    model_path: str
    model_kind: ModelKind = "seq_cls"
    num_labels: int = field(default=2, metadata=bounded(
        Range(1, R.MAX_NUM_LABELS, integer=True),
        "classes of a seq_cls head (>= 2; the head holds num_labels x hidden values)"))
    label_texts: tuple[str, ...] = ()  # e.g. ("negative", "positive"): head initialized from them
    scope: str = "lora"
    scope_options: ScopeOptions = field(default_factory=ScopeOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    format: Format = "fp32"
    hyper: Hyper = field(default_factory=Hyper)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    max_seq_len: int = field(default=128, metadata=bounded(
        Range(1, R.MAX_SEQ_LEN, integer=True), "tokens per example after truncation"))
    #: (substring, c_t) pairs: a scoped tensor whose canonical name contains the substring
    #: trains as theta0_t + c_t * phi_t (probes fl32(eps c_t) z, updates fl32(coef c_t) z;
    #: `ScopedTensor.step_scale`); the first matching pair wins, unmatched tensors keep 1.0.
    #: Lets one plan lr move a head and a far more sensitive body tensor at once.
    step_scales: tuple[tuple[str, float], ...] = ()
    #: What the loss is (`seedfed.shared.protocol.objective`): a seq_cls task's head, or a
    #: causal LM's label words or next-token modelling (its kind None: the model kind's
    #: default). Stored only when it differs from that default, so a device of a release that
    #: predates the field reads every spec that does not use it.
    objective: Objective = field(default_factory=Objective)
    spec_version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        if self.spec_version != SPEC_VERSION:
            raise ValueError(f"spec_version {self.spec_version} is not {SPEC_VERSION}; read "
                             "older specs with TaskSpec.from_dict, which upgrades them")
        # frozen: the typed form replaces what was given (a JSON object, None, or options)
        object.__setattr__(self, "scope_options", options_for(self.scope, self.scope_options))
        object.__setattr__(self, "step_scales", _step_scales(self.step_scales))
        self._check_ranges()
        if self.model_kind not in ("causal_lm", "seq_cls"):
            raise ValueError(f"model_kind must be causal_lm or seq_cls, got {self.model_kind!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        objective = self.objective
        if isinstance(objective, dict):  # the JSON form
            objective = Objective(**{**objective, "words": tuple(objective.get("words", ()))})
        object.__setattr__(self, "objective", objective.resolved(self.model_kind,
                                                                 self.num_labels))
        if self.model_kind == "seq_cls" and self.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2, got {self.num_labels}")
        if self.label_texts and len(self.label_texts) != self.num_labels:
            raise ValueError(f"{len(self.label_texts)} label texts for {self.num_labels} labels")
        if self.scope == "scales" and self.format not in ("int8", "int4"):
            # QZO trains the group scales of a quantized model: a float model has none.
            raise ValueError(f"scope 'scales' needs format int8 or int4, got {self.format!r}")
        # scope 'lora' on int8/int4: the adapters are applied to the float model first and the
        # base Linear layers under them quantized afterwards (QLoRA's layout: a quantized shared
        # base, float adapters), so nothing needs refusing here
        # (`seedfed.shared.model.factory.build_model`).
        if self.scope == "ternary" and self.model_kind == "causal_lm" and \
                getattr(self.scope_options, "train_head", False):
            # A causal LM's head (lm_head) is no classification head; the latents train.
            raise ValueError("scope 'ternary': train_head applies to seq_cls tasks only")
        # A ternary seq_cls task: the coordinator sets the prototype head on the ternary
        # forward and every snapshot carries it (`shared.ternary.build_packed_model`).

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> what it does and its range (the nested options: `Hyper.help()`,
        `LoraOptions.help()`, `AggregationConfig.help()`, `ScopeOptions.help()`)."""
        return help_of(cls)

    def _check_ranges(self) -> None:
        """The ranges that span fields (the single fields check their own)."""
        check_fields(self, "")
        check_value("model_path (characters)", Range(1, R.MAX_PATH_LEN, integer=True),
                    len(self.model_path) if isinstance(self.model_path, str) else self.model_path)
        check_names("label_texts", self.label_texts)
        check_names("step_scales", [p for p, _ in self.step_scales])
        for pattern, c in self.step_scales:
            check_value(f"step_scales[{pattern!r}]",
                        Range(R.MIN_STEP_SCALE, R.MAX_STEP_SCALE), c)
        steps, p = self.largest_plan()
        check_value(f"steps x perturbations ({steps} x {p})",
                    Range(1, R.MAX_SEEDS_PER_ROUND, integer=True), steps * p)
        check_value(f"batch_size x max_seq_len ({self.hyper.batch_size} x {self.max_seq_len})",
                    Range(1, R.MAX_BATCH_TOKENS, integer=True),
                    self.hyper.batch_size * self.max_seq_len)

    def round_hyper(self, number: int, version: int) -> RoundHyper:
        """(lr, steps, seeds per step) of the plan of round `number`, opened at `version`.

        `Hyper.lr_of_round`, `steps` and `perturbations`, except in the head epochs of a
        ternary task with alternate epochs: there `head_lr` (on the same schedule),
        `head_steps` and `head_perturbations` where the options set them. Computed by the
        coordinator only: the plan carries all three (its lr, its steps x perturbations seed
        matrix), so devices, uploads and replay read them from there."""
        h, opts = self.hyper, self.scope_options
        if isinstance(opts, TernaryOptions) and opts.mask.head_epoch(opts.mask.epoch_of(version)):
            return RoundHyper(h.lr_of_round(number, opts.head_lr), opts.head_steps or h.steps,
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
        """The JSON object of the spec (scope options: only the fields off their default;
        `aggregation.max_weight_ratio` only off its default, so a device of a release that
        predates the field still reads every spec that does not change it)."""
        d = {**asdict(self), "scope_options": self.scope_options.to_dict()}
        if self.aggregation.max_weight_ratio == DEFAULT_MAX_WEIGHT_RATIO:
            del d["aggregation"]["max_weight_ratio"]
        if self.objective == Objective(default_kind(self.model_kind)):  # type: ignore[arg-type]
            del d["objective"]
        else:
            d["objective"] = self.objective.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, stored: bool = False) -> TaskSpec:
        """A spec from its JSON object, of this `SPEC_VERSION` or an older one (upgraded).

        `stored`: the spec of a task a coordinator accepted earlier, read back from its
        database: the ranges (`seedfed.shared.protocol.ranges`) are not checked again, so a task
        stored before a range existed still loads; every other rule still holds."""
        if stored:
            with R.unchecked():
                return cls.from_dict(d)
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
        # Without `objective`: the model kind's default (a causal LM's next-token loss, which
        # is what a ternary causal LM trained before objectives were named).
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
