"""What the int8/int4 and ternary safetensors formats share: the tensor checksum and the
"every parameter and buffer once" listing of a model.

Checksum byte layout (both formats' files carry it in their metadata): for each tensor in
sorted name order, `name NUL dtype NUL [shape] NUL` in UTF-8, then the tensor's bytes
(contiguous, native little-endian), all fed to one SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

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
