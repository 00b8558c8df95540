"""What the int8/int4 and ternary safetensors formats share: the tensor checksum, the
"every parameter and buffer once" listing of a model, the model directory with its config,
the format and checksum fields of the metadata, and the skeleton a loader rebuilds.

Checksum byte layout (both formats' files carry it in their metadata): for each tensor in
sorted name order, `name NUL dtype NUL [shape] NUL` in UTF-8, then the tensor's bytes
(contiguous, native little-endian), all fed to one SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn


def checksum_prefix(name: str, dtype: torch.dtype, shape: list[int]) -> bytes:
    """The bytes hashed before a tensor's data (readers that stream a file hash the same)."""
    return f"{name}\0{str(dtype).removeprefix('torch.')}\0{list(shape)}\0".encode()


def tensors_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors (layout in the module docstring)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(checksum_prefix(name, t.dtype, list(t.shape)))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_tensors(model: nn.Module, skip_modules: Collection[str] = ()
                  ) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (tied tensors under their first kept name), contiguous;
    tensors owned directly by a module path in `skip_modules` are left out."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if name.rpartition(".")[0] in skip_modules or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.detach().contiguous()
    return out


def model_directory(model: nn.Module, directory: str | Path) -> Path:
    """Create `directory` for a saved model and write the model's Hugging Face config.json
    into it (when it has one), so a loader can rebuild the skeleton on the meta device."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    return directory


def recorded_checksum(path: Path, meta: Mapping[str, str], expected_format: str,
                      error: type[Exception]) -> str:
    """The checksum a file's metadata records, once its `format` is `expected_format`;
    `error` (the format's own type) naming `path` otherwise."""
    if meta.get("format") != expected_format:
        raise error(f"{path}: format is {meta.get('format')!r}, expected {expected_format!r}")
    recorded = meta.get("checksum")
    if not recorded:
        raise error(f"{path}: no checksum in the metadata")
    return recorded


def skeleton_parts(directory: Path, meta: Mapping[str, str], model_cls: Any,
                   error: type[Exception]) -> tuple[Any, Any]:
    """(config, model class) to rebuild a saved model: the directory's config.json, and
    `model_cls` or else the transformers class its `architecture` metadata names."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    if model_cls is None:
        model_cls = getattr(transformers, meta.get("architecture", ""), None)
        if model_cls is None:
            raise error(f"{directory}: unknown architecture {meta.get('architecture')!r}; "
                        "pass model_cls=")
    return config, model_cls
