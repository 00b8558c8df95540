"""Conformance vectors of the published snapshot formats (docs/protocol.md section 6): the
fp16/bf16 casts, the group-wise int8/int4 layout, the packed-ternary layer a ternary device
loads (with gamma, the mask, the activations' fake quantization and the checksum it verifies),
and a whole safetensors file to parse. `seedfed.shared.model.conformance` adds them to the kit
as the `published` and `ternary` sections; the reference implementation computes every value.

Inputs are exact binary fractions (any reader holds the same float32 bits), chosen to reach
the rules a port gets wrong: round-half-to-even ties of every rounding step, a group of zeros
(scale 1.0), a row padded to a whole group, a negative absmax, a packed tail byte.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as st_load
from seedfed.shared.model.quant.groupwise import dequantize, pack_int4, unpack_int4
from seedfed.shared.model.quant.publish import PUBLISH_GROUP_SIZE, publish
from seedfed.shared.model.replay import state_checksum
from seedfed.shared.model.ternary.bitlinear import BitLinear
from seedfed.shared.model.ternary.mask import threshold_mask
from seedfed.shared.model.ternary.quantize import (
    absmean_gamma,
    pack_ternary,
    quantize_activations,
    ternarize,
)
from seedfed.shared.protocol.conformance import f32

#: safetensors' dtype names of the tensors the formats write.
DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32"}


def _bits16(t: torch.Tensor) -> list[str]:
    return [f"{int(w) & 0xFFFF:04x}" for w in t.contiguous().view(torch.int16).tolist()]


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as the vectors spell it: dtype, shape, and its values (float32 bits, 16-bit
    patterns, or integers)."""
    out: dict[str, Any] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)}
    flat = t.detach().reshape(-1)
    if t.dtype == torch.float32:
        out["values"] = [f32(v) for v in flat.tolist()]
    elif t.dtype in (torch.float16, torch.bfloat16):
        out["values"] = _bits16(flat)
    else:
        out["values"] = [int(v) for v in flat.tolist()]
    return out


# -- the float casts ------------------------------------------------------------------------------
#: float32 values and what fp16 / bf16 make of them (round to nearest, ties to even): ties at
#: 1.0 in both widths, the largest fp16, an fp16 subnormal, -0.0, a bf16 tie that rounds up.
CAST_VALUES: tuple[float, ...] = (
    1.0, -2.5, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65504.0, 2**-20, -0.0,
    0.1, 3.14159265, 1e-8, -1234.5678,
)


def _casts() -> list[dict[str, Any]]:
    x = torch.tensor(CAST_VALUES, dtype=torch.float32)
    f16, bf16 = _bits16(x.to(torch.float16)), _bits16(x.to(torch.bfloat16))
    return [{"f32": f32(v), "f16": a, "bf16": b}
            for v, a, b in zip(x.tolist(), f16, bf16, strict=True)]


