"""The conformance kit's torch reference: it computes every section of the golden file.

`compute_conformance()` runs the reference implementation (`stream`, `replay`, `estimator`,
`aggregate`, `wire`, and the published snapshot formats of `conformance_formats`) on small
fixed inputs and returns the results as JSON-ready data; the committed copy is
`shared/protocol/golden/conformance.json` (`seedfed.shared.protocol.conformance.
committed_conformance`), and `tests/shared/model/test_conformance.py` recomputes it, so the file
can never drift from the code. `seedfed protocol vectors --all` prints both this and the stream
vectors (`seedfed.shared.protocol.vectors`).

The file's encodings (u64, f32, f64) and the numpy check of every section that needs no torch
live in `seedfed.shared.protocol.conformance`; the `published` and `ternary` sections are
checked only here, against this computation.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from seedfed.shared.model.conformance_formats import published_vectors, ternary_vectors
from seedfed.shared.model.replay import apply_seeds, checksum, state_checksum
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.model.stream import rademacher, rademacher_at
from seedfed.shared.protocol.aggregate import (
    AggregationConfig,
    aggregate,
    build_entry,
    round_weights,
)
from seedfed.shared.protocol.conformance import FORMAT, f32, f64, u64
from seedfed.shared.protocol.errors import SeedfedError
from seedfed.shared.protocol.npzo import LogEntry, projected_gradient, update_coefficient
from seedfed.shared.protocol.philox import philox4x64_10, philox_rounds, stream_words_at, tensor_id
from seedfed.shared.protocol.vectors import PHILOX_KAT, compute_vectors
from seedfed.shared.protocol.wire import pack_binary, unpack_binary
from torch import nn


# -- Philox -------------------------------------------------------------------------------------
def _philox() -> dict[str, Any]:
    kat = [{"counter": [u64(c) for c in counter], "key": [u64(k) for k in key],
            "output": [u64(w) for w in out]} for counter, key, out in PHILOX_KAT]
    counter, key, _ = PHILOX_KAT[2]
    states = philox_rounds(counter, key)
    if states[-1] != philox4x64_10(counter, key):
        raise AssertionError("the round-by-round Philox disagrees with the reference")
    # The state after each round, so a port sees the first round where it goes wrong.
    return {"known_answers": kat,
            "rounds_of_known_answer_2": [{"rounds": r, "state": [u64(w) for w in st]}
                                         for r, st in enumerate(states)]}


# -- tensor ids, blocks, slices, masked sets ------------------------------------------------------
TENSOR_ID_NAMES: tuple[str, ...] = (
    "", "weight", "classifier.weight", "classifier.bias", "lm_head.weight",
    "model.embed_tokens.weight", "bert.pooler.dense.weight", "名前.ünïcode", "head.\U0001f600",
)
#: Blocks whose counter word crosses 32-bit boundaries (a port with 32-bit counter arithmetic
#: breaks at 2**32 - 1 -> 2**32) and the last block a tensor below 2**64 elements can reach.
BLOCKS: tuple[int, ...] = (0, 1, 2, 255, 256, (1 << 32) - 2, (1 << 32) - 1, 1 << 32,
                           (1 << 56) - 1)
BLOCK_CASES: tuple[tuple[int, str], ...] = ((0, "weight"), (2**64 - 1, "lm_head.weight"),
                                            (987654321, "head.\U0001f600"))
SLICE_CASES: tuple[tuple[int, str, int, int, int], ...] = (
    (7, "classifier.weight", 100_000, 250, 262),  # straddles blocks 0 and 1
    (7, "classifier.weight", 100_000, 1000, 1300),  # starts mid-block, spans two boundaries
    (2**53 - 1, "model.layers.3.mlp.up_proj.weight", 1 << 24, (1 << 24) - 70, 1 << 24),
)
MASKED_CASES: tuple[tuple[int, str, tuple[int, ...]], ...] = (
    (11, "model.layers.0.self_attn.q_proj.weight", (70000, 3, 255, 256, 99999, 3, 0)),
    (2**63 + 5, "layer.0.weight", (10**9, 0, 65536, 65535, 123456789)),
)


def _tensor_ids() -> list[dict[str, Any]]:
    return [{"name": n, "tensor_id": u64(tensor_id(n)), "at_least_2_63": tensor_id(n) >= 1 << 63}
            for n in TENSOR_ID_NAMES]


def _blocks() -> list[dict[str, Any]]:
    out = []
    for seed, name in BLOCK_CASES:
        words = stream_words_at(seed, tensor_id(name), np.array(BLOCKS, dtype=np.uint64))
        out.append({"seed": u64(seed), "name": name, "tensor_id": u64(tensor_id(name)),
                    "blocks": [{"block": u64(b), "words": [u64(int(w)) for w in row]}
                               for b, row in zip(BLOCKS, words, strict=True)]})
    return out


def _z(values: torch.Tensor) -> list[int]:
    return [int(v) for v in values.tolist()]


def _slices() -> list[dict[str, Any]]:
    return [{"seed": u64(seed), "name": name, "numel": numel, "start": start, "stop": stop,
             "z": _z(rademacher(seed, name, numel, start, stop))}
            for seed, name, numel, start, stop in SLICE_CASES]


def _masked() -> list[dict[str, Any]]:
    return [{"seed": u64(seed), "name": name, "indices": list(idx),
             "z": _z(rademacher_at(seed, name, np.array(idx, dtype=np.int64)))}
            for seed, name, idx in MASKED_CASES]


# -- the device's scalar and the coefficient rule --------------------------------------------------
#: (L+, L-, eps, one_sided, clip): two-sided, one-sided (L- is then L(theta)), clipped both ways.
GRADIENT_CASES: tuple[tuple[float, float, float, bool, float | None], ...] = (
    (0.6931471805599453, 0.6925, 1e-3, False, None),
    (0.6931471805599453, 0.6925, 1e-3, True, None),
    (2.5, 0.25, 1e-3, False, 100.0),
    (0.25, 2.5, 1e-3, True, 100.0),
    (1.0000001, 1.0, 1e-7, False, None),
)
#: (g as float32, lr, P): plain, a huge lr over many seeds, a rounding near a tie, a tiny product.
COEF_CASES: tuple[tuple[float, float, int], ...] = (
    (1.0, 1e-4, 1), (-0.37, 4.0, 64), (1e6, 1e-3, 3), (3.0000001, 0.1, 7), (1e-30, 1e-8, 1),
    (-12.5, 1e-3, 16),
)


def _gradients() -> list[dict[str, Any]]:
    return [{"loss_plus": lp, "loss_minus": lm, "eps": eps, "one_sided": one, "clip": clip,
             "g": f32(projected_gradient(lp, lm, eps, one, clip))}
            for lp, lm, eps, one, clip in GRADIENT_CASES]


def _coefficients() -> list[dict[str, Any]]:
    out = []
    for g, lr, p in COEF_CASES:
        g32 = float(np.float32(g))
        out.append({"g": f32(g32), "lr": lr, "perturbations": p,
                    "coef": f32(update_coefficient(g32, lr, p))})
    return out


# -- checksum and replay ---------------------------------------------------------------------------
def _exact_values(n: int, salt: int) -> torch.Tensor:
    """n float32 values that are exact binary fractions (so any reader gets the same bits)."""
    i = torch.arange(n, dtype=torch.float64)
    return (((i * 37 + salt) % 101 - 50) / 64).to(torch.float32)


def _checksums() -> list[dict[str, Any]]:
    cases: list[dict[str, torch.Tensor]] = [
        {},
        {"w": torch.tensor([1.0, -2.5, 0.0, -0.0], dtype=torch.float32)},
        {"b": torch.zeros(0, dtype=torch.float32),
         "a": torch.tensor([3.4028234663852886e38, 1e-45, -1.0], dtype=torch.float32)},
    ]
    return [{"state": {k: [f32(v) for v in t.tolist()] for k, t in sorted(s.items())},
             "checksum": state_checksum(s)} for s in cases]


#: A small state that exercises what ports get wrong: a tensor across a block boundary, names
#: whose code-point order differs from UTF-16 order ("head.\uff21" < "head.\U0001f600" by
#: code point, the other way round in UTF-16) and from case-insensitive order ("B" < "a"),
#: and a masked tensor held compactly (5 elements of a 100,000-element matrix).
REPLAY_TENSORS: tuple[tuple[str, int], ...] = (
    ("a.bias", 2), ("B.weight", 384), ("head.\uff21", 3), ("head.\U0001f600", 3),
)
MASKED_TENSOR = ("layer.0.weight", 100_000, (3, 17, 300, 4095, 70000))
#: The log: per entry (g per seed, as uploaded), seeds, lr, P.
REPLAY_LOG: tuple[tuple[tuple[int, ...], tuple[float, ...], float, int], ...] = (
    ((5, 2**53 - 1), (0.75, -1.5), 0.5, 2),
    ((123456789012345, 0, 42), (-3.25, 0.001, 1e4), 1e-3, 3),
    ((9007199254740990,), (-0.0625,), 8.0, 1),
)


def replay_scope() -> Scope:
    """The replay case's starting state as a Scope of the reference implementation."""
    tensors = [ScopedTensor(name, _exact_values(n, salt))
               for salt, (name, n) in enumerate(REPLAY_TENSORS)]
    name, numel, idx = MASKED_TENSOR
    tensors.append(ScopedTensor(name, _exact_values(len(idx), 99),
                                torch.tensor(idx, dtype=torch.int64), compact=True))
    return Scope(nn.Module(), tensors)


