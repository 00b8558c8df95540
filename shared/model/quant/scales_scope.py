"""The `scales` scope (QZO): train only the float32 group scales of a quantized model.

The integer codes stay frozen; z covers every scale of every QuantLinear (names
`<layer>.scales`, canonical order by name), plus optionally a few float parameters named by
`include` (e.g. a float classifier head). After each replayed update the scales are clamped to
a small positive floor: a scale that crossed zero would flip the sign of its whole group.
The clamp is a deterministic elementwise max, so replay stays bit-exact between device and
coordinator. Probes are not clamped (theta - eps*z may dip below the floor for one forward).

QZO's directional derivative clipping (DDC) is the round plan's `clip`; for this scope it
defaults to `DEFAULT_DDC_CLIP` (see `plan_clip`), since a scale perturbation can move the loss
far more than a weight perturbation of the same size.
"""

from __future__ import annotations

import torch
from seedfed.shared.model.quant.linear import QuantLinear
from seedfed.shared.model.scopes import Scope, ScopedTensor, register_scope
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.scope_options import ScalesOptions
from torch import nn

DEFAULT_DDC_CLIP = 100.0
DEFAULT_SCALE_FLOOR = ScalesOptions().floor


class ScalesScope(Scope):
    """The scales of every QuantLinear layer (and any `include`d float parameters)."""

    kind = "scales"
    default_clip = DEFAULT_DDC_CLIP

    def __init__(self, model: nn.Module, tensors: list[ScopedTensor], floor: float) -> None:
        super().__init__(model, tensors)
        self.floor = floor
        self._scales = [t.tensor for t in self if t.name.endswith(".scales")
                        and isinstance(_owner(model, t.name), QuantLinear)]

    def after_update(self) -> None:
        with torch.no_grad():
            for s in self._scales:
                s.data.clamp_(min=self.floor)


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def plan_clip(scope_kind: str, clip: float | None) -> float | None:
    """The DDC bound a round plan should carry: the task's `clip`, or C = 100 for `scales`."""
    if clip is not None:
        return clip
    return DEFAULT_DDC_CLIP if scope_kind == "scales" else None


@register_scope("scales", options=ScalesOptions)
def build_scales_scope(model: nn.Module, options: ScalesOptions | None = None) -> Scope:
    """The scales scope of a quantized model with its typed options (`ScalesOptions`: floor,
    include, group_size, bits, layers; their help says what each does).

    `group_size` / `bits`, when the task gives them, must match the model's quantized layers
    (both sides derive z's coverage from them, so a mismatch is refused). `layers` restricts
    training to the scales of the matching layers: the layers below stay frozen, so a device
    can cache their output and each probe runs only the top of the model
    (`frozen_prefix_depth`)."""
    o = options if options is not None else ScalesOptions()
    floor, include, group_size, bits, layers = o.floor, o.include, o.group_size, o.bits, o.layers
    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not quantized:
        raise ScopeError(
            f"scope 'scales': {type(model).__name__} has no quantized layers; quantize it "
            "first (seedfed.shared.model.quant.quantize_model, format int8/int4)")
    for want, attr in ((group_size, "group_size"), (bits, "bits")):
        bad = [n for n, m in quantized if want is not None and getattr(m, attr) != want]
        if bad:
            raise ScopeError(f"scope 'scales': task asks {attr}={want} but layer {bad[0]} has "
                             f"{attr}={getattr(dict(quantized)[bad[0]], attr)}")
    if layers:
        quantized = [(n, m) for n, m in quantized if any(p in n for p in layers)]
        if not quantized:
            raise ScopeError(f"scope 'scales': no quantized layer path contains any of "
                             f"{list(layers)}")
    chosen = [ScopedTensor(f"{n}.scales" if n else "scales", m.scales) for n, m in quantized]
    if include:
        extra = [ScopedTensor(n, p) for n, p in model.named_parameters(remove_duplicate=True)
                 if any(s in n for s in include) and not n.endswith(".scales")]
        if not extra:
            raise ScopeError(f"scope 'scales': no parameter name contains any of {list(include)}")
        chosen += extra
    return ScalesScope(model, chosen, floor)
