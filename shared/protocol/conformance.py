"""The conformance kit checked in numpy alone: the committed vectors against this package's
numpy implementation of the protocol.

`shared/protocol/golden/conformance.json` holds, per section, fixed inputs and what the
reference implementation makes of them. `check_conformance()` feeds each input of every
section a numpy implementation can reproduce to the numpy code (`philox`, `npzo`,
`aggregate`, `wire`) and compares the outputs bit for bit, raising `ConformanceMismatchError`
at the first difference. It runs wherever the protocol layer runs (a coordinator, an
inference-engine device), without torch.

The sections `published` (the fp16/bf16/int8/int4 snapshot formats) and `ternary` (the packed
ternary layer) are computed by torch code and are checked only by the model layer: the torch
reference `seedfed.shared.model.conformance` computes the whole file and
`tests/shared/model/test_conformance.py` compares it with the committed copy.

Encoding (docs/protocol.md section 7), defined here once for both layers: a uint64 is a
16-digit lowercase hex string (JSON numbers above 2**53 do not survive a float64 JSON
reader); a float32 is the 8-digit hex of its IEEE bits; a float64 the 16-digit hex of its bits
(with the decimal alongside for reading); z values are JSON integers -1 / +1; bytes are
lowercase hex.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from importlib import resources
from typing import Any

import numpy as np
from seedfed.shared.protocol.aggregate import (
    AggregationConfig,
    aggregate,
    build_entry,
    round_weights,
)
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.npzo import np_checksum, projected_gradient, update_coefficient
from seedfed.shared.protocol.philox import (
    MASK64,
    philox4x64_10,
    philox_rounds,
    signs,
    signs_at,
    stream_words_at,
    tensor_id,
)
from seedfed.shared.protocol.wire import pack_binary, unpack_binary

#: Version of the conformance file's layout (bumped when a section changes shape).
FORMAT = 1
#: Sections only the torch reference reproduces (`seedfed.shared.model.conformance`).
TORCH_SECTIONS: tuple[str, ...] = ("published", "ternary")


class ConformanceMismatchError(SeedfedError, AssertionError):
    """An implementation's output differs from the committed conformance vectors."""


# -- the file's encodings --------------------------------------------------------------------------
def u64(v: int) -> str:
    """A uint64 as 16 lowercase hex digits."""
    return f"{v & MASK64:016x}"


def f32(v: float) -> str:
    """A float32 (v rounded to float32 first) as the 8 hex digits of its big-endian bits."""
    return struct.pack(">f", float(np.float32(v))).hex()


def f64(v: float) -> dict[str, Any]:
    """A float64 as the 16 hex digits of its big-endian bits, with its decimal for reading."""
    return {"bits": struct.pack(">d", float(v)).hex(), "value": float(v)}


def f32_value(bits: str) -> float:
    """The float32 a `f32` string encodes."""
    return float(struct.unpack(">f", bytes.fromhex(bits))[0])


def _h(text: str) -> int:
    return int(text, 16)


def committed_conformance() -> dict[str, Any]:
    """The conformance file as committed in the package (the reference)."""
    text = (resources.files("seedfed.shared.protocol").joinpath("golden/conformance.json")
            .read_text("utf-8"))
    data: dict[str, Any] = json.loads(text)
    return data


def _expect(section: str, what: str, got: Any, want: Any) -> None:
    if got != want:
        raise ConformanceMismatchError(f"conformance section {section!r}, {what}: computed "
                                       f"{got!r}, the committed file says {want!r}")


# -- the stream ------------------------------------------------------------------------------------
def _check_philox(kit: dict[str, Any]) -> None:
    answers = kit["philox"]["known_answers"]
    for i, case in enumerate(answers):
        got = philox4x64_10([_h(c) for c in case["counter"]], [_h(k) for k in case["key"]])
        _expect("philox", f"known answer {i}", [u64(w) for w in got], case["output"])
    ka = answers[2]
    states = philox_rounds([_h(c) for c in ka["counter"]], [_h(k) for k in ka["key"]])
    for r in kit["philox"]["rounds_of_known_answer_2"]:
        _expect("philox", f"state after {r['rounds']} rounds",
                [u64(w) for w in states[r["rounds"]]], r["state"])


