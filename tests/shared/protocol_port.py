"""A port of the seedfed protocol written from docs/protocol.md alone, as a device in another
language would be: pure Python (hashlib, struct, math, fractions, json), no numpy, no torch, no
seedfed import.

It exists to prove the document is enough: `test_protocol_port.py` runs it on the inputs of
`shared/protocol/golden/conformance.json` and compares every output. Where this file needs a rule
the document does not state, the document is what must change. Slow by design (one Philox block per
256 elements, in Python); the vectors are small.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence

MASK = (1 << 64) - 1
M0, M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
W0, W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B


# -- section 1: the stream -----------------------------------------------------------------------
def tensor_id(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def philox(counter: Sequence[int], key: Sequence[int], rounds: int = 10,
           ) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r > 0:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p2 = M0 * c0, M1 * c2  # 128-bit products: mulhi = >> 64, mullo = & MASK
        c0, c1, c2, c3 = (p2 >> 64) ^ c1 ^ k0, p2 & MASK, (p0 >> 64) ^ c3 ^ k1, p0 & MASK
    return c0, c1, c2, c3


def block(seed: int, tid: int, j: int) -> tuple[int, int, int, int]:
    return philox((j + 1, 0, 0, 0), (seed, tid))


class Stream:
    """z(seed, name) element by element, one cached block at a time."""

    def __init__(self, seed: int, name: str) -> None:
        self.seed, self.tid = seed, tensor_id(name)
        self._j, self._words = -1, (0, 0, 0, 0)

    def z(self, i: int) -> int:
        j = i // 256
        if j != self._j:
            self._j, self._words = j, block(self.seed, self.tid, j)
        word = self._words[(i % 256) // 64]
        return -1 if (word >> (i % 64)) & 1 else 1


def z_slice(seed: int, name: str, start: int, stop: int) -> list[int]:
    s = Stream(seed, name)
    return [s.z(i) for i in range(start, stop)]


def z_at(seed: int, name: str, indices: Sequence[int]) -> list[int]:
    s = Stream(seed, name)
    return [s.z(i) for i in indices]


# -- float32 without a float32 type (section 2) ---------------------------------------------------
def f32(x: float) -> float:
    """Round a float64 to the nearest float32 (ties to even), as a Python float."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def bits32(x: float) -> str:
    return struct.pack(">f", x).hex()


def from_bits32(h: str) -> float:
    return float(struct.unpack(">f", bytes.fromhex(h))[0])


def bits64(x: float) -> str:
    return struct.pack(">d", x).hex()


# -- sections 7 and 2: the device's scalar, the coefficient ----------------------------------------
def projected_gradient(lp: float, lm: float, eps: float, one_sided: bool,
                       clip: float | None) -> float:
    g = (lp - lm) / (eps if one_sided else 2 * eps)
    if clip is not None:
        g = min(max(g, -clip), clip)
    return f32(g)


def coefficient(g: float, lr: float, p: int) -> float:
    return f32(-(lr / p) * g)


# -- section 3: checksum -------------------------------------------------------------------------
def canonical(names: Sequence[str]) -> list[str]:
    return sorted(names, key=lambda n: n.encode("utf-8"))  # code point order = UTF-8 bytes


def checksum(state: Mapping[str, Sequence[float]]) -> str:
    h = hashlib.sha256()
    for name in canonical(list(state)):
        values = state[name]
        h.update(name.encode("utf-8") + b"\0" + struct.pack("<Q", len(values)))
        h.update(b"".join(struct.pack("<f", v) for v in values))
    return h.hexdigest()


# -- section 2: replay ---------------------------------------------------------------------------
def apply_entry(state: dict[str, list[float]], masks: Mapping[str, Sequence[int]],
                seeds: Sequence[int], coefs: Sequence[float]) -> None:
    """x = float32(x + coef * z) per covered element, seed by seed in order. A masked tensor
    holds its masked elements only; element k takes z at masks[name][k]."""
    for seed, c in zip(seeds, coefs, strict=True):
        for name in canonical(list(state)):
            values = state[name]
            s = Stream(seed, name)
            where = masks.get(name, range(len(values)))
            for k, i in enumerate(where):
                values[k] = f32(values[k] + c * s.z(i))


