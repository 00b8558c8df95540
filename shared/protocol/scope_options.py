"""Typed options of each trainable scope, validated when a task is defined.

A task names its scope (`TaskSpec.scope`) and that scope's options (`TaskSpec.scope_options`),
one frozen dataclass per scope kind, checked in `__post_init__` the way peft's LoraConfig
checks its fields: a bad value fails when the task is created, with a message naming it, not
later inside a model build on a device. Each field says what it does in its metadata
(`ScopeOptions.help()`).

On the wire and in the database the options stay the JSON object they always were (`to_dict`
leaves out the fields at their default, so a spec written before these classes existed reads
back to the same object); `options_for(kind, mapping)` turns such an object into the typed
options of `kind`, refusing unknown names. The scope kinds and their option classes:

    full, lora     NoOptions        (LoRA's own settings are `TaskSpec.lora`)
    named          NamedOptions     patterns
    scales         ScalesOptions    floor, include, group_size, bits, layers
    ternary        TernaryOptions   the mask (selection, fraction, epoch_rounds, seed,
                                    refresh_gamma), the float head (train_head, alternate,
                                    head_lr, head_perturbations, head_steps) and act_bits

A scope added with `seedfed.shared.model.scopes.register_scope(kind, options=MyOptions)` registers
its class here too.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal, TypeVar

from seedfed.shared.protocol import ranges as R
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.ranges import Range, bounded, check_fields, check_names, help_of

T = TypeVar("T", bound="ScopeOptions")

_UINT64_MAX = (1 << 64) - 1


class ScopeOptionsError(ScopeError):
    """Scope options that name an unknown field or hold a value out of range."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ScopeOptions:
    """Base of every scope's options (a scope with none uses `NoOptions`)."""

    kind: ClassVar[str] = ""

    @classmethod
    def from_dict(cls: type[T], d: Mapping[str, Any], kind: str | None = None) -> T:
        """The options from their JSON object: lists become tuples where the field is a
        tuple, and a name the class does not have is refused (listing the ones it has)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ScopeOptionsError(
                f"scope {kind or cls.kind!r} has no option {unknown[0]!r}; its options: "
                f"{', '.join(known) or 'none'}")
        hints = typing.get_type_hints(cls)
        values = {k: tuple(v) if _is_tuple(hints[k]) and isinstance(v, list) else v
                  for k, v in d.items()}
        try:
            return cls(**values)
        except TypeError as e:
            raise ScopeOptionsError(f"scope {kind or cls.kind!r}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the options: only the fields away from their default."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default is not MISSING else (
                f.default_factory() if f.default_factory is not MISSING else MISSING)
            if value != default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> what it does (and its range, where it has one)."""
        return help_of(cls)

    def _check_ranges(self, *name_fields: str) -> None:
        """The ranges of the fields (`seedfed.shared.protocol.ranges`) and the sizes of name lists,
        as ScopeOptionsError naming `scope_options.<field>`."""
        try:
            check_fields(self, "scope_options.")
            for name in name_fields:
                check_names(f"scope_options.{name}", getattr(self, name))
        except ValueError as e:
            raise ScopeOptionsError(f"scope {self.kind!r}: {e}") from None


def _is_tuple(hint: Any) -> bool:
    return hint is tuple or typing.get_origin(hint) is tuple


@dataclass(frozen=True)
class NoOptions(ScopeOptions):
    """A scope without options (`full`; `lora`, whose adapters are set by `TaskSpec.lora`)."""


@dataclass(frozen=True)
class NamedOptions(ScopeOptions):
    """The `named` scope: the parameters whose canonical name contains a pattern."""

    kind: ClassVar[str] = "named"
    patterns: tuple[str, ...] = field(default=(), metadata=_help(
        "substrings of parameter names; a parameter trains if its name contains any of them "
        "(e.g. 'classifier' for the head)"))

    def __post_init__(self) -> None:
        self._check_ranges("patterns")
        if not self.patterns or not all(isinstance(p, str) and p for p in self.patterns):
            raise ScopeOptionsError("scope 'named' needs at least one non-empty name pattern, "
                                    f"got {list(self.patterns)}")


