"""The perturbation stream: z(seed, tensor name) in {-1, +1}, bit-identical on every platform.

Contract (docs/protocol.md, section 1, "The perturbation stream"):

- Philox4x64-10 keyed by (seed, tensor_id), tensor_id = first 8 bytes (little-endian) of
  SHA-256 of the tensor's canonical name in UTF-8.
- Block j of the stream is Philox at counter (j + 1, 0, 0, 0): four uint64 words.
- Element i takes bit (i mod 64) of word floor(i / 64); bit 0 -> +1, bit 1 -> -1.

Only integer arithmetic defines z, so no CPU vector path or library version can change it
(torch.randn and numpy's normal samplers differ between x86 and ARM). The fast path asks numpy's
Philox bit generator for raw words, which is exactly this stream; `philox4x64_10` is an
independent pure-Python implementation used to check it against the Random123 known answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

MASK64 = (1 << 64) - 1
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B

#: Elements covered by one Philox block (4 words x 64 bits).
BLOCK_ELEMENTS = 256
#: Elements expanded per chunk: 1 MiB of float32, small enough to stay in cache while every
#: seed of a log entry is added to it, large enough that Python overhead is noise.
CHUNK_ELEMENTS = 1 << 18
assert CHUNK_ELEMENTS % BLOCK_ELEMENTS == 0  # chunks start on block boundaries (_add_dense)
_MINUS_TWO, _ONE = np.int8(-2), np.int8(1)


def tensor_id(name: str) -> int:
    """First 8 bytes, little-endian, of SHA-256 of the canonical tensor name."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def philox4x64_10(counter: Sequence[int], key: Sequence[int]) -> tuple[int, int, int, int]:
    """One Philox4x64-10 block in pure Python (reference implementation, Random123 spec)."""
    c0, c1, c2, c3 = (int(v) & MASK64 for v in counter)
    k0, k1 = (int(v) & MASK64 for v in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & MASK64, (k1 + _W1) & MASK64
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & MASK64
    return c0, c1, c2, c3


def _key(seed: int, tid: int) -> np.ndarray:
    if not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be a uint64, got {seed}")
    return np.array([seed, tid], dtype=np.uint64)


def _stream_gen(seed: int, tid: int, first_block: int) -> np.random.Philox:
    """A numpy Philox whose next `random_raw` words are block `first_block` onwards."""
    # numpy's Philox increments its counter before each block, so starting it at `first_block`
    # yields the block at counter first_block + 1: exactly block `first_block` of our stream.
    counter = np.array([first_block, 0, 0, 0], dtype=np.uint64)
    return np.random.Philox(counter=counter, key=_key(seed, tid))


def stream_words(seed: int, tid: int, first_block: int, n_blocks: int) -> np.ndarray:
    """Words of blocks [first_block, first_block + n_blocks) as little-endian uint64."""
    return _stream_gen(seed, tid, first_block).random_raw(4 * n_blocks).astype("<u8", copy=False)


def _mulhilo(a: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 64-bit halves of a * b for a uint64 constant and a uint64 array."""
    m32 = np.uint64(0xFFFFFFFF)
    a_lo, a_hi = np.uint64(a & 0xFFFFFFFF), np.uint64(a >> 32)
    b_lo, b_hi = b & m32, b >> np.uint64(32)
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> np.uint64(32)) + (p1 & m32) + (p2 & m32)
    hi = p3 + (p1 >> np.uint64(32)) + (p2 >> np.uint64(32)) + (mid >> np.uint64(32))
    return hi, a * b  # uint64 arrays wrap, which is the low half


def stream_words_at(seed: int, tid: int, blocks: np.ndarray) -> np.ndarray:
    """Words of arbitrary blocks (any order, vectorized Philox): shape (len(blocks), 4)."""
    with np.errstate(over="ignore"):
        c0 = np.asarray(blocks, dtype=np.uint64) + np.uint64(1)
        c1 = np.zeros_like(c0)
        c2 = np.zeros_like(c0)
        c3 = np.zeros_like(c0)
        k0, k1 = seed & MASK64, tid & MASK64
        for r in range(10):
            if r:
                k0, k1 = (k0 + _W0) & MASK64, (k1 + _W1) & MASK64
            hi0, lo0 = _mulhilo(_M0, c0)
            hi1, lo1 = _mulhilo(_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return np.stack([c0, c1, c2, c3], axis=1)


@lru_cache(maxsize=1)
def _sign_table() -> torch.Tensor:
    """Row b holds the 8 signs of byte b, least significant bit first."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return (1 - 2 * bits).to(torch.float32)


def _expand(words: np.ndarray, scale: float, n: int) -> torch.Tensor:
    """scale * z for the first n elements the words cover (one table gather, exact)."""
    table = _sign_table() * scale  # +-scale: exact in float32 for a float32 scale
    idx = torch.from_numpy(words.view(np.uint8)).long()
    return torch.nn.functional.embedding(idx, table).view(-1)[:n]


def _signs_i8(words: np.ndarray) -> torch.Tensor:
    """z as int8 +1/-1 for every element the words cover (element i = bit i of the LE bytes).

    Cheaper than the float table gather of `_expand` (one SIMD unpack and two byte-wide passes
    instead of a gather of 32-byte rows), and an int8 operand costs the add less memory traffic;
    torch.add converts it to exactly +-1.0 in float32, so the sums are the same bits.
    """
    z = np.unpackbits(words.astype("<u8", copy=False).view(np.uint8), bitorder="little")
    z = z.view(np.int8)
    np.multiply(z, _MINUS_TWO, out=z)  # bit 0/1 -> 0/-2
    np.add(z, _ONE, out=z)  # -> +1/-1
    return torch.from_numpy(z)


def _add_dense(dst: torch.Tensor, src: torch.Tensor, tid: int, seeds: Sequence[int],
               scales: Sequence[float]) -> None:
    """dst = src + scale * z(seed) for each seed in order, over flat float32 tensors of one
    length (dst may be src). Each element sees exactly the additions of the naive loop."""
    n = dst.numel()
    if not seeds:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        return
    # One generator per seed for the whole tensor: every chunk but the last covers whole blocks
    # (CHUNK_ELEMENTS is a multiple of BLOCK_ELEMENTS), so each generator simply continues at
    # the next chunk's first block. Building a numpy Philox costs as much as a chunk's words.
    gens = [_stream_gen(seed, tid, 0) for seed in seeds]
    for start in range(0, n, CHUNK_ELEMENTS):
        stop = min(n, start + CHUNK_ELEMENTS)
        out, inp = dst[start:stop], src[start:stop]
        n_blocks = -(-(stop - start) // BLOCK_ELEMENTS)
        for gen, c in zip(gens, scales, strict=True):
            z = _signs_i8(gen.random_raw(4 * n_blocks))[: stop - start]
            # c * z is exact for z = +-1 (FMA or not), so this is one IEEE addition per element.
            torch.add(inp, z, alpha=c, out=out)
            inp = out


def perturbed(x: torch.Tensor, name: str, seed: int, scale: float) -> torch.Tensor:
    """A new float32 tensor x + scale * z(seed, name): the bits `add_seeds_` would give on a
    copy, written in one pass instead of a clone followed by an in-place add."""
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: perturbation needs a float32 tensor, got {x.dtype}")
    src = x.detach().contiguous()
    out = torch.empty_like(src)
    _add_dense(out.view(-1), src.view(-1), tensor_id(name), [seed], [float(np.float32(scale))])
    return out


def perturbed_pair(x: torch.Tensor, name: str, seed: int, scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + scale z, x - scale z) with z generated once: each the bits of `perturbed`
    (the two-point probes of one seed need both; the stream is the costly part)."""
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: perturbation needs a float32 tensor, got {x.dtype}")
    src = x.detach().contiguous()
    plus, minus = torch.empty_like(src), torch.empty_like(src)
    flat, fp, fm = src.view(-1), plus.view(-1), minus.view(-1)
    c = float(np.float32(scale))
    gen = _stream_gen(seed, tensor_id(name), 0)
    n = flat.numel()
    for start in range(0, n, CHUNK_ELEMENTS):  # the chunking of `_add_dense`, one seed
        stop = min(n, start + CHUNK_ELEMENTS)
        z = _signs_i8(gen.random_raw(4 * -(-(stop - start) // BLOCK_ELEMENTS)))[: stop - start]
        torch.add(flat[start:stop], z, alpha=c, out=fp[start:stop])
        torch.add(flat[start:stop], z, alpha=-c, out=fm[start:stop])
    return plus, minus


def _check_range(numel: int, start: int, stop: int) -> None:
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"slice [{start}, {stop}) is outside a tensor of {numel} elements")


def rademacher(seed: int, name: str, numel: int, start: int = 0, stop: int | None = None,
               scale: float = 1.0) -> torch.Tensor:
    """scale * z[start:stop] as float32; only the blocks the slice touches are generated."""
    stop = numel if stop is None else stop
    _check_range(numel, start, stop)
    first, last = start // BLOCK_ELEMENTS, -(-stop // BLOCK_ELEMENTS)
    words = stream_words(seed, tensor_id(name), first, last - first)
    offset = start - first * BLOCK_ELEMENTS
    return _expand(words, float(np.float32(scale)), offset + stop - start)[offset:].clone()


def rademacher_at(seed: int, name: str, indices: torch.Tensor | np.ndarray,
                  scale: float = 1.0) -> torch.Tensor:
    """scale * z at the given flat element indices, costing only the blocks they touch."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return torch.zeros(0, dtype=torch.float32)
    if idx.min() < 0:
        raise ValueError(f"negative element index {int(idx.min())}")
    blocks, inverse = np.unique(idx // BLOCK_ELEMENTS, return_inverse=True)
    span = int(blocks[-1] - blocks[0] + 1)
    if span <= 4 * len(blocks):  # dense enough: one contiguous run is cheaper
        words = stream_words(seed, tensor_id(name), int(blocks[0]), span).reshape(span, 4)
        words = words[blocks - blocks[0]]
    else:
        words = stream_words_at(seed, tensor_id(name), blocks)
    bit = idx % BLOCK_ELEMENTS
    word = words[inverse, bit // 64]
    signs = ((word >> (bit % 64).astype(np.uint64)) & np.uint64(1)).astype(np.float32)
    return torch.from_numpy(np.float32(scale) * (np.float32(1.0) - np.float32(2.0) * signs))


def rademacher_rows(seed: int, name: str, row_len: int, rows: torch.Tensor | np.ndarray,
                    scale: float = 1.0) -> torch.Tensor:
    """scale * z of whole rows of a row-major (n_rows, row_len) tensor: shape (len(rows), row_len).

    Costs only the blocks the rows touch (an embedding lookup needs the rows of the batch's
    tokens, not the whole vocabulary); element (r, j) is element r * row_len + j of the stream.
    """
    r = np.asarray(rows, dtype=np.int64).reshape(-1)
    if row_len < 1:
        raise ValueError(f"row length must be >= 1, got {row_len}")
    if r.size == 0:
        return torch.zeros((0, row_len), dtype=torch.float32)
    if r.min() < 0:
        raise ValueError(f"negative row index {int(r.min())}")
    starts = r * row_len
    first = starts // BLOCK_ELEMENTS
    span = -(-row_len // BLOCK_ELEMENTS) + 1  # blocks a row can touch when it starts mid-block
    blocks = first[:, None] + np.arange(span, dtype=np.int64)
    words = stream_words_at(seed, tensor_id(name), blocks.reshape(-1)).astype("<u8", copy=False)
    bits = np.unpackbits(words.view(np.uint8).reshape(r.size, -1), axis=1, bitorder="little")
    cols = (starts - first * BLOCK_ELEMENTS)[:, None] + np.arange(row_len, dtype=np.int64)
    signs = np.take_along_axis(bits, cols, axis=1).astype(np.float32)
    return torch.from_numpy(np.float32(scale) * (np.float32(1.0) - np.float32(2.0) * signs))


def add_seeds_(x: torch.Tensor, name: str, seeds: Sequence[int], coefs: Sequence[float],
               indices: torch.Tensor | None = None, compact: bool = False) -> None:
    """x += coef * z(seed, name) for each (seed, coef) in order, in place, bit-exact.

    `x` is a float32 tensor (any shape, contiguous); with `indices` only those flat elements
    move; with `compact` too, `x` holds only those elements (in `indices` order) and element j
    takes z at indices[j]: the same additions, so the same bits. Work runs chunk by chunk with
    every seed applied to a chunk while it is in cache; each element still sees its additions
    in plan order, so the bits equal the naive loop.
    """
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise TypeError(f"{name}: replay needs a contiguous float32 tensor, got {x.dtype}")
    if len(seeds) != len(coefs):
        raise ValueError(f"{len(seeds)} seeds but {len(coefs)} coefficients")
    flat = x.view(-1)
    scales = [float(np.float32(c)) for c in coefs]
    tid = tensor_id(name)
    if indices is not None:
        if compact and indices.numel() != flat.numel():
            raise ValueError(f"{name}: compact tensor of {flat.numel()} elements, "
                             f"{indices.numel()} indices")
        for seed, c in zip(seeds, scales, strict=True):
            if compact:
                flat.add_(rademacher_at(seed, name, indices, c))
            else:
                flat.index_add_(0, indices, rademacher_at(seed, name, indices, c))
        return
    _add_dense(flat, flat, tid, seeds, scales)
