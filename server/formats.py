"""Published snapshot formats: the one place a new format plugs in.

The master of a task's trainable state is always fp32 (replay is defined there); what devices
download is the snapshot published in the task's format. A format is a function from the fp32
state (canonical scope name -> flat float32 tensor) and the live scope (for formats that need
the model, e.g. to quantize whole layers) to the tensors written to the snapshot file.

fp32, fp16 and bf16 live here. The int8/int4 group-wise and packed-ternary formats are built in
`seedfed.shared.model.quant.publish` / `seedfed.shared.model.ternary.snapshot`, which expose
`publish_<format>(state, scope)`; `publisher` finds them there lazily (so the coordinator does
not import them until a task uses them). Any other format plugs in with
`register_format("name")(fn)`, with no change to the coordinator.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

import torch
from seedfed.server.errors import InvalidTaskError
from seedfed.shared.model.scopes import Scope

State = Mapping[str, torch.Tensor]
Publisher = Callable[[State, Scope | None], dict[str, torch.Tensor]]

_PUBLISHERS: dict[str, Publisher] = {}
#: Where a format defined outside the coordinator is looked for (module, function name).
_LAZY: dict[str, tuple[str, str]] = {
    "int8": ("seedfed.shared.model.quant.publish", "publish_int8"),
    "int4": ("seedfed.shared.model.quant.publish", "publish_int4"),
    "ternary": ("seedfed.shared.model.ternary.snapshot", "publish_ternary"),
}


def register_format(name: str) -> Callable[[Publisher], Publisher]:
    def wrap(fn: Publisher) -> Publisher:
        _PUBLISHERS[name] = fn
        return fn

    return wrap


def _cast(dtype: torch.dtype) -> Publisher:
    def publish(state: State, _scope: Scope | None) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(dtype).contiguous() for k, v in state.items()}

    return publish


register_format("fp32")(_cast(torch.float32))
register_format("fp16")(_cast(torch.float16))
register_format("bf16")(_cast(torch.bfloat16))


def publisher(name: str) -> Publisher:
    """The publisher of format `name`; InvalidTaskError naming the known ones if none."""
    if name in _PUBLISHERS:
        return _PUBLISHERS[name]
    if name in _LAZY:
        module, attr = _LAZY[name]
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise InvalidTaskError(
                f"snapshot format {name!r} is not available yet ({module}.{attr} not found); "
                f"available: {sorted(_PUBLISHERS)}") from e
        _PUBLISHERS[name] = fn
        return fn
    raise InvalidTaskError(f"unknown snapshot format {name!r}; known: {sorted(_PUBLISHERS)}")
