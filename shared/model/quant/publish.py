"""Publishing a version's trainable state in the int8/int4 formats (the coordinator's snapshots).

A publisher maps the fp32 master state (canonical scope name -> flat float32 tensor) and the
live scope to the tensors of the published file (`seedfed.server.formats` finds
`publish_int8` / `publish_int4` here by name).

- `scales` scope (QZO, model already quantized): the state IS the scales, so a version's
  snapshot is those float32 scales unchanged (plus any float `include`d tensors); the codes
  travel once, in the quantized base model (`save_quantized`), never per version.
- any other scope over float weights (full, lora, named): every 2-D tensor whose rows are at
  least one group wide is quantized group-wise (`<name>.codes` int8 or packed-int4 uint8,
  `<name>.scales` float32, padding as in `groupwise`); narrower or 1-D tensors (biases, norms,
  LoRA B) stay float32, where quantizing would save nothing.
`read_published` turns such a file back into a flat float32 state for `Scope.write`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from seedfed.shared.model.quant.groupwise import dequantize, pack_int4, quantize_groups, unpack_int4
from seedfed.shared.model.quant.scales_scope import ScalesScope
from seedfed.shared.model.scopes import Scope
from seedfed.shared.protocol.errors import MissingTensorError

#: Group size of published snapshots of float scopes.
PUBLISH_GROUP_SIZE = 64

State = Mapping[str, torch.Tensor]


def _shapes(scope: Scope | None, state: State) -> dict[str, tuple[int, ...]]:
    if scope is None:
        return {k: tuple(v.shape) for k, v in state.items()}
    return {t.name: (tuple(t.tensor.shape) if t.indices is None else (t.numel,)) for t in scope}


def publish(state: State, scope: Scope | None, bits: int,
            group_size: int = PUBLISH_GROUP_SIZE) -> dict[str, torch.Tensor]:
    if isinstance(scope, ScalesScope):
        return {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
    shapes = _shapes(scope, state)
    out: dict[str, torch.Tensor] = {}
    for name, flat in state.items():
        if name not in shapes:
            raise MissingTensorError(f"published state has {name}, which the scope lacks")
        shape = shapes[name]
        value = flat.detach().to(torch.float32).reshape(shape)
        if value.dim() == 2 and shape[1] >= group_size:
            codes, scales = quantize_groups(value, bits, group_size)
            out[f"{name}.codes"] = codes if bits == 8 else pack_int4(codes)
            out[f"{name}.scales"] = scales
        else:
            out[name] = value.reshape(-1).contiguous()
    return out


def publish_int8(state: State, scope: Scope | None) -> dict[str, torch.Tensor]:
    return publish(state, scope, 8)


def publish_int4(state: State, scope: Scope | None) -> dict[str, torch.Tensor]:
    return publish(state, scope, 4)


def read_published(tensors: State, scope: Scope, bits: int) -> dict[str, torch.Tensor]:
    """Flat float32 state (for `scope.write`) from a `publish` output of the same scope."""
    if isinstance(scope, ScalesScope):
        return {k: v.to(torch.float32).reshape(-1) for k, v in tensors.items()}
    out: dict[str, torch.Tensor] = {}
    for t in scope:
        if t.name in tensors:
            out[t.name] = tensors[t.name].to(torch.float32).reshape(-1)
            continue
        codes, scales = tensors.get(f"{t.name}.codes"), tensors.get(f"{t.name}.scales")
        if codes is None or scales is None:
            raise MissingTensorError(f"published file lacks {t.name} (nor its codes/scales)")
        ints = codes if bits == 8 else unpack_int4(codes)
        out[t.name] = dequantize(ints, scales, t.tensor.shape[1]).reshape(-1)
    return out
