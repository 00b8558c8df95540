"""Device side of a ternary task: load the coordinator's published snapshot into a packed model.

The coordinator publishes, per version, `publish_ternary`'s tensors: for each BitLinear `<p>`,
`<p>.packed` (2-bit codes of every weight), `<p>.gamma`, `<p>.bias` if any, and `<p>.mask` +
`<p>.latent` (the masked latents), or `<p>.weight` when every latent trains. A device builds
the task's model from its TaskSpec (Linear -> BitLinear), may pack it at once, and then takes
everything ternary from a snapshot: at join time, and again at every mask epoch start, because
its packed form holds only the latents the old mask selected.

`build_packed_model` builds that model without the fp32 model: the skeleton from the config on
the meta device, the layers `convert_to_bitlinear` would convert as empty packed BitLinear
modules (no codes until the first snapshot fills them), and every other tensor (embeddings,
norms, LM head) read alone from the base model's safetensors file(s). The fp32 matrices of the
ternary layers are never read, so a device's peak memory is the packed model's, not the
checkpoint's.

`load_published_ternary` checks the whole snapshot (layer set, codes, mask order, and the
version's checksum, computed from the snapshot's own latents) before any layer changes, so a
refused snapshot leaves the device's model as it was.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from seedfed.shared.model.replay import state_checksum
from seedfed.shared.model.ternary.bitlinear import (
    HEAD_NAMES,
    BitLinear,
    bitlinear_modules,
    convert_to_bitlinear,
)
from seedfed.shared.model.ternary.errors import TernaryChecksumError, TernaryFormatError
from seedfed.shared.model.ternary.mask import MaskConfig
from seedfed.shared.model.ternary.scope import TernaryScope, _scope, head_parameters
from seedfed.shared.model.ternary.snapshot import (
    _LAYER_PARTS,
    _assign_rest,
    _fill_layer,
    empty_init,
)
from torch import nn

#: What the error messages call a snapshot that did not come from a file.
SOURCE = "published ternary snapshot"
#: A Hugging Face directory's weights: one file, or shards listed by the index.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def build_packed_model(model_path: str | Path, *, act_bits: int | None = 8,
                       skip: tuple[str, ...] = HEAD_NAMES, model_kind: str = "causal_lm",
                       num_labels: int = 2) -> nn.Module:
    """A causal LM's device model, built from its Hugging Face directory without its fp32
    ternary matrices.

    The layers `convert_to_bitlinear(model, skip, act_bits)` converts become empty packed
    BitLinear modules: they hold no codes, gamma or latents until `load_published_ternary`
    fills them (a forward before that raises). Everything else comes from `model_path`'s
    safetensors weights, floats as float32 (what `AutoModelForCausalLM.from_pretrained(...,
    dtype=torch.float32)` gives), tied weights tied; buffers no file holds keep the values
    the model computes at construction.

    `model_kind="seq_cls"` builds a sentence-transformers directory's classifier the way
    `seedfed.shared.model.hf.load_base` does (`MeanPoolClassifier`: encoder, mean pooling,
    head); its float head stays empty too, until the snapshot (which always carries it) fills
    it.
    """
    import transformers

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    config = transformers.AutoConfig.from_pretrained(path)
    if model_kind == "seq_cls":
        return _packed_classifier(path, config, act_bits=act_bits, skip=skip,
                                  num_labels=num_labels)
    with empty_init(keep_buffers=True):
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(config,
                                                                         dtype=torch.float32)
    # The same layer set as the coordinator's conversion (on meta: no latents, no gamma).
    layers = _empty_bitlinears(model, skip, act_bits)
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    wanted = {n for n, _ in named if n.rpartition(".")[0] not in layers}
    _assign_rest(model, _read_base_tensors(path, wanted), path)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _empty_bitlinears(model: nn.Module, skip: tuple[str, ...], act_bits: int | None) -> set[str]:
    """Replace the Linear layers the coordinator converts by empty packed BitLinear modules."""
    for name in convert_to_bitlinear(model, skip=skip, act_bits=act_bits):
        old = model.get_submodule(name)
        assert isinstance(old, BitLinear)
        model.set_submodule(name, BitLinear(old.in_features, old.out_features,
                                            bias=old.bias is not None, act_bits=act_bits))
    return {n for n, _ in bitlinear_modules(model)}


def _packed_classifier(path: Path, config: Any, *, act_bits: int | None,
                       skip: tuple[str, ...], num_labels: int) -> nn.Module:
    """`build_packed_model` of a sentence-transformers classifier (mean pooling + head)."""
    import transformers
    from seedfed.shared.model.classifier import MeanPoolClassifier
    from seedfed.shared.model.hf import sentence_pooling

    pooling = sentence_pooling(path)
    if pooling is None:
        raise TernaryFormatError(f"{path}: a ternary classifier needs a mean-pooling "
                                 "sentence-transformers directory (modules.json)")
    with empty_init(keep_buffers=True):
        encoder = transformers.AutoModel.from_config(config, dtype=torch.float32,
                                                     add_pooling_layer=False)
        model = MeanPoolClassifier(encoder, num_labels, pooling.normalize)
    layers = _empty_bitlinears(model, skip, act_bits)
    # The encoder's own tensors, by their names in the base file (which holds no head).
    prefix = "encoder."
    named = list(model.encoder.named_parameters(remove_duplicate=False))
    named += list(model.encoder.named_buffers(remove_duplicate=False))
    wanted = {n for n, _ in named if f"{prefix}{n}".rpartition(".")[0] not in layers}
    found = _read_base_tensors(path, wanted | {f"{config.model_type}.{n}" for n in wanted})
    rest = {n.split(".", 1)[1] if n not in wanted else n: t for n, t in found.items()}
    _assign_encoder(model.encoder, rest, path)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _assign_encoder(encoder: nn.Module, tensors: Mapping[str, torch.Tensor], where: Path) -> None:
    """`_assign_rest` for an encoder whose BitLinear layers are still empty (meta-free)."""
    for name, value in tensors.items():
        parent, _, attr = name.rpartition(".")
        module = encoder.get_submodule(parent) if parent else encoder
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
        elif attr in module._buffers:
            module._buffers[attr] = value
    left = [n for n, t in list(encoder.named_parameters()) + list(encoder.named_buffers())
            if t.is_meta]
    if left:
        raise TernaryFormatError(f"{where}: the base weights lack tensors {left[:5]}")


def _read_base_tensors(path: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of `wanted` that `path`'s safetensors weights hold (floats as float32),
    read one at a time: nothing else of the file is loaded."""
    from safetensors import safe_open

    index = path / SAFETENSORS_INDEX
    if (path / SAFETENSORS_FILE).is_file():
        files: dict[str, list[str] | None] = {SAFETENSORS_FILE: None}
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = {}
            for key, file in weight_map.items():
                if key in wanted:
                    files.setdefault(str(file), []).append(str(key))  # type: ignore[union-attr]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise TernaryFormatError(f"{index}: not a valid safetensors index: {e}") from e
    else:
        raise TernaryFormatError(
            f"{path} holds no {SAFETENSORS_FILE} (nor a sharded {SAFETENSORS_INDEX}): a ternary "
            "device reads the base model's non-ternary tensors from safetensors only; convert "
            "the checkpoint (save_pretrained writes safetensors)")
    out: dict[str, torch.Tensor] = {}
    for file, keys in files.items():
        f: Any
        with safe_open(str(path / file), framework="pt", device="cpu") as f:
            for key in (keys if keys is not None else f.keys()):
                if key in wanted:
                    t = f.get_tensor(key)
                    out[key] = t.float() if t.is_floating_point() else t
    return out


