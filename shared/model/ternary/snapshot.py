"""Packed-ternary snapshots: what the coordinator publishes and what a device loads.

Layout of a ternary model directory:
- `config.json`: the Hugging Face config (the skeleton is rebuilt on the meta device);
- `ternary.safetensors` with, for each BitLinear `<p>`:
  `<p>.packed` uint8 codes (see `quantize`: code = q + 1, element i of the row-major matrix at
  byte i // 4, bits 2 (i % 4) and up, LSB pair first), `<p>.gamma` float32 [1], `<p>.bias` if
  any, and with latents either `<p>.mask` int32 sorted flat indices + `<p>.latent` float32
  (the masked latents) or, for full-latent training, `<p>.weight` float32 (every latent);
  plus every other parameter and buffer of the model under its own name (tied ones once).
  Metadata: `format` = "seedfed-ternary", `format_version` = "1", `code_map`, `architecture`,
  `layers` (JSON: path -> [in_features, out_features, has_bias, act_bits]), `mask` (JSON: the
  MaskConfig and epoch, when known), `checksum` (see `io`).

Loading verifies every byte before the model holds any of it, never materializes a float copy
of the ternary matrices, and can skip the latents (`with_latents=False`: inference).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from seedfed.shared.model.scopes import Scope
from seedfed.shared.model.tensorfile import model_directory, model_tensors, skeleton_parts
from seedfed.shared.model.ternary.bitlinear import BitLinear, bitlinear_modules
from seedfed.shared.model.ternary.errors import TernaryFormatError
from seedfed.shared.model.ternary.io import read_tensors, write_tensors
from seedfed.shared.model.ternary.mask import MaskConfig
from seedfed.shared.model.ternary.quantize import invalid_code_count, pack_ternary
from torch import nn

FORMAT = "seedfed-ternary"
FORMAT_VERSION = "1"
WEIGHTS_FILE = "ternary.safetensors"
CODE_MAP = ("code=q+1 (0:-1, 1:0, 2:+1, 3:invalid); row-major element i in byte i//4 at bits "
            "2*(i%4)..2*(i%4)+1, LSB pair first; tail padded with code 1")
_LAYER_PARTS = ("packed", "gamma", "bias", "mask", "latent", "weight")
_LATENT_PARTS = ("mask", "latent", "weight")


def layer_tensors(name: str, m: BitLinear, with_latents: bool = True,
                  latent_values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The snapshot tensors of one BitLinear (codes from its current latents and gamma)."""
    out = {f"{name}.packed": pack_ternary(m.codes()), f"{name}.gamma": m.gamma.reshape(1).clone()}
    if m.bias is not None:
        out[f"{name}.bias"] = m.bias.detach().float()
    if not with_latents:
        return out
    if m.mask is not None:
        if latent_values is None:
            latent_values = m.latent if m.latent is not None else (
                m.weight.detach().reshape(-1)[m.mask] if m.weight is not None else None)
        if latent_values is not None:
            out[f"{name}.mask"] = m.mask.to(torch.int32)
            out[f"{name}.latent"] = latent_values.detach().reshape(-1).float()
    elif m.weight is not None:
        out[f"{name}.weight"] = m.weight.detach().float()
    return out


def ternary_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Module path -> the int8 ternary matrix the model's forward uses now."""
    return {name: m.codes() for name, m in bitlinear_modules(model)}


def publish_ternary(state: Mapping[str, torch.Tensor], scope: Scope | None,
                    ) -> dict[str, torch.Tensor]:
    """Snapshot publisher for the coordinator (`seedfed.server.formats`): packed codes and gamma
    of every BitLinear of the scope's model, plus masks and the masked latents from `state`
    (canonical name `<path>.weight` -> covered values)."""
    if scope is None:
        raise TernaryFormatError("the ternary format needs the live scope (its model's layers)")
    from seedfed.shared.model.ternary.scope import head_parameters

    out: dict[str, torch.Tensor] = {}
    for name, m in bitlinear_modules(scope.model):
        values = state.get(f"{name}.weight")
        out.update(layer_tensors(name, m, with_latents=True, latent_values=values))
    # A classifier's float head travels with every snapshot: a device builds its model
    # without it (the prototypes need the coordinator's forward), trained or frozen alike.
    for name, p in head_parameters(scope.model):
        out[name] = state.get(name, p.detach()).reshape(p.shape).float().clone()
    return out


def save_ternary_model(model: nn.Module, directory: str | Path, *, with_latents: bool = True,
                       mask_config: MaskConfig | None = None) -> Path:
    """Write a BitLinear model as a packed-ternary snapshot; returns the weights file."""
    layers = bitlinear_modules(model)
    if not layers:
        raise TernaryFormatError(f"{type(model).__name__} has no BitLinear layer; convert it")
    directory = model_directory(model, directory)
    tensors: dict[str, torch.Tensor] = {}
    for name, m in layers:
        tensors.update(layer_tensors(name, m, with_latents))
    tensors.update(model_tensors(model, skip_modules={n for n, _ in layers}))
    epochs = {m.mask_epoch for _, m in layers}
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "code_map": CODE_MAP,
        "architecture": type(model).__name__,
        "layers": json.dumps({n: [m.in_features, m.out_features, m.bias is not None,
                                  m.act_bits] for n, m in layers}),
        "mask": json.dumps({"config": None if mask_config is None else asdict(mask_config),
                            "epoch": epochs.pop() if len(epochs) == 1 else None}),
    }
    return write_tensors(directory / WEIGHTS_FILE, tensors, meta)


