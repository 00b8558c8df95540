"""Trainable scopes: which tensors (and which of their elements) z covers, in canonical order.

Both sides build the scope from the same task definition and model, so they agree on the names,
the order and the element sets without exchanging them. A scope reads and writes its tensors;
later scopes (`sparse`, `scales`, `ternary`) register a builder with `register_scope`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from seedfed.shared.protocol.errors import MissingTensorError, ScopeError, UnknownScopeError
from seedfed.shared.protocol.npzo import scaled_multiple, step_scale_of, unmatched_step_scales
from seedfed.shared.protocol.scope_options import (
    NamedOptions,
    NoOptions,
    ScopeOptions,
    options_class,
    options_for,
)
from seedfed.shared.protocol.scope_options import register_options as _register_options
from torch import nn


@dataclass(frozen=True)
class ScopedTensor:
    """One trainable tensor: its canonical name, the live storage, and the covered elements.

    `indices` holds sorted, unique flat element indices when only part of the tensor trains
    (a mask); None means every element. z for element i is element i of the tensor's stream,
    so a masked subset reuses the stream of the whole tensor.
    """

    name: str
    tensor: torch.Tensor
    indices: torch.Tensor | None = None
    #: `tensor` holds only the covered elements, in `indices` order (a device that keeps just
    #: the masked latents of a matrix); z still comes from the whole tensor's stream at `indices`.
    compact: bool = False
    #: c_t, the task's step scale for this tensor (`TaskSpec.step_scales`): the tensor is
    #: theta0_t + c_t * phi_t with SPSA on phi, so a probe shows fl32(eps * c_t) * z and an
    #: update adds fl32(coef * c_t) * z. One plan lr cannot suit a head weight and a body
    #: tensor whose loss is far more sensitive; scaling the step alone is not enough, since the
    #: scalar g is dominated by the sensitive directions unless their perturbation shrinks too.
    step_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.compact and (self.indices is None or self.indices.numel() != self.tensor.numel()):
            raise ScopeError(
                f"{self.name}: a compact tensor needs one index per stored element, got "
                f"{None if self.indices is None else self.indices.numel()} indices for "
                f"{self.tensor.numel()} elements"
            )

        if not (math.isfinite(self.step_scale) and self.step_scale > 0):
            raise ScopeError(f"{self.name}: step scale must be positive and finite, got "
                             f"{self.step_scale}")

    @property
    def numel(self) -> int:
        return self.tensor.numel() if self.indices is None else int(self.indices.numel())

    def scaled(self, s: float) -> float:
        """The multiple of z this tensor sees for a plan-level probe scale or coefficient `s`:
        s itself at c_t = 1 (so unscaled tasks keep their bits), else fl32(s * c_t), the
        product in float64 rounded once."""
        return scaled_multiple(s, self.step_scale)

    def scaled_coefs(self, coefs: Sequence[float]) -> Sequence[float]:
        """`scaled` of each coefficient of an entry (the list itself at c_t = 1)."""
        if self.step_scale == 1.0:
            return coefs
        return (np.asarray(coefs, dtype=np.float64) * self.step_scale).astype(np.float32).tolist()

    def values(self) -> torch.Tensor:
        """A flat float32 copy of the covered elements."""
        flat = self.tensor.detach().reshape(-1)
        return (flat if self.indices is None or self.compact else flat[self.indices]).clone()

    def assign(self, values: torch.Tensor) -> None:
        flat = self.tensor.data.view(-1)
        if self.indices is None or self.compact:
            flat.copy_(values.reshape(-1))
        else:
            flat[self.indices] = values.reshape(-1).to(flat.dtype)


class Scope:
    """An ordered set of trainable tensors of one model.

    Subclasses only choose the tensors; everything else (order, read/write, ownership for
    virtual perturbation) is shared here.
    """

    kind = "custom"

    def __init__(self, model: nn.Module, tensors: list[ScopedTensor]) -> None:
        if not tensors:
            raise ScopeError(f"scope {self.kind!r} selects no tensors in {type(model).__name__}")
        for t in tensors:
            if t.tensor.dtype != torch.float32:
                raise ScopeError(
                    f"scope {self.kind!r}: tensor {t.name} is {t.tensor.dtype}; replay is defined "
                    "in float32, so keep trainable tensors float32 (load the model in fp32)"
                )
        self.model = model
        self._tensors = sorted(tensors, key=lambda t: t.name)
        names = [t.name for t in self._tensors]
        if len(set(names)) != len(names):
            raise ScopeError(f"scope {self.kind!r} lists a tensor name twice")
        # A scope that rebuilds its tensors (ternary mask epochs) keeps the task's step scales.
        pairs: tuple[tuple[str, float], ...] = getattr(self, "_step_scales", ())
        if pairs:
            self._tensors = [replace(t, step_scale=step_scale_of(t.name, pairs))
                             for t in self._tensors]

    def set_step_scales(self, pairs: Sequence[tuple[str, float]]) -> None:
        """Give each tensor the c_t of the first (substring, c) pair its name contains (1.0
        when none does): `TaskSpec.step_scales`. A pair that names no tensor of the scope is
        refused, so a typo cannot silently train at the wrong scale."""
        pairs = tuple((str(pattern), float(c)) for pattern, c in pairs)
        names = self.step_scale_names()
        bad = unmatched_step_scales(pairs, names)
        if bad:
            raise ScopeError(f"step scale pattern {bad[0]!r} matches no tensor of scope "
                             f"{self.kind!r} (tensors: {', '.join(names[:6])}"
                             f"{', ...' if len(names) > 6 else ''})")
        self._step_scales = pairs
        self._tensors = [replace(t, step_scale=step_scale_of(t.name, pairs))
                         for t in self._tensors]

    def step_scale_names(self) -> list[str]:
        """The names a step scale pattern may match: this scope's tensors (a scope whose
        tensors change between epochs names every tensor it trains in some epoch)."""
        return self.names

    def __iter__(self) -> Iterator[ScopedTensor]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._tensors]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self._tensors)

    def read(self) -> dict[str, torch.Tensor]:
        """Copies of the covered values, flat float32, in canonical order."""
        return {t.name: t.values() for t in self._tensors}

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the covered values; checks every tensor before touching any."""
        expected = set(self.names)
        missing, extra = expected - set(state), set(state) - expected
        if missing or extra:
            raise MissingTensorError(
                f"state does not match scope {self.kind!r}: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(extra)[:5]}"
            )
        for t in self._tensors:
            if state[t.name].numel() != t.numel:
                raise MissingTensorError(
                    f"{t.name}: state has {state[t.name].numel()} elements, scope {t.numel}"
                )
        with torch.no_grad():
            for t in self._tensors:
                t.assign(state[t.name])

    def after_update(self) -> None:
        """Hook run after every replayed update (e.g. clamp quantization scales). No-op here."""

    # -- coordinator hooks; the defaults suit scopes whose covered set never changes ----------

    def master_state(self, values: Mapping[str, torch.Tensor] | None = None,
                     ) -> dict[str, torch.Tensor]:
        """The tensors of the coordinator's master file: what a restart needs to rebuild this
        scope exactly. By default the covered values (`read()`; pass `values` when they were
        just read, to avoid a second copy). Scopes whose covered set moves (ternary mask
        epochs) override it with whatever the set is derived from. Tensors may alias live
        storage: write them out before the next update."""
        return dict(values) if values is not None else self.read()

    def load_master_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Inverse of `master_state` (the checksum is the caller's to verify)."""
        self.write(state)

    def enter_version(self, version: int) -> bool:
        """Coordinator: the entry producing `version` (>= 1) was just applied, its files are
        not yet written. A scope whose covered set changes with the version (the ternary
        scope's mask epochs) changes it here and returns True: the checksum moves, and a
        device must load the version's snapshot instead of replaying into it. No-op here."""
        del version
        return False

    def owners(self) -> dict[int, list[tuple[nn.Module, str]]]:
        """For each scoped tensor (by id), the modules holding it directly, and the attribute."""
        wanted = {id(t.tensor) for t in self._tensors}
        found: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in self.model.modules():
            for attr, p in list(module._parameters.items()) + list(module._buffers.items()):
                if p is not None and id(p) in wanted:
                    found.setdefault(id(p), []).append((module, attr))
        return found


ScopeBuilder = Callable[..., Scope]
_REGISTRY: dict[str, ScopeBuilder] = {}
#: Scopes that live in their own packages register on import; importing them lazily keeps the
#: quantization code out of processes that never use it.
_PLUGINS = {
    "scales": "seedfed.shared.model.quant.scales_scope",
    "ternary": "seedfed.shared.model.ternary.scope",
}


#: kind -> (scope options, version) -> the version's mask epoch, for scopes whose covered set
#: changes on a schedule (see `scope_epoch`).
EpochSchedule = Callable[[Any, int], int]
_EPOCHS: dict[str, EpochSchedule] = {}


def register_epochs(kind: str) -> Callable[[EpochSchedule], EpochSchedule]:
    def wrap(schedule: EpochSchedule) -> EpochSchedule:
        _EPOCHS[kind] = schedule
        return schedule

    return wrap


def scope_epoch(kind: str, options: ScopeOptions | Mapping[str, Any], version: int
                ) -> int | None:
    """The epoch of the covered set at `version` for scope `kind` built with `options`, or None
    for scopes whose set never changes. The coordinator's service layer asks this without
    loading a model (round plans, log entries, catch-up plans): two versions in different
    epochs cannot be bridged by replay."""
    if kind not in _EPOCHS and kind not in _REGISTRY and kind in _PLUGINS:
        importlib.import_module(_PLUGINS[kind])
    schedule = _EPOCHS.get(kind)
    return None if schedule is None else schedule(options_for(kind, options), version)


def register_scope(kind: str, options: type[ScopeOptions] | None = None
                   ) -> Callable[[ScopeBuilder], ScopeBuilder]:
    """Register `builder(model, options, **build_args)` for scope `kind`; `options` is the
    kind's options class (seedfed.shared.protocol.scope_options; default: none)."""
    def wrap(builder: ScopeBuilder) -> ScopeBuilder:
        _REGISTRY[kind] = builder
        if options is not None:
            _register_options(kind, options)
        return builder

    return wrap


def scope_kinds() -> list[str]:
    return sorted(set(_REGISTRY) | set(_PLUGINS))


def build_scope(kind: str, model: nn.Module, options: ScopeOptions | None = None,
                **kwargs: Any) -> Scope:
    """Build the scope a task names with its typed `options` (a task: `spec.scope_options`).

    Keyword arguments that are fields of the kind's options class build the options (when
    `options` is not given): `build_scope("named", model, patterns=("classifier",))`; the
    others go to the builder as they are (e.g. the ternary builder's `convert`). Unknown
    names raise UnknownScopeError listing the known."""
    if kind not in _REGISTRY and kind in _PLUGINS:
        importlib.import_module(_PLUGINS[kind])
    try:
        builder = _REGISTRY[kind]
    except KeyError as e:
        raise UnknownScopeError(
            f"unknown scope {kind!r}; known scopes: {', '.join(scope_kinds())}"
        ) from e
    names = {f.name for f in fields(options_class(kind))}
    if options is None:
        options = options_for(kind, {k: v for k, v in kwargs.items() if k in names})
    else:
        options = options_for(kind, options)
    return builder(model, options, **{k: v for k, v in kwargs.items() if k not in names})


def _unique_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    # named_parameters drops tied duplicates, keeping the first name: that name is canonical.
    yield from model.named_parameters(remove_duplicate=True)


class FullScope(Scope):
    """Every floating-point parameter of the model (tied weights once)."""

    kind = "full"


class NamedScope(Scope):
    """Parameters whose canonical name contains one of the given substrings."""

    kind = "named"


class LoraScope(Scope):
    """peft LoRA adapters (`lora_` tensors) plus any `modules_to_save` copies (e.g. a head)."""

    kind = "lora"


@register_scope("full", options=NoOptions)
def _build_full(model: nn.Module, options: NoOptions) -> Scope:
    return FullScope(
        model, [ScopedTensor(n, p) for n, p in _unique_parameters(model) if p.is_floating_point()]
    )


@register_scope("named", options=NamedOptions)
def _build_named(model: nn.Module, options: NamedOptions) -> Scope:
    patterns = options.patterns  # at least one: NamedOptions refuses none
    chosen = [ScopedTensor(n, p) for n, p in _unique_parameters(model)
              if any(s in n for s in patterns)]
    if not chosen:
        raise ScopeError(f"scope 'named': no parameter name contains any of {list(patterns)}")
    return NamedScope(model, chosen)


@register_scope("lora", options=NoOptions)
def _build_lora(model: nn.Module, options: NoOptions) -> Scope:
    chosen = [
        ScopedTensor(n, p)
        for n, p in _unique_parameters(model)
        if "lora_" in n or ".modules_to_save." in n
    ]
    if not chosen:
        raise ScopeError(
            f"scope 'lora': {type(model).__name__} has no LoRA adapters; wrap it with "
            "peft.get_peft_model (seedfed.shared.model.lora.apply_lora) first"
        )
    return LoraScope(model, chosen)