@dataclass(frozen=True)
class ScalesOptions(ScopeOptions):
    """The `scales` scope (QZO): the float32 group scales of a quantized model."""

    kind: ClassVar[str] = "scales"
    floor: float = field(default=1e-6, metadata=bounded(Range(0, 1, lo_open=True), (
        "smallest value a scale is clamped to after each update (a scale crossing zero would "
        "flip the sign of its whole group)")))
    include: tuple[str, ...] = field(default=(), metadata=_help(
        "float parameters that train beside the scales, by name substring (e.g. a head)"))
    group_size: int | None = field(default=None, metadata=bounded(
        Range(1, 1 << 16, integer=True),
        "the quantization group size; the model is quantized with it (default 64), and "
        "layers that differ are refused"))
    bits: int | None = field(default=None, metadata=_help(
        "4 or 8; when given it must match the task's format (int4 / int8)"))
    layers: tuple[str, ...] = field(default=(), metadata=_help(
        "module path substrings (e.g. 'encoder.layer.5.'): only those layers' scales train, "
        "so a device caches the frozen layers below"))

    def __post_init__(self) -> None:
        self._check_ranges("include", "layers")
        if not (isinstance(self.floor, int | float) and math.isfinite(self.floor)
                and self.floor > 0):
            raise ScopeOptionsError(f"scope 'scales': floor must be positive and finite, got "
                                    f"{self.floor}")
        if self.group_size is not None and not (isinstance(self.group_size, int)
                                                and self.group_size >= 1):
            raise ScopeOptionsError(f"scope 'scales': group_size must be an integer >= 1, got "
                                    f"{self.group_size}")
        if self.bits is not None and self.bits not in (4, 8):
            raise ScopeOptionsError(f"scope 'scales': bits must be 4 or 8, got {self.bits}")


Selection = Literal["threshold", "random", "full", "none"]
SELECTIONS: tuple[str, ...] = ("threshold", "random", "full", "none")


@dataclass(frozen=True)
class MaskConfig:
    """How the ternary scope picks its trainable latents, and how often it re-picks them.

    `refresh_gamma`: at each mask epoch the coordinator recomputes every gamma = mean |W| from
    its latents (BitNet semantics), so the whole packed model changes and devices re-download
    it. With False, gamma stays as converted for the whole task and an epoch change only moves
    the codes of the previously masked elements.
    """

    selection: Selection = "threshold"
    # 1%: a device then holds 8 bytes (index + fp32 latent) per masked weight, 1.8% of the
    # fp32 model, and a ZO step peaks at 1.065 x packed inference on a 1.1B Llama; 2% learns
    # ~20% faster per forward but peaks at 1.156 x (`seedfed bench ternary`, README).
    fraction: float = 0.01
    epoch_rounds: int = 10
    seed: int = 0
    refresh_gamma: bool = True
    #: A classifier task's float head (`classifier.weight`, `.bias`) trains too; it is
    #: otherwise frozen at the prototypes of the label texts (and still carried in snapshots).
    train_head: bool = False
    #: With train_head: even mask epochs train the head alone (no latent masked), odd epochs
    #: the masked latents alone, so no seed perturbs both (see `TernaryOptions.alternate`).
    alternate: bool = False

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"mask selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not (math.isfinite(self.fraction) and 0 < self.fraction <= 1):
            raise ValueError(f"mask fraction must lie in (0, 1], got {self.fraction}")
        if self.epoch_rounds < 1:
            raise ValueError(f"epoch_rounds must be >= 1, got {self.epoch_rounds}")
        if not 0 <= self.seed <= _UINT64_MAX:
            raise ValueError(f"mask seed must be a uint64, got {self.seed}")
        if self.selection == "none" and not self.train_head:
            raise ValueError("mask selection 'none' trains no latent: it needs train_head")
        if self.alternate and (not self.train_head or self.selection == "none"):
            raise ValueError("alternate epochs switch between the head and the latents: they "
                             "need train_head and a selection other than 'none'")

    def epoch_of(self, round_index: int) -> int:
        """The mask epoch a round belongs to (rounds counted from 0). The coordinator counts
        committed versions: version v is in epoch v // epoch_rounds, and the round that
        commits a version with v % epoch_rounds == 0 (v > 0) starts a new epoch."""
        if round_index < 0:
            raise ValueError(f"round index must be >= 0, got {round_index}")
        return round_index // self.epoch_rounds

    def starts_epoch(self, round_index: int) -> bool:
        return round_index % self.epoch_rounds == 0

    def head_epoch(self, epoch: int) -> bool:
        """Whether mask epoch `epoch` trains the float head alone (`alternate`, even epochs)."""
        return self.alternate and epoch % 2 == 0

    def trains_head(self, epoch: int) -> bool:
        """Whether the float head is in the scope during mask epoch `epoch`."""
        return self.train_head and (not self.alternate or self.head_epoch(epoch))

    def trains_latents(self, epoch: int) -> bool:
        """Whether any latent is masked (trains) during mask epoch `epoch`."""
        return self.selection != "none" and not self.head_epoch(epoch)


