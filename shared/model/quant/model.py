"""Quantizing the Linear layers of any Hugging Face (or plain torch) model, one layer at a time.

`quantize_model` walks the model's `nn.Linear` layers, replaces each with a `QuantLinear` and
drops the float weight before moving on, so quantizing never needs more than the model as it
stands plus one layer's temporaries. Layers that must stay float (the output head, a
classifier) are skipped by name.

For models too large to hold in float32 at all, build the skeleton on the meta device and let
`quantize_model` materialize each Linear just before quantizing it (`materialize=`), then
`materialize_rest` fills what is left (embeddings, norms, rotary buffers): the peak is the
quantized model plus one float layer. `build_quantized` does both for a model built from a config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from seedfed.shared.model.quant.errors import GroupSizeError, NoQuantizableLayersError
from seedfed.shared.model.quant.groupwise import BITS
from seedfed.shared.model.quant.linear import QuantLinear
from torch import nn

#: Layer names (path components) kept in float by default: output heads.
DEFAULT_SKIP: tuple[str, ...] = ("lm_head", "classifier", "score")

Materialize = Callable[[str, nn.Linear], torch.Tensor]


@dataclass(frozen=True)
class QuantConfig:
    """How a model is quantized.

    `group_size` must be even (int4 packs two codes per byte); 32-128 is the useful range.
    `pad=True` pads a layer whose input width is not a multiple of the group size with zero
    columns (documented in `groupwise`); `pad=False` refuses such a layer with GroupSizeError.
    `skip` lists name components (e.g. "lm_head" matches "lm_head" and "model.lm_head") or
    dotted sub-paths whose Linear layers stay float.
    """

    bits: int = 8
    group_size: int = 64
    skip: tuple[str, ...] = DEFAULT_SKIP
    pad: bool = True

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if not isinstance(self.group_size, int) or self.group_size < 2 or self.group_size % 2:
            raise GroupSizeError(f"group size must be an even integer >= 2, got {self.group_size}")

    def skips(self, name: str) -> bool:
        padded = f".{name}."
        return any(f".{s}." in padded for s in self.skip)


def quantizable_layers(model: nn.Module, config: QuantConfig) -> list[tuple[str, nn.Linear]]:
    """The Linear layers `quantize_model` would replace, in module order."""
    return [(n, m) for n, m in model.named_modules()
            if type(m) is nn.Linear and not config.skips(n)]


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2's projections): a Linear whose weight is stored (in, out)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and \
        isinstance(weight, torch.Tensor) and weight.dim() == 2


def linears_from_conv1d(model: nn.Module, config: QuantConfig) -> None:
    """Replace every unskipped `Conv1D` by the nn.Linear it is (weight transposed, same bias),
    so GPT-2's projections quantize like any Linear layer. Applied before quantization on both
    sides, from the same float weights: the quantized model is the same everywhere."""
    for name, module in list(model.named_modules()):
        if not _is_conv1d(module) or config.skips(name) or module.weight.is_meta:
            continue
        n_in, n_out = module.weight.shape
        linear = nn.Linear(n_in, n_out, bias=module.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(module.weight.t())
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        _set_submodule(model, name, linear)


def quantize_model(model: nn.Module, config: QuantConfig,
                   materialize: Materialize | None = None) -> nn.Module:
    """Replace the model's Linear layers by QuantLinear in place (and return the model).

    Raises NoQuantizableLayersError when nothing is left to quantize, and GroupSizeError (before
    touching any layer) when a width is not a multiple of the group size and padding is off.
    A meta-device Linear needs `materialize(name, linear)` to supply its float weight.
    """
    linears_from_conv1d(model, config)
    layers = quantizable_layers(model, config)
    if not layers:
        raise NoQuantizableLayersError(
            f"{type(model).__name__} has no nn.Linear layer to quantize "
            f"(skipped by name: {list(config.skip)})")
    if not config.pad:
        bad = [(n, m.in_features) for n, m in layers if m.in_features % config.group_size]
        if bad:
            raise GroupSizeError(
                f"group size {config.group_size} does not divide the input width of "
                f"{len(bad)} layer(s), e.g. {bad[0][0]} ({bad[0][1]}); pick another group size "
                "or allow padding (pad=True)")
    for name, linear in layers:
        weight = None
        if linear.weight.is_meta:
            if materialize is None:
                raise ValueError(f"{name} is on the meta device; pass materialize= to fill it")
            weight = materialize(name, linear)
        with torch.no_grad():
            q = QuantLinear.from_linear(linear, config.bits, config.group_size, weight)
        _set_submodule(model, name, q)
        del weight, linear  # the float weight goes now, before the next layer materializes
    model.seedfed_quant = config  # type: ignore[assignment]
    return model


def quant_layers(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def normal_materializer(std: float, generator: torch.Generator) -> Materialize:
    """Materialize meta Linear weights as N(0, std^2) draws from an explicit generator."""
    def fill(_name: str, linear: nn.Linear) -> torch.Tensor:
        w = torch.empty(linear.weight.shape, dtype=torch.float32)
        return w.normal_(0.0, std, generator=generator)
    return fill


@torch.no_grad()
def materialize_rest(model: nn.Module, generator: torch.Generator,
                     float_dtype: torch.dtype = torch.float32, std: float = 0.02) -> None:
    """Allocate and initialize every tensor still on the meta device (not QuantLinear state).

    Embeddings and remaining Linear weights are drawn N(0, std^2) from `generator`; everything
    else (norms, rotary and position buffers) goes through the model's own deterministic
    `_init_weights` when it has one. Float tensors outside QuantLinear are cast to `float_dtype`.
    """
    hf_init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            continue
        own = list(module._parameters.values()) + list(module._buffers.values())
        if any(t is not None and t.is_meta for t in own):
            module.to_empty(device="cpu", recurse=False)
            if isinstance(module, (nn.Embedding, nn.Linear)):
                module.weight.normal_(0.0, std, generator=generator)
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            elif hf_init is not None:
                hf_init(module)
            else:
                raise ValueError(f"cannot initialize {type(module).__name__} on the meta device "
                                 "without the model's _init_weights; load it from a file instead")
        for attr, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != float_dtype:
                module._parameters[attr] = nn.Parameter(p.data.to(float_dtype),
                                                        requires_grad=p.requires_grad)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta]
    if left:
        raise ValueError(f"tensors still on the meta device after materializing: {left[:5]}")


def build_quantized(hf_config: Any, config: QuantConfig, *, model_cls: Any = None,
                    seed: int = 0, float_dtype: torch.dtype = torch.float32) -> nn.Module:
    """A randomly initialized model of `hf_config`, quantized without ever existing in float.

    `model_cls` defaults to AutoModelForCausalLM. Weights are N(0, initializer_range^2) from a
    generator seeded with `seed` (benchmarks and tests; real models come from checkpoints).
    """
    if model_cls is None:
        from transformers import AutoModelForCausalLM
        model_cls = AutoModelForCausalLM
    with torch.device("meta"):
        model = (model_cls.from_config(hf_config) if hasattr(model_cls, "from_config")
                 else model_cls(hf_config))
    std = float(getattr(hf_config, "initializer_range", 0.02) or 0.02)
    generator = torch.Generator().manual_seed(seed)
    quantize_model(model, config, materialize=normal_materializer(std, generator))
    materialize_rest(model, generator, float_dtype, std)
    return model.eval()