def _check_tensor_ids(kit: dict[str, Any]) -> None:
    for t in kit["tensor_ids"]:
        tid = tensor_id(t["name"])
        _expect("tensor_ids", f"tensor id of {t['name']!r}", u64(tid), t["tensor_id"])
        _expect("tensor_ids", f"top bit of {t['name']!r}", tid >= 1 << 63, t["at_least_2_63"])


def _check_blocks(kit: dict[str, Any]) -> None:
    for case in kit["blocks"]:
        _expect("blocks", f"tensor id of {case['name']!r}", u64(tensor_id(case["name"])),
                case["tensor_id"])
        blocks = np.array([_h(b["block"]) for b in case["blocks"]], dtype=np.uint64)
        words = stream_words_at(_h(case["seed"]), _h(case["tensor_id"]), blocks)
        for b, row in zip(case["blocks"], words, strict=True):
            _expect("blocks", f"block {b['block']} of {case['name']!r}",
                    [u64(int(w)) for w in row], b["words"])


def _z(values: np.ndarray) -> list[int]:
    return [int(v) for v in values.tolist()]


def _check_slices(kit: dict[str, Any]) -> None:
    for s in kit["slices"]:
        if not 0 <= s["start"] <= s["stop"] <= s["numel"]:
            raise ConformanceMismatchError(f"conformance section 'slices': [{s['start']}, "
                                           f"{s['stop']}) is outside {s['numel']} elements")
        got = _z(signs_at(_h(s["seed"]), s["name"], np.arange(s["start"], s["stop"])))
        _expect("slices", f"z[{s['start']}:{s['stop']}] of {s['name']!r}", got, s["z"])


def _check_masked(kit: dict[str, Any]) -> None:
    for m in kit["masked"]:
        got = _z(signs_at(_h(m["seed"]), m["name"], np.array(m["indices"], dtype=np.int64)))
        _expect("masked", f"z at {m['indices']} of {m['name']!r}", got, m["z"])


# -- the device's scalar, the coefficient rule, checksums and replay -------------------------------
def _check_gradients(kit: dict[str, Any]) -> None:
    for i, c in enumerate(kit["projected_gradients"]):
        g = projected_gradient(c["loss_plus"], c["loss_minus"], c["eps"], c["one_sided"],
                               c["clip"])
        _expect("projected_gradients", f"case {i}", f32(g), c["g"])


def _check_coefficients(kit: dict[str, Any]) -> None:
    for c in kit["coefficients"]:
        coef = update_coefficient(f32_value(c["g"]), c["lr"], c["perturbations"])
        _expect("coefficients", f"g={c['g']} lr={c['lr']} P={c['perturbations']}", f32(coef),
                c["coef"])


def _np_state(encoded: dict[str, list[str]]) -> dict[str, np.ndarray]:
    return {name: np.array([f32_value(v) for v in values], dtype=np.float32)
            for name, values in encoded.items()}


def _encoded(state: dict[str, np.ndarray]) -> dict[str, list[str]]:
    return {name: [f32(v) for v in values.tolist()] for name, values in state.items()}


def _check_checksums(kit: dict[str, Any]) -> None:
    for i, c in enumerate(kit["checksums"]):
        _expect("checksums", f"state {i}", np_checksum(_np_state(c["state"])), c["checksum"])


def _apply(state: dict[str, np.ndarray], masked: dict[str, np.ndarray], seeds: list[int],
           coefs: list[float]) -> None:
    """One entry over a state whose masked tensors hold only their covered elements: every
    element sees one float32 addition of coef * z per seed, in plan order."""
    for name in sorted(state):
        values, idx = state[name], masked.get(name)
        for seed, coef in zip(seeds, coefs, strict=True):
            z = signs(seed, name, values.size) if idx is None else signs_at(seed, name, idx)
            np.add(values, np.multiply(z, np.float32(coef), dtype=np.float32), out=values)