@dataclass(frozen=True)
class TernaryOptions(ScopeOptions):
    """The `ternary` scope (TerMeZO): the masked latents of a BitLinear model."""

    kind: ClassVar[str] = "ternary"
    selection: Selection = field(default="threshold", metadata=_help(
        "which latents train: 'threshold' (nearest the rounding threshold, TerMeZO), "
        "'random' (a baseline), 'full' (every latent; the device then holds them all) or "
        "'none' (no latent: the classification head alone, with train_head)"))
    fraction: float = field(default=0.01, metadata=bounded(
        Range(0, 1, lo_open=True), "share of each matrix's latents in the mask"))
    epoch_rounds: int = field(default=10, metadata=bounded(
        Range(1, R.MAX_INT32, integer=True),
        "versions per mask epoch: masks (and gammas) are re-chosen every epoch_rounds versions"))
    seed: int = field(default=0, metadata=bounded(
        Range(0, _UINT64_MAX, integer=True), "seed of the 'random' selection (a uint64)"))
    refresh_gamma: bool = field(default=True, metadata=_help(
        "recompute every gamma = mean |W| at each mask epoch (BitNet semantics)"))
    train_head: bool = field(default=False, metadata=_help(
        "seq_cls tasks: also train the float classification head with the masked latents"))
    alternate: bool = field(default=False, metadata=_help(
        "with train_head: even mask epochs train the float head alone, odd epochs the masked "
        "latents alone, so no seed perturbs both (a head direction moves the loss far more "
        "than a latent's, and would decide every scalar); a head epoch's probes share the "
        "frozen encoder's forward, so they are cheap"))
    head_lr: float | None = field(default=None, metadata=bounded(Range(R.MIN_LR, R.MAX_LR), (
        "with alternate: the lr the head epochs' rounds plan (the task's lr schedule applied "
        "to it as to the task's lr); None: the task's lr")))
    head_perturbations: int | None = field(default=None, metadata=bounded(
        Range(1, R.MAX_PERTURBATIONS, integer=True), (
        "with alternate: seeds per step in the head epochs' rounds (cheap probes afford "
        "many more); None: the task's")))
    head_steps: int | None = field(default=None, metadata=bounded(
        Range(1, R.MAX_STEPS, integer=True), (
        "with alternate: local steps per round in the head epochs (each a new batch: one "
        "encoder forward, then the head's cheap probes); None: the task's")))
    act_bits: int | None = field(default=8, metadata=bounded(
        Range(2, 16, integer=True),
        "activation quantization bits of the BitLinear layers (None: float activations)"))

    def __post_init__(self) -> None:
        self._check_ranges()
        try:
            self.mask  # noqa: B018  (MaskConfig validates the mask fields)
        except ValueError as e:
            raise ScopeOptionsError(f"scope 'ternary': {e}") from e
        if (self.head_lr, self.head_perturbations, self.head_steps) != (None,) * 3 and \
                not self.alternate:
            raise ScopeOptionsError("scope 'ternary': head_lr, head_perturbations and "
                                    "head_steps apply to alternate epochs only")
        if self.head_lr is not None and not (isinstance(self.head_lr, int | float)
                                             and math.isfinite(self.head_lr)
                                             and self.head_lr > 0):
            raise ScopeOptionsError(f"scope 'ternary': head_lr must be positive and finite, "
                                    f"got {self.head_lr}")
        for name in ("head_perturbations", "head_steps"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ScopeOptionsError(f"scope 'ternary': {name} must be an integer >= 1, "
                                        f"got {v}")
        if self.act_bits is not None and not (isinstance(self.act_bits, int)
                                              and self.act_bits >= 2):
            raise ScopeOptionsError(f"scope 'ternary': act_bits must be None or an integer "
                                    f">= 2, got {self.act_bits}")

    @property
    def mask(self) -> MaskConfig:
        """The mask part (what snapshots record and `start_mask_epoch` takes)."""
        return MaskConfig(**{f.name: getattr(self, f.name) for f in fields(MaskConfig)})


#: scope kind -> its options class (kinds not listed take none)
_OPTIONS: dict[str, type[ScopeOptions]] = {
    "full": NoOptions, "lora": NoOptions, "named": NamedOptions, "scales": ScalesOptions,
    "ternary": TernaryOptions,
}


def register_options(kind: str, cls: type[ScopeOptions]) -> None:
    """Name the options class of scope `kind` (`register_scope(kind, options=...)` calls it)."""
    _OPTIONS[kind] = cls


def options_class(kind: str) -> type[ScopeOptions]:
    return _OPTIONS.get(kind, NoOptions)


def options_for(kind: str, given: ScopeOptions | Mapping[str, Any] | None = None
                ) -> ScopeOptions:
    """The typed options of scope `kind` from what a caller gave: None (the defaults), the
    JSON object, or options (re-read through their JSON object when they belong to another
    kind, so replacing a spec's scope keeps what still applies and refuses the rest)."""
    cls = options_class(kind)
    if isinstance(given, cls):
        return given
    if given is None:
        return cls.from_dict({}, kind)
    if isinstance(given, ScopeOptions):
        return cls.from_dict(given.to_dict(), kind)
    return cls.from_dict(given, kind)


__all__ = ["SELECTIONS", "MaskConfig", "NamedOptions", "NoOptions", "ScalesOptions",
           "ScopeOptions", "ScopeOptionsError", "Selection", "TernaryOptions", "options_class",
           "options_for", "register_options"]