def load_ternary_model(directory: str | Path, *, with_latents: bool = True,
                       model_cls: Any = None) -> nn.Module:
    """Rebuild a model saved by `save_ternary_model` (packed form; latents only if asked)."""
    directory = Path(directory)
    layer_table = _layer_table(directory / WEIGHTS_FILE)

    def keep(tensor_name: str) -> bool:
        prefix, _, part = tensor_name.rpartition(".")
        return with_latents or prefix not in layer_table or part not in _LATENT_PARTS

    tensors, meta = read_tensors(directory / WEIGHTS_FILE, expected_format=FORMAT, keep=keep)
    if meta.get("format_version") != FORMAT_VERSION:
        raise TernaryFormatError(f"{directory}: format version {meta.get('format_version')!r} "
                                 f"is not supported (this side reads {FORMAT_VERSION})")
    epoch = json.loads(meta.get("mask", "{}")).get("epoch")
    model = _skeleton(directory, meta, model_cls)
    for name, (in_f, out_f, has_bias, act_bits) in layer_table.items():
        m = BitLinear(in_f, out_f, bias=has_bias, act_bits=act_bits)
        _fill_layer(directory, name, m, tensors)
        m.mask_epoch = epoch
        try:
            model.set_submodule(name, m)
        except AttributeError as e:
            raise TernaryFormatError(f"{directory}: layer {name} is not in "
                                     f"{type(model).__name__}") from e
    _assign_rest(model, {k: v for k, v in tensors.items()
                         if k.rpartition(".")[0] not in layer_table}, directory)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _layer_table(path: Path) -> dict[str, list[Any]]:
    from seedfed.shared.model.ternary.io import (
        _header,  # the table is needed before choosing what to keep
    )

    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            _, meta = _header(f, path, size)
    except OSError as e:
        raise TernaryFormatError(f"{path}: cannot open: {e}") from e
    try:
        table = json.loads(meta["layers"])
        if not isinstance(table, dict):
            raise ValueError("not an object")
        return {str(k): list(v) for k, v in table.items()}
    except (KeyError, ValueError, TypeError) as e:
        raise TernaryFormatError(f"{path}: metadata lacks a valid layer table") from e


def _fill_layer(where: str | Path, name: str, m: BitLinear,
                tensors: dict[str, torch.Tensor]) -> None:
    part = {p: tensors.pop(f"{name}.{p}", None) for p in _LAYER_PARTS}
    if part["packed"] is None or part["gamma"] is None:
        raise TernaryFormatError(f"{where}: layer {name} lacks its packed codes or gamma")
    bad = invalid_code_count(part["packed"])
    if bad:
        raise TernaryFormatError(f"{where}: {name} has {bad} bytes holding the invalid code 3")
    if (part["bias"] is None) != (m.bias is None):
        raise TernaryFormatError(f"{where}: {name} bias does not match the layer table")
    try:
        if part["weight"] is not None:  # full-latent form
            m.weight = nn.Parameter(part["weight"].reshape(m.out_features, m.in_features),
                                    requires_grad=False)
            m.gamma = part["gamma"].reshape(()).to(torch.float32)
            if part["bias"] is not None:
                m.bias = nn.Parameter(part["bias"].float(), requires_grad=False)
        else:
            m.load_packed(part["packed"], part["gamma"], part["mask"], part["latent"],
                          part["bias"])
    except (ValueError, RuntimeError) as e:
        raise TernaryFormatError(f"{where}: layer {name}: {e}") from e
    if m.mask is not None and m.mask.numel():
        idx = m.mask.long()
        n = m.in_features * m.out_features
        if int(idx[0]) < 0 or int(idx[-1]) >= n or not bool((idx[1:] > idx[:-1]).all()):
            raise TernaryFormatError(f"{where}: {name} mask is not sorted unique indices < {n}")


def _skeleton(directory: Path, meta: Mapping[str, str], model_cls: Any) -> nn.Module:
    config, model_cls = skeleton_parts(directory, meta, model_cls, TernaryFormatError)
    with empty_init():
        return model_cls(config)


@contextmanager
def empty_init(*, keep_buffers: bool = False) -> Iterator[None]:
    """Build modules without memory for their parameters: everything on the meta device, or
    with `keep_buffers` the parameters only, so buffers computed at construction (a rotary
    embedding's `inv_freq`, which no weights file holds) keep their values.

    `keep_buffers` swaps `nn.Module.register_parameter` for the duration (as accelerate's
    `init_empty_weights(include_buffers=False)` does): build nothing in another thread
    meanwhile. A parameter created on the CPU first is moved to meta as it registers, before
    any initializer writes it, so its pages are never touched."""
    if not keep_buffers:
        with torch.device("meta"):
            yield
        return
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _assign_rest(model: nn.Module, tensors: Mapping[str, torch.Tensor], where: Path) -> None:
    for name, value in tensors.items():
        parent, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(parent) if parent else model
        except AttributeError as e:
            raise TernaryFormatError(f"{where}: tensor {name} is not in the model") from e
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
        elif attr in module._buffers:
            module._buffers[attr] = value
        else:
            raise TernaryFormatError(f"{where}: tensor {name} is not in the model")
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta]
    if left:
        raise TernaryFormatError(f"{where}: the file lacks tensors {left[:5]}")