# -- section 4: aggregation ----------------------------------------------------------------------
def _sorted_column(col: Sequence[float], w: Sequence[float],
                   ) -> tuple[list[float], list[float], list[float]]:
    order = sorted(range(len(col)), key=lambda i: col[i])
    vals, ws = [col[i] for i in order], [w[i] for i in order]
    cum, run = [], 0.0
    for x in ws:
        run += x
        cum.append(run)
    return vals, ws, cum


def weights(num_examples: Sequence[int], rule: str, cap: int, ratio: float | None
            ) -> list[float]:
    """Section 4's weights: 1 for trimmed_mean and median; else min(n, cap), at most
    ratio x the median of those (the mean of the two middle ones for an even count)."""
    if rule in ("trimmed_mean", "median"):
        return [1.0] * len(num_examples)
    w = [float(min(n, cap)) for n in num_examples]
    if ratio is None:
        return w
    s, k = sorted(w), len(w)
    mid = s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2
    return [min(x, ratio * mid) for x in w]


def aggregate(g: Sequence[Sequence[float]], num_examples: Sequence[int], rule: str,
              clip_bound: float, trim: float, cap: int, ratio: float | None) -> list[float]:
    w = weights(num_examples, rule, cap, ratio)
    out = []
    for s in range(len(g[0])):
        col = [row[s] for row in g]
        if rule == "clipped_mean":
            col = [min(max(v, -clip_bound), clip_bound) for v in col]
        if rule in ("mean", "clipped_mean"):
            out.append(math.fsum(v * x for v, x in zip(col, w, strict=True)) / math.fsum(w))
            continue
        vals, ws, cum = _sorted_column(col, w)
        total = cum[-1]
        if rule == "trimmed_mean":
            lo, hi = trim * total, (1 - trim) * total
            kept = [max(0.0, min(c, hi) - max(c - x, lo)) for c, x in zip(cum, ws, strict=True)]
            out.append(math.fsum(v * k for v, k in zip(vals, kept, strict=True)) / (hi - lo))
        elif rule == "median":
            i = next(i for i, c in enumerate(cum) if 2 * c >= total)
            tie = 2 * cum[i] == total and i + 1 < len(vals)
            out.append((vals[i] + vals[i + 1]) / 2 if tie else vals[i])
        else:
            raise ValueError(f"unknown rule {rule}")
    return out


# -- section 4: the binary upload ----------------------------------------------------------------
def pack(m: Sequence[Sequence[float]]) -> bytes:
    rows, cols = len(m), len(m[0])
    return (b"SFS1" + struct.pack("<III", rows, cols, 0)
            + b"".join(struct.pack("<f", v) for row in m for v in row))


def unpack(data: bytes) -> list[list[float]]:
    """The matrix, or ValueError for a body a reader must refuse."""
    if len(data) < 16 or data[:4] != b"SFS1":
        raise ValueError("not an SFS1 body")
    rows, cols, reserved = struct.unpack_from("<III", data, 4)
    if reserved != 0:
        raise ValueError("reserved word is not 0")
    if not (1 <= rows <= 65536 and 1 <= cols <= 65536):
        raise ValueError("bad shape")
    if len(data) != 16 + 4 * rows * cols:
        raise ValueError("wrong length")
    flat = list(struct.unpack_from(f"<{rows * cols}f", data, 16))
    if any(not math.isfinite(v) or abs(v) > 1e6 for v in flat):
        raise ValueError("non-finite or out-of-range scalar")
    return [flat[r * cols:(r + 1) * cols] for r in range(rows)]


# -- section 6: the published snapshot formats -----------------------------------------------------
def round_half_even(x: float) -> int:
    return round(x)  # Python's round() of a float is to the nearest integer, ties to even


def f16_bits(x: float) -> str:
    """IEEE binary16 of a float32 value, to nearest, ties to even (struct's 'e' rounds so)."""
    return struct.pack(">e", x).hex()