def published_state(tensors: Mapping[str, torch.Tensor],
                    layers: list[tuple[str, BitLinear]]) -> dict[str, torch.Tensor]:
    """The scope state (canonical name -> covered latents) a snapshot carries, for `layers`."""
    state: dict[str, torch.Tensor] = {}
    for name, _ in layers:
        values = tensors.get(f"{name}.latent", tensors.get(f"{name}.weight"))
        if values is None:
            raise TernaryFormatError(f"{SOURCE}: layer {name} carries no latents (an "
                                     "inference-only snapshot cannot train)")
        if values.numel() or f"{name}.mask" not in tensors:
            state[f"{name}.weight"] = values.reshape(-1)  # (an empty mask covers nothing)
    return state


def load_published_ternary(model: nn.Module, tensors: Mapping[str, torch.Tensor], *,
                           config: MaskConfig, epoch: int,
                           expected_checksum: str | None = None) -> TernaryScope:
    """Put a published ternary snapshot into `model`'s BitLinear layers; returns the scope.

    `model` holds the task's BitLinear layers in either form (a fresh conversion or an older
    packed state); afterwards each layer is packed with the snapshot's codes, gamma, mask and
    masked latents (or, for full-latent tasks, holds every latent). `config` and `epoch` are
    the task's mask configuration and the version's mask epoch, recorded on the scope.
    With `expected_checksum` (the version's), a snapshot whose latents hash differently is
    refused with TernaryChecksumError before the model changes.
    """
    layers = bitlinear_modules(model)
    if not layers:
        raise TernaryFormatError(f"{type(model).__name__} has no BitLinear layers; build the "
                                 "task's model (scope 'ternary' converts it) first")
    layer_names = {n for n, _ in layers}
    heads = dict(head_parameters(model))
    stray = sorted(k for k in tensors if k not in heads and (
        k.rpartition(".")[0] not in layer_names or k.rpartition(".")[2] not in _LAYER_PARTS))
    if stray:
        raise TernaryFormatError(f"{SOURCE}: tensors {stray[:5]} belong to no BitLinear of "
                                 f"{type(model).__name__}")
    missing = sorted(set(heads) - set(tensors))
    if missing:
        raise TernaryFormatError(f"{SOURCE}: lacks the classification head {missing}")
    for name, p in heads.items():
        if tensors[name].shape != p.shape or tensors[name].dtype != torch.float32:
            raise TernaryFormatError(f"{SOURCE}: {name} is {tuple(tensors[name].shape)} "
                                     f"{tensors[name].dtype}, the model needs "
                                     f"{tuple(p.shape)} float32")
    state = published_state(tensors, layers)
    if config.trains_head(epoch):
        state.update({name: tensors[name].reshape(-1) for name in heads})
    if expected_checksum is not None:
        got = state_checksum(state)
        if got != expected_checksum:
            raise TernaryChecksumError(f"{SOURCE}: latents hash to {got[:16]}..., the version's "
                                       f"checksum is {expected_checksum[:16]}...; refusing it")
    # Fill fresh layers first (each checks codes, shapes and mask order), then swap them in:
    # a bad layer anywhere raises before the model changes.
    fresh: list[tuple[str, BitLinear]] = []
    remaining = {k: v for k, v in tensors.items() if k not in heads}
    for name, old in layers:
        m = BitLinear(old.in_features, old.out_features, bias=old.bias is not None,
                      act_bits=old.act_bits)
        _fill_layer(SOURCE, name, m, remaining)
        m.mask_epoch = epoch
        fresh.append((name, m))
    for name, m in fresh:
        model.set_submodule(name, m)
    for name, value in ((n, tensors[n]) for n in heads):
        parent, _, attr = name.rpartition(".")
        model.get_submodule(parent)._parameters[attr] = nn.Parameter(
            value.detach().clone(), requires_grad=False)
    return _scope(model, config, epoch)
