"""Saving and loading quantized models: one safetensors file + the model's config.json.

Layout of a quantized model directory:
- `config.json`: the Hugging Face config (so the skeleton can be rebuilt on the meta device);
- `quantized.safetensors`: every parameter and buffer of the model (non-persistent buffers
  too), QuantLinear layers as `<layer>.codes` (int8, or uint8 holding packed int4) and
  `<layer>.scales` (float32), with metadata:
  `format` = "seedfed-quant", `format_version` = "1", `architecture` (transformers class name),
  `layers` (JSON: layer name -> [in_features, out_features, bits, group_size, has_bias]),
  `checksum` = SHA-256 over the tensors in sorted name order, each as UTF-8 name, NUL, dtype
  name, NUL, shape as decimal list, NUL, raw little-endian bytes.

Loading builds the skeleton on the meta device, swaps in meta QuantLinear layers, verifies the
checksum and only then assigns the loaded tensors: a truncated or corrupted file is refused
with a typed error before the model holds any of it, and no float copy of the Linear weights is
ever made. `save_scales` / `load_scales` move the scales alone (what changes between versions;
codes travel once).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from seedfed.shared.model.quant.errors import QuantChecksumError, QuantFileError
from seedfed.shared.model.quant.linear import QuantLinear
from seedfed.shared.model.quant.model import _set_submodule, materialize_rest, quant_layers
from seedfed.shared.model.tensorfile import (
    model_directory,
    model_tensors,
    recorded_checksum,
    skeleton_parts,
    tensors_checksum,
)
from torch import nn

FORMAT = "seedfed-quant"
FORMAT_VERSION = "1"
WEIGHTS_FILE = "quantized.safetensors"
SCALES_FORMAT = "seedfed-scales"


def save_quantized(model: nn.Module, directory: str | Path) -> Path:
    """Write `model` (already quantized) to `directory`; returns the weights file path."""
    layers = quant_layers(model)
    if not layers:
        raise QuantFileError(f"{type(model).__name__} has no QuantLinear layer; quantize it first")
    directory = model_directory(model, directory)
    tensors = model_tensors(model)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": type(model).__name__,
        "layers": json.dumps({n: [m.in_features, m.out_features, m.bits, m.group_size,
                                  m.bias is not None] for n, m in layers}),
        "checksum": tensors_checksum(tensors),
    }
    path = directory / WEIGHTS_FILE
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # a crash mid-write never leaves a half file under the real name
    return path


def read_verified(path: str | Path, expected_format: str = FORMAT,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a seedfed safetensors file, after checking its checksum."""
    path = Path(path)
    try:
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise QuantFileError(f"{path}: not a readable safetensors file (truncated or "
                             f"corrupt?): {e}") from e
    recorded = recorded_checksum(path, meta, expected_format, QuantFileError)
    if meta.get("format_version") != FORMAT_VERSION:
        raise QuantFileError(f"{path}: format version {meta.get('format_version')!r} is not "
                             f"supported (this side reads {FORMAT_VERSION})")
    got = tensors_checksum(tensors)
    if got != recorded:
        raise QuantChecksumError(f"{path}: tensors hash to {got[:16]}..., metadata says "
                                 f"{recorded[:16]}...; the file is corrupt, fetch it again")
    return tensors, meta


def load_quantized(directory: str | Path, model_cls: Any = None,
                   model: nn.Module | None = None) -> nn.Module:
    """Rebuild a model saved by `save_quantized`.

    The skeleton is `model` if given (any module with the same structure, ideally on the meta
    device), else `model_cls` (or the saved architecture from transformers) built from the
    directory's config.json on the meta device.
    """
    directory = Path(directory)
    tensors, meta = read_verified(directory / WEIGHTS_FILE)
    try:
        layers = json.loads(meta["layers"])
    except (KeyError, json.JSONDecodeError) as e:
        raise QuantFileError(f"{directory}: metadata lacks a valid layer table") from e
    if model is None:
        model = _skeleton(directory, meta, model_cls)
    for name, (in_f, out_f, bits, group_size, has_bias) in layers.items():
        try:
            old = model.get_submodule(name)
        except AttributeError as e:
            raise QuantFileError(f"{directory}: layer {name} is not in "
                                 f"{type(model).__name__}") from e
        old_bias = getattr(old, "bias", None)
        bias_dtype = old_bias.dtype if isinstance(old_bias, torch.Tensor) else torch.float32
        _set_submodule(model, name, QuantLinear(in_f, out_f, bits, group_size, bias=has_bias,
                                                device="meta", bias_dtype=bias_dtype))
    _assign(model, tensors, directory)
    materialize_rest(model, torch.Generator().manual_seed(0), _float_dtype(tensors))
    return model.eval()


def _float_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    for name, t in tensors.items():
        if t.is_floating_point() and not name.endswith(".scales"):
            return t.dtype
    return torch.float32


def _skeleton(directory: Path, meta: Mapping[str, str], model_cls: Any) -> nn.Module:
    config, model_cls = skeleton_parts(directory, meta, model_cls, QuantFileError)
    with torch.device("meta"):
        return model_cls(config)


def _assign(model: nn.Module, tensors: Mapping[str, torch.Tensor], where: Path) -> None:
    expected = model_tensors_names(model)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise QuantFileError(f"{where}: tensors not in the model: {extra[:5]}")
    for name, value in tensors.items():
        parent_name, _, attr = name.rpartition(".")
        module = model.get_submodule(parent_name) if parent_name else model
        old_p = module._parameters.get(attr)
        if attr in module._parameters and old_p is not None:
            module._parameters[attr] = nn.Parameter(value, requires_grad=old_p.requires_grad)
        else:
            module._buffers[attr] = value


def model_tensors_names(model: nn.Module) -> set[str]:
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return names | {n for n, _ in model.named_buffers(remove_duplicate=False)}


def save_scales(model: nn.Module, path: str | Path) -> Path:
    """Write only the QuantLinear scales (one version of a QZO model's trainable state)."""
    tensors = {f"{n}.scales": m.scales.detach().contiguous() for n, m in quant_layers(model)}
    if not tensors:
        raise QuantFileError(f"{type(model).__name__} has no QuantLinear layer")
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": SCALES_FORMAT,
                                           "format_version": FORMAT_VERSION,
                                           "checksum": tensors_checksum(tensors)})
    tmp.replace(path)
    return path


def load_scales(model: nn.Module, path: str | Path) -> None:
    """Overwrite the model's scales from `save_scales` output; checks everything first."""
    tensors, _ = read_verified(path, SCALES_FORMAT)
    layers = dict(quant_layers(model))
    wanted = {f"{n}.scales" for n in layers}
    if set(tensors) != wanted:
        raise QuantFileError(f"{path}: scales for {len(tensors)} layers, model has "
                             f"{len(wanted)} (e.g. missing {sorted(wanted - set(tensors))[:3]})")
    for name, value in tensors.items():
        layer = layers[name.removesuffix(".scales")]
        if value.shape != layer.scales.shape or value.dtype != torch.float32:
            raise QuantFileError(f"{path}: {name} is {value.dtype} {tuple(value.shape)}, "
                                 f"expected float32 {tuple(layer.scales.shape)}")
    with torch.no_grad():
        for name, value in tensors.items():
            layers[name.removesuffix(".scales")].scales.data.copy_(value)
