"""The devices the stream's torch path is tested on, and the switch that sends CPU tensors
through it (`stream.torch_stream`), for tests comparing it with the C kernel bit for bit."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from seedfed.shared.model.stream import torch_stream as torch_stream

#: "cpu" (the torch ops forced there) and every accelerator this machine has.
DEVICES: list[str] = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def host_stream() -> AbstractContextManager[None]:
    """Inside: CPU tensors take the C kernel (numpy without it), even when the whole run has
    SEEDFED_STREAM=torch: the reference the torch path is compared with."""
    return torch_stream(False)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw float32 bits on the host (so -0.0, subnormals and infinities count)."""
    return x.detach().cpu().contiguous().view(torch.int32)
