"""Golden vectors of the perturbation stream, for tests and for devices written in other languages.

A port implements the four lines of the stream contract (docs/protocol.md, section 1) and checks
itself against `shared/protocol/golden/vectors.json`: for each (seed, name) the tensor id and the
first 256 values of z. `seedfed protocol vectors` prints the same list. The numpy stream of
`philox` computes them here, so the protocol layer checks itself without torch.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from seedfed.shared.protocol.philox import philox4x64_10, signs, tensor_id

GOLDEN_CASES: tuple[tuple[int, str], ...] = (
    (0, ""),
    (0, "weight"),
    (1, "model.layers.0.self_attn.q_proj.weight"),
    (42, "bert.encoder.layer.0.attention.self.query.lora_A.default.weight"),
    (2**32 + 7, "classifier.modules_to_save.default.bias"),
    (2**53 - 1, "model.embed_tokens.weight"),
    (2**64 - 1, "lm_head.weight"),
    (123456789, "名前.ünïcode"),
)
N_VALUES = 256

#: Random123's published known answers for Philox4x64-10 (counter, key -> output).
PHILOX_KAT: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = (
    ((0, 0, 0, 0), (0, 0),
     (0x16554D9ECA36314C, 0xDB20FE9D672D0FDC, 0xD7E772CEE186176B, 0x7E68B68AEC7BA23B)),
    ((2**64 - 1,) * 4, (2**64 - 1,) * 2,
     (0x87B092C3013FE90B, 0x438C3C67BE8D0224, 0x9CC7D7C69CD777B6, 0xA09CAEBF594F0BA0)),
    ((0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89),
     (0x452821E638D01377, 0xBE5466CF34E90C6C),
     (0xA528F45403E61D95, 0x38C72DBD566E9788, 0xA5A1610E72FD18B5, 0x57BD43B5E52B7FE6)),
)


def compute_vectors() -> list[dict[str, Any]]:
    """The golden vectors as computed by this implementation."""
    out = []
    for seed, name in GOLDEN_CASES:
        z = signs(seed, name, N_VALUES)
        out.append({"seed": seed, "name": name, "tensor_id": tensor_id(name),
                    "z": [int(v) for v in z.tolist()]})
    return out


def committed_vectors() -> list[dict[str, Any]]:
    """The golden vectors as committed in the repository (the reference)."""
    text = (resources.files("seedfed.shared.protocol").joinpath("golden/vectors.json")
            .read_text("utf-8"))
    data: list[dict[str, Any]] = json.loads(text)
    return data


def check_kat() -> None:
    """Raise AssertionError if the reference Philox disagrees with Random123's known answers."""
    for counter, key, expected in PHILOX_KAT:
        got = philox4x64_10(counter, key)
        if got != expected:
            raise AssertionError(f"Philox4x64-10 KAT failed for counter {counter}, key {key}")
