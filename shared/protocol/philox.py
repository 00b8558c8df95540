"""The perturbation stream in numpy alone: what a device without torch needs of `stream.py`.

The contract is `stream.py`'s (docs/protocol.md, section 1): z(seed, name) in {-1, +1} is bit
(i mod 64) of word i // 64 of Philox4x64-10 keyed by (seed, tensor_id(name)) at counter
(j + 1, 0, 0, 0). This module holds the integer part of it (tensor ids, raw words, the sign
unpacking) and the numpy form of the replay addition, so `stream.py` (torch) and an inference-
engine device (`seedfed.client.backends.ort`: numpy, ORT) share one definition of every bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

MASK64 = (1 << 64) - 1
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B

#: Elements covered by one Philox block (4 words x 64 bits).
BLOCK_ELEMENTS = 256
#: Elements expanded per chunk: 1 MiB of float32, small enough to stay in cache while every
#: seed of a log entry is added to it, large enough that Python overhead is noise.
CHUNK_ELEMENTS = 1 << 18
assert CHUNK_ELEMENTS % BLOCK_ELEMENTS == 0  # chunks start on block boundaries (add_dense)
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


def philox_rounds(counter: Sequence[int], key: Sequence[int],
                  ) -> list[tuple[int, int, int, int]]:
    """The Philox4x64 state after 0, 1, ..., 10 rounds, for a port to find the first round it
    gets wrong (the conformance kit); the last is `philox4x64_10`'s output. A loop of its own,
    so the kit's check of one against the other compares two implementations."""
    c0, c1, c2, c3 = (int(v) & MASK64 for v in counter)
    k0, k1 = (int(v) & MASK64 for v in key)
    out = [(c0, c1, c2, c3)]
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & MASK64, (k1 + _W1) & MASK64
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & MASK64
        out.append((c0, c1, c2, c3))
    return out


def _key(seed: int, tid: int) -> np.ndarray:
    if not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be a uint64, got {seed}")
    return np.array([seed, tid], dtype=np.uint64)


def stream_gen(seed: int, tid: int, first_block: int) -> np.random.Philox:
    """A numpy Philox whose next `random_raw` words are block `first_block` onwards."""
    # numpy's Philox increments its counter before each block, so starting it at `first_block`
    # yields the block at counter first_block + 1: exactly block `first_block` of our stream.
    counter = np.array([first_block, 0, 0, 0], dtype=np.uint64)
    return np.random.Philox(counter=counter, key=_key(seed, tid))


def stream_words(seed: int, tid: int, first_block: int, n_blocks: int) -> np.ndarray:
    """Words of blocks [first_block, first_block + n_blocks) as little-endian uint64."""
    return stream_gen(seed, tid, first_block).random_raw(4 * n_blocks).astype("<u8", copy=False)


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


def signs_i8(words: np.ndarray) -> np.ndarray:
    """z as int8 +1/-1 for every element the words cover (element i = bit i of the LE bytes)."""
    z = np.unpackbits(words.astype("<u8", copy=False).view(np.uint8), bitorder="little")
    z = z.view(np.int8)
    np.multiply(z, _MINUS_TWO, out=z)  # bit 0/1 -> 0/-2
    np.add(z, _ONE, out=z)  # -> +1/-1
    return z


def signs(seed: int, name: str, numel: int) -> np.ndarray:
    """z(seed, name) of a whole tensor of `numel` elements, as float32 +-1."""
    n_blocks = -(-numel // BLOCK_ELEMENTS)
    return signs_i8(stream_words(seed, tensor_id(name), 0, n_blocks))[:numel].astype(np.float32)


def signs_at(seed: int, name: str, indices: np.ndarray) -> np.ndarray:
    """z(seed, name) at the given flat element indices, as float32 +-1, costing only the
    blocks they touch."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return np.zeros(0, dtype=np.float32)
    if idx.min() < 0:
        raise ValueError(f"negative element index {int(idx.min())}")
    tid = tensor_id(name)
    blocks, inverse = np.unique(idx // BLOCK_ELEMENTS, return_inverse=True)
    span = int(blocks[-1] - blocks[0] + 1)
    if span <= 4 * len(blocks):  # dense enough: one contiguous run is cheaper
        words = stream_words(seed, tid, int(blocks[0]), span).reshape(span, 4)
        words = words[blocks - blocks[0]]
    else:
        words = stream_words_at(seed, tid, blocks)
    bit = idx % BLOCK_ELEMENTS
    word = words[inverse, bit // 64]
    bits = ((word >> (bit % 64).astype(np.uint64)) & np.uint64(1)).astype(np.float32)
    return np.float32(1.0) - np.float32(2.0) * bits


def add_dense(flat: np.ndarray, name: str, seeds: Sequence[int], scales: Sequence[float],
              out: np.ndarray | None = None) -> np.ndarray:
    """out = flat + scale * z(seed, name) for each (seed, scale) in order, over flat float32
    arrays (out may be flat: in place; None: a new array). The bits of `stream.add_seeds_`:
    scale * z is exact for z = +-1, so every element sees one IEEE float32 addition per seed,
    in plan order, chunk by chunk as the torch path runs it."""
    if flat.dtype != np.float32 or flat.ndim != 1:
        raise TypeError(f"{name}: the stream adds to flat float32 arrays, got {flat.dtype} "
                        f"of shape {flat.shape}")
    if out is None:
        out = flat.copy()
    elif out is not flat:
        np.copyto(out, flat)
    n = out.size
    tid = tensor_id(name)
    # One generator per seed for the whole tensor: every chunk but the last covers whole
    # blocks, so each generator continues at the next chunk's first block.
    gens = [stream_gen(seed, tid, 0) for seed in seeds]
    c32 = [np.float32(c) for c in scales]
    for start in range(0, n, CHUNK_ELEMENTS):
        stop = min(n, start + CHUNK_ELEMENTS)
        part = out[start:stop]
        n_blocks = -(-(stop - start) // BLOCK_ELEMENTS)
        for gen, c in zip(gens, c32, strict=True):
            z = signs_i8(gen.random_raw(4 * n_blocks))[: stop - start]
            np.add(part, np.multiply(z, c, dtype=np.float32), out=part)
    return out