def _state(scope: Scope) -> dict[str, list[str]]:
    return {t.name: [f32(v) for v in t.values().tolist()] for t in scope}


def _replay() -> dict[str, Any]:
    scope = replay_scope()
    name, numel, idx = MASKED_TENSOR
    start = {"state": _state(scope), "canonical_order": scope.names,
             "masked": {name: {"numel": numel, "indices": list(idx)}},
             "checksum": checksum(scope)}
    entries = []
    for base, (seeds, g, lr, p) in enumerate(REPLAY_LOG):
        coefs = [update_coefficient(float(np.float32(v)), lr, p) for v in g]
        entry = LogEntry("conformance", base, seeds, tuple(coefs))
        apply_seeds(scope, entry.seeds, entry.coefs)
        entries.append({"base_version": base, "seeds": [u64(s) for s in seeds],
                        "g": [f32(v) for v in g], "lr": lr, "perturbations": p,
                        "coefs": [f32(c) for c in coefs], "checksum": checksum(scope)})
    return {"start": start, "log": entries, "final_state": _state(scope)}


# -- aggregation -----------------------------------------------------------------------------------
#: Five devices, three seeds; device 2 claims 200,000 examples and sends outliers. Capped only
#: at the default 100,000 (no ratio cap) it holds nearly all of the mean's weight; capped at the
#: round's median claim (the default max_weight_ratio 1: 35) it holds 35 of 160, and the
#: robust rules weigh every device 1. The four-device cases take the mean of the two middle
#: claims as the median (7, 9, 20, 100: 14.5) and show the median's exact tie.
AGG_G = ((0.5, -1.25, 2.0), (0.25, -1.0, 1.5), (40.0, -35.0, 90.0), (0.375, -0.75, 1.75),
         (0.5, -1.0, 2.25))