# -- int8 / int4 ---------------------------------------------------------------------------------
def _exact(n: int, step: int, offset: int, spread: int, denom: float) -> list[float]:
    return [((i * step + offset) % spread - spread // 2) / denom for i in range(n)]


def format_state() -> dict[str, torch.Tensor]:
    """The trainable state the int8/int4 vectors publish: a 3 x 70 matrix (70 columns: two
    groups of 64, the second padded), a bias, and a 2 x 8 matrix too narrow for one group."""
    rows = [
        # row 0: absmax 127/16, so the int8 scale is exactly 1/16 and cols 1-3 are ties
        [127 / 16, 0.09375, 0.15625, -0.03125, *_exact(66, 37, 11, 101, 16.0)],
        # row 1: absmax -0.875 (negative), so the int4 scale is exactly 1/8 and cols 1-3 ties
        [-0.875, 0.1875, 0.3125, -0.0625, *_exact(66, 29, 3, 57, 32.0)],
        # row 2: the first group all zeros (scale 1.0), the second small values
        [0.0] * 64 + [(k - 3) / 1024 for k in range(6)],
    ]
    return {"dense.weight": torch.tensor(rows, dtype=torch.float32),
            "dense.bias": torch.tensor([0.5, -0.25, 1e-3], dtype=torch.float32),
            "narrow.weight": torch.tensor([_exact(8, 5, 1, 9, 8.0), _exact(8, 7, 2, 9, 4.0)],
                                          dtype=torch.float32)}


def _decoded(published: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
             bits: int) -> dict[str, list[str]]:
    out = {}
    for name, value in state.items():
        if name in published:
            out[name] = [f32(v) for v in published[name].reshape(-1).tolist()]
            continue
        codes = published[f"{name}.codes"]
        ints = codes if bits == 8 else unpack_int4(codes)
        w = dequantize(ints, published[f"{name}.scales"], value.shape[1])
        out[name] = [f32(v) for v in w.reshape(-1).tolist()]
    return out


def _groupwise(bits: int) -> dict[str, Any]:
    state = format_state()
    published = publish(state, None, bits)
    if bits == 4:  # the packing round-trips: the published bytes hold the codes
        codes = published["dense.weight.codes"]
        assert torch.equal(pack_int4(unpack_int4(codes)), codes)
    return {"tensors": {k: _tensor(v) for k, v in sorted(published.items())},
            "decoded": _decoded(published, state, bits)}


# -- ternary --------------------------------------------------------------------------------------
TERNARY_LAYER = "encoder.layer.0.dense"
TERNARY_SHAPE = (3, 6)  # out_features, in_features: 18 weights, a tail byte of 2 codes
TERNARY_MASK_FRACTION = 0.25
TERNARY_HEAD = "classifier.weight"


#: 18 latents whose mean |w| is exactly 0.5 (so gamma = 0.5): +-0.25 and +-0.75 sit on the
#: rounding's ties (w / gamma = +-0.5 -> 0, +-1.5 -> +-2, clamped to +-1), and two latents tie
#: at the mask's cut (the lower flat index is kept).
TERNARY_LATENTS: tuple[float, ...] = (
    0.25, -0.75, 1.0, -0.125, 0.5, 0.625, -0.25, 0.875, -1.5, 0.0625, 0.3125, -0.0625,
    0.75, -0.5, 0.125, 0.4375, -0.6875, 0.1875)


def ternary_layer() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents (out x in), bias and head of the ternary vectors."""
    latents = torch.tensor(TERNARY_LATENTS, dtype=torch.float32).reshape(TERNARY_SHAPE)
    bias = torch.tensor([0.25, -0.5, 0.125], dtype=torch.float32)
    head = torch.tensor([[0.5, -0.25, 0.125], [-0.5, 0.25, 1.0]], dtype=torch.float32)
    return latents, bias, head


def _ternary() -> dict[str, Any]:
    w, bias, head = ternary_layer()
    gamma = absmean_gamma(w)
    q = ternarize(w, gamma)
    mask = threshold_mask(w, gamma, TERNARY_MASK_FRACTION)
    latent = w.reshape(-1)[mask.long()]
    published = {f"{TERNARY_LAYER}.packed": pack_ternary(q),
                 f"{TERNARY_LAYER}.gamma": gamma.reshape(1).clone(),
                 f"{TERNARY_LAYER}.bias": bias, f"{TERNARY_LAYER}.mask": mask,
                 f"{TERNARY_LAYER}.latent": latent, TERNARY_HEAD: head}
    # A device's packed layer from the published tensors: the matrix its forward uses.
    m = BitLinear(TERNARY_SHAPE[1], TERNARY_SHAPE[0], bias=True)
    m.load_packed(published[f"{TERNARY_LAYER}.packed"], gamma, mask, latent, bias)
    loaded = m.ternary_values(torch.int8)
    assert torch.equal(loaded, q)
    x = torch.tensor([[0.5, -1.25, 3.0, 0.0, 2.0, -0.75], [1e-3, 2e-3, -5e-4, 0.0, 0.0, 1e-3]],
                     dtype=torch.float32)
    state = {f"{TERNARY_LAYER}.weight": latent}
    return {"layer": TERNARY_LAYER, "shape": list(TERNARY_SHAPE),
            "latents": [f32(v) for v in w.reshape(-1).tolist()],
            "gamma": f32(float(gamma)), "q": [int(v) for v in q.reshape(-1).tolist()],
            "mask_fraction": TERNARY_MASK_FRACTION,
            "distance": [f32(v) for v in (w.abs() / gamma - 0.5).abs().reshape(-1).tolist()],
            "tensors": {k: _tensor(v) for k, v in sorted(published.items())},
            "effective_weight": [f32(v) for v in (loaded.float() * gamma).reshape(-1).tolist()],
            "scope_state": {k: [f32(v) for v in t.tolist()] for k, t in state.items()},
            "checksum": state_checksum(state),
            "checksum_with_head": state_checksum({**state, TERNARY_HEAD: head.reshape(-1)}),
            "activations": {"act_bits": 8, "x": [[f32(v) for v in r] for r in x.tolist()],
                            "quantized": [[f32(v) for v in r] for r in
                                          quantize_activations(x, 8).tolist()]}}


# -- a whole file ---------------------------------------------------------------------------------
def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file (the layout of huggingface/safetensors): an 8-byte little-endian
    header length, the JSON header (names in sorted order, `data_offsets` into the data that
    follows, `__metadata__`), padded with spaces to a multiple of 8, then each tensor's
    little-endian bytes in that order. Built by hand, so the vector does not depend on the
    library's choices of order and padding; any reader opens it."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    data = b""
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _file() -> dict[str, Any]:
    published = publish(format_state(), None, 4)
    meta = {"task_id": "conformance", "version": "3", "format": "int4",
            "checksum": "0" * 64}
    data = safetensors_bytes(published, meta)
    back = st_load(data)  # the library reads what the vector spells
    assert set(back) == set(published)
    assert all(torch.equal(back[k], v) for k, v in published.items())
    return {"bytes": data.hex(), "metadata": meta,
            "tensors": {k: _tensor(v) for k, v in sorted(published.items())}}


def published_vectors() -> dict[str, Any]:
    """The `published` section: casts, int8, int4 and a whole file."""
    state = format_state()
    return {"group_size": PUBLISH_GROUP_SIZE, "casts": _casts(),
            "state": {k: {"shape": list(v.shape),
                          "values": [f32(x) for x in v.reshape(-1).tolist()]}
                      for k, v in state.items()},
            "int8": _groupwise(8), "int4": _groupwise(4), "file": _file()}


def ternary_vectors() -> dict[str, Any]:
    """The `ternary` section: one published BitLinear layer and the head, as a device loads
    them."""
    return _ternary()