def _check_replay(kit: dict[str, Any]) -> None:
    r = kit["replay"]
    state = _np_state(r["start"]["state"])
    masked = {name: np.array(m["indices"], dtype=np.int64)
              for name, m in r["start"]["masked"].items()}
    _expect("replay", "canonical order", sorted(state), r["start"]["canonical_order"])
    _expect("replay", "starting checksum", np_checksum(state), r["start"]["checksum"])
    for e in r["log"]:
        coefs = [update_coefficient(f32_value(g), e["lr"], e["perturbations"]) for g in e["g"]]
        at = f"entry from v{e['base_version']}"
        _expect("replay", f"coefficients of the {at}", [f32(c) for c in coefs], e["coefs"])
        _apply(state, masked, [_h(s) for s in e["seeds"]], coefs)
        _expect("replay", f"checksum after the {at}", np_checksum(state), e["checksum"])
    _expect("replay", "final state", _encoded(state), r["final_state"])


# -- aggregation and the binary upload -------------------------------------------------------------
def _check_aggregation(kit: dict[str, Any]) -> None:
    a = kit["aggregation"]
    seeds = [_h(s) for s in a["seeds"]]
    for c in a["cases"]:
        config = AggregationConfig(rule=c["rule"], clip_bound=c["clip_bound"], trim=c["trim"],
                                   max_num_examples=c["max_num_examples"],
                                   max_weight_ratio=c["max_weight_ratio"])
        g = np.array([[f32_value(v) for v in row] for row in c["g"]], dtype=np.float64)
        w = round_weights(c["num_examples"], config)
        what = f"rule {c['rule']} over claims {c['num_examples']}"
        _expect("aggregation", f"weights of {what}", [float(v) for v in w], c["weights"])
        _expect("aggregation", f"aggregate of {what}", [f64(v)["bits"] for v in
                                                         aggregate(g, w, config)],
                [x["bits"] for x in c["aggregate"]])
        entry = build_entry("conformance", 0, seeds, g, w, a["lr"], a["perturbations"], config)
        _expect("aggregation", f"coefficients of {what}", [f32(v) for v in entry.coefs],
                c["coefs"])


def _check_binary_upload(kit: dict[str, Any]) -> None:
    b = kit["binary_upload"]
    m = np.array([[f32_value(v) for v in row] for row in b["scalars"]], dtype=np.float32)
    _expect("binary_upload", "packed body", pack_binary(m).hex(), b["body"])
    back = unpack_binary(bytes.fromhex(b["body"]))
    _expect("binary_upload", "unpacked scalars", [[f32(v) for v in row] for row in back.tolist()],
            b["scalars"])
    for bad in b["invalid"]:
        try:
            unpack_binary(bytes.fromhex(bad["body"]))
        except SeedfedError as e:
            _expect("binary_upload", f"refusal of a body with {bad['why']}", type(e).__name__,
                    bad["refused_with"])
        else:
            raise ConformanceMismatchError(f"conformance section 'binary_upload': a body with "
                                           f"{bad['why']} was accepted")


#: Section name -> its numpy check, in the file's order.
CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "philox": _check_philox, "tensor_ids": _check_tensor_ids, "blocks": _check_blocks,
    "slices": _check_slices, "masked": _check_masked, "projected_gradients": _check_gradients,
    "coefficients": _check_coefficients, "checksums": _check_checksums,
    "replay": _check_replay, "aggregation": _check_aggregation,
    "binary_upload": _check_binary_upload,
}


def check_conformance(kit: dict[str, Any] | None = None) -> list[str]:
    """Check every numpy-reproducible section of `kit` (default: the committed file); return
    the sections checked, or raise ConformanceMismatchError at the first mismatch."""
    kit = committed_conformance() if kit is None else kit
    _expect("format", "layout version", kit.get("format"), FORMAT)
    unknown = set(kit) - set(CHECKS) - set(TORCH_SECTIONS) - {"format"}
    if unknown:
        raise ConformanceMismatchError(f"the conformance file has sections no check knows: "
                                       f"{sorted(unknown)}")
    for name, check in CHECKS.items():
        if name not in kit:
            raise ConformanceMismatchError(f"the conformance file lacks section {name!r}")
        check(kit)
    return list(CHECKS)