AGG_NUM_EXAMPLES = (40, 30, 200_000, 35, 25)
AGG_CASES: tuple[tuple[AggregationConfig, tuple[tuple[float, ...], ...], tuple[int, ...]],
                 ...] = (
    (AggregationConfig(rule="mean", max_weight_ratio=None), AGG_G, AGG_NUM_EXAMPLES),
    (AggregationConfig(rule="mean"), AGG_G, AGG_NUM_EXAMPLES),
    (AggregationConfig(rule="mean", max_num_examples=50, max_weight_ratio=None), AGG_G,
     AGG_NUM_EXAMPLES),
    (AggregationConfig(rule="mean", max_weight_ratio=2.5), AGG_G[:4], (7, 9, 20, 100)),
    (AggregationConfig(rule="clipped_mean", clip_bound=1.5), AGG_G, AGG_NUM_EXAMPLES),
    (AggregationConfig(rule="trimmed_mean", trim=0.2), AGG_G, AGG_NUM_EXAMPLES),
    (AggregationConfig(rule="median"), AGG_G, AGG_NUM_EXAMPLES),
    (AggregationConfig(rule="median"), AGG_G[:4], (9, 9, 9, 9)),
)
AGG_SEEDS = (17, 18, 19)
AGG_LR, AGG_P = 0.01, 3