def bf16_bits(x: float) -> str:
    bits = struct.unpack(">I", struct.pack(">f", x))[0]
    return f"{((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF:04x}"


def quantize_group_rows(rows: Sequence[Sequence[float]], bits: int, group: int,
                        ) -> tuple[list[list[int]], list[list[float]]]:
    """Codes (padded to whole groups) and float32 scales of a matrix, per row and group."""
    qmax = 127 if bits == 8 else 7
    width = -(-len(rows[0]) // group) * group
    codes, scales = [], []
    for row in rows:
        padded = list(row) + [0.0] * (width - len(row))
        crow, srow = [], []
        for g in range(0, width, group):
            part = padded[g:g + group]
            top = max(abs(v) for v in part)
            s = f32(top / qmax) if top > 0 else 1.0
            crow += [max(-qmax, min(qmax, round_half_even(f32(v / s)))) for v in part]
            srow.append(s)
        codes.append(crow)
        scales.append(srow)
    return codes, scales


def pack_nibbles(codes: Sequence[int]) -> list[int]:
    return [(codes[k] + 8) | ((codes[k + 1] + 8) << 4) for k in range(0, len(codes), 2)]


def unpack_nibbles(data: Sequence[int]) -> list[int]:
    return [c for b in data for c in ((b & 0x0F) - 8, (b >> 4) - 8)]


def dequantize_rows(codes: Sequence[Sequence[int]], scales: Sequence[Sequence[float]],
                    width: int, group: int) -> list[float]:
    return [f32(row[c] * srow[c // group]) for row, srow in zip(codes, scales, strict=True)
            for c in range(width)]


# -- sections 5 and 6: ternary layers -------------------------------------------------------------
def ternary_gamma(latents: Sequence[float]) -> float:
    from fractions import Fraction

    exact = sum((Fraction(abs(w)) for w in latents), Fraction(0)) / len(latents)
    return f32(max(float(exact), 1e-5))  # exact mean, then float64, then float32


def ternarize(w: float, gamma: float) -> int:
    return max(-1, min(1, round_half_even(f32(w / gamma))))


def pack_ternary(q: Sequence[int]) -> list[int]:
    codes = [v + 1 for v in q] + [1] * (-len(q) % 4)
    return [codes[i] | codes[i + 1] << 2 | codes[i + 2] << 4 | codes[i + 3] << 6
            for i in range(0, len(codes), 4)]


def unpack_ternary(data: Sequence[int], n: int) -> list[int]:
    codes = [(b >> (2 * j)) & 3 for b in data for j in range(4)][:n]
    if 3 in codes:
        raise ValueError("invalid ternary code 3")
    return [c - 1 for c in codes]


def threshold_mask(latents: Sequence[float], gamma: float, fraction: float) -> list[int]:
    d = [abs(f32(f32(abs(w) / gamma) - 0.5)) for w in latents]
    k = min(len(d), max(1, math.ceil(fraction * len(d))))
    return sorted(sorted(range(len(d)), key=lambda i: (d[i], i))[:k])


def quantize_activations(row: Sequence[float], bits: int = 8) -> list[float]:
    qmax = 2 ** (bits - 1) - 1
    s = f32(qmax * f32(1 / max(max(abs(v) for v in row), f32(1e-5))))  # reciprocal, product
    return [f32(max(-qmax - 1, min(qmax, round_half_even(f32(v * s)))) / s) for v in row]


# -- section 6: the snapshot file ------------------------------------------------------------------
DTYPE_FORMATS = {"F32": "f", "F16": "e", "I8": "b", "U8": "B", "I32": "i"}


def read_safetensors(data: bytes) -> tuple[dict[str, tuple[str, list[int], list[float]]],
                                           dict[str, str]]:
    """name -> (dtype, shape, values) and the metadata of a safetensors file."""
    import json

    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        code = DTYPE_FORMATS[t["dtype"]]
        count = (end - begin) // struct.calcsize(code)
        out[name] = (t["dtype"], t["shape"],
                     list(struct.unpack_from(f"<{count}{code}", data, base + begin)))
    return out, meta