def _aggregation() -> dict[str, Any]:
    out = []
    for config, rows, num_examples in AGG_CASES:
        g = np.array(rows, dtype=np.float32).astype(np.float64)
        w = round_weights(num_examples, config)
        agg = aggregate(g, w, config)
        entry = build_entry("conformance", 0, AGG_SEEDS, g, w, AGG_LR, AGG_P, config)
        out.append({"rule": config.rule, "clip_bound": config.clip_bound, "trim": config.trim,
                    "max_num_examples": config.max_num_examples,
                    "max_weight_ratio": config.max_weight_ratio,
                    "g": [[f32(v) for v in row] for row in rows],
                    "num_examples": list(num_examples), "weights": [float(v) for v in w],
                    "aggregate": [f64(v) for v in agg],
                    "coefs": [f32(c) for c in entry.coefs]})
    return {"seeds": [u64(s) for s in AGG_SEEDS], "lr": AGG_LR, "perturbations": AGG_P,
            "cases": out}


# -- the binary upload -----------------------------------------------------------------------------
def _refused(data: bytes) -> str:
    try:
        unpack_binary(data)
    except SeedfedError as e:
        return type(e).__name__
    raise AssertionError("the reference accepted a body the vectors list as invalid")


def _binary() -> dict[str, Any]:
    m = np.array([[0.5, -1.25, 3.0], [1e-3, 0.0, -0.0]], dtype=np.float32)
    good = pack_binary(m)
    assert np.array_equal(unpack_binary(good).view(np.uint32), m.view(np.uint32))
    bad: Sequence[tuple[str, bytes]] = (
        ("reserved header word is not 0", good[:12] + struct.pack("<I", 1) + good[16:]),
        ("wrong magic", b"SFS2" + good[4:]),
        ("one value short", good[:-4]),
        ("NaN scalar", good[:16] + struct.pack("<f", float("nan")) + good[20:]),
        ("zero rows", b"SFS1" + struct.pack("<III", 0, 3, 0)),
        ("above the wire bound 1e6", good[:16] + struct.pack("<f", 2e6) + good[20:]),
    )
    return {"scalars": [[f32(v) for v in row] for row in m.tolist()], "body": good.hex(),
            "invalid": [{"why": why, "body": b.hex(), "refused_with": _refused(b)}
                        for why, b in bad]}


def compute_conformance() -> dict[str, Any]:
    """Every section of the conformance file, as computed by this implementation."""
    return {"format": FORMAT, "philox": _philox(), "tensor_ids": _tensor_ids(),
            "blocks": _blocks(), "slices": _slices(), "masked": _masked(),
            "projected_gradients": _gradients(), "coefficients": _coefficients(),
            "checksums": _checksums(), "replay": _replay(), "aggregation": _aggregation(),
            "binary_upload": _binary(), "published": published_vectors(),
            "ternary": ternary_vectors()}


def all_vectors() -> dict[str, Any]:
    """What `seedfed protocol vectors --all` prints: the stream's first blocks and the kit."""
    return {"stream": compute_vectors(), **compute_conformance()}


def dumps(data: dict[str, Any]) -> str:
    """The file's text: one section per line, so a changed vector shows as a one-line diff."""
    lines = [f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in data.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


# python -m seedfed.shared.model.conformance PATH: rewrite the golden file
if __name__ == "__main__":
    import sys

    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write(dumps(compute_conformance()))
