"""The perturbation stream in torch integer ops: the same bits as the C kernel on any device.

The contract is `stream.py`'s (docs/protocol.md, section 1): block j of the stream of (seed,
tensor id) is Philox4x64-10 at counter (j + 1, 0, 0, 0) with key (seed, tid); element i is bit
(i mod 64) of word i // 64, bit 0 -> +1, bit 1 -> -1. The C kernel and numpy run it on the
host; this module runs it where the tensor lives (a GPU, or the CPU when forced with
SEEDFED_STREAM=torch, which is how CI proves on a CPU that this path has the kernel's bits).

Why it is exact everywhere: torch has no uint64 arithmetic on most ops, so a stream word is held
as the int64 with the same 64 bits. XOR, AND and shifts act on bits; + and * on int64 wrap
modulo 2**64 on CPU and CUDA (two's complement), which is uint64 arithmetic on the same bits
(tests/shared/model/test_torch_philox.py pins this on every device it runs on, at the seeds, tensor
ids and counters whose top bits are set).
The one thing int64 cannot give is the high half of a 64 x 64 -> 128-bit product (Philox's
mulhi): `_mulhilo` builds it from 32-bit halves, as schoolbook multiplication with explicit
masks after every arithmetic right shift (>> on int64 copies the sign bit, which a logical
shift would not). Nothing here touches floating point until z is expanded, and then only
+-scale, exactly, so every device expands the same z and adds it with one IEEE float32
addition per element and seed (`add_dense`: torch.add of an exact +-c, never a fused sum).

Work on a device is shaped for few kernel launches: all seeds of a call share one Philox
evaluation (their keys broadcast against the blocks), and z is expanded by one gather of a
(256, 8) sign table per seed, indexed by the words' bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torch.nn import functional as F

BLOCK_ELEMENTS = 256
MASK64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B
#: Chunks of a tensor the additions visit in turn: at most CHUNK elements, and at most PASS
#: element-seeds per Philox evaluation (every seed's words of a chunk at once; each temporary
#: of the evaluation is 8 bytes per 256 element-seeds). On one CPU thread, 16 seeds over 2**22
#: elements ran at about 200, 390 and 560 M element-seeds/s with passes of 2**20, 2**22 and
#: 2**24 (each op's dispatch amortized over more blocks); on a GPU each of the evaluation's ~400
#: ops is a kernel launch, so passes are larger still (32 MiB temporaries).
CPU_CHUNK_ELEMENTS, CPU_PASS_ELEMENTS = 1 << 20, 1 << 24
DEVICE_CHUNK_ELEMENTS, DEVICE_PASS_ELEMENTS = 1 << 24, 1 << 30

Int = int | torch.Tensor  # a uint64 as a Python int, or a tensor of their int64 bit patterns


def s64(v: int) -> int:
    """The int64 with the bits of uint64 `v` (what torch stores for it)."""
    v &= MASK64
    return v - (1 << 64) if v >> 63 else v


def u64(v: int) -> int:
    """The uint64 whose bits int64 `v` holds (the inverse of `s64`)."""
    return v & MASK64


def _check_seed(seed: int) -> None:
    if not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be a uint64, got {seed}")


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 64-bit halves of a * b, `a` a uint64 constant, `b` int64 bit patterns.

    The low half is int64 multiplication itself (it wraps modulo 2**64). The high half is
    schoolbook multiplication of 32-bit halves: each partial product and each partial sum
    below is under 2**64, so as int64 it may wrap negative, which is why every `>> 32` is
    masked back to the 32 bits a logical shift gives. In-place ops keep temporaries few (an
    allocation per op cost more than the op on the CPU)."""
    a_lo, a_hi = a & _M32, a >> 32
    b_lo = b & _M32
    b_hi = (b >> 32).bitwise_and_(_M32)
    t = (b_lo * a_lo).bitwise_right_shift_(32).bitwise_and_(_M32)  # carry out of the low half
    t.add_(b_hi * a_lo)  # a_lo b_hi + carry < 2**64
    u = (t & _M32).add_(b_lo.mul_(a_hi))  # a_hi b_lo + low half of t < 2**64
    hi = b_hi.mul_(a_hi)
    hi.add_(t.bitwise_right_shift_(32).bitwise_and_(_M32))
    hi.add_(u.bitwise_right_shift_(32).bitwise_and_(_M32))
    return hi, b * s64(a)


def philox(counter: Sequence[torch.Tensor], k0: Int, k1: Int, rounds: int = 10,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x64 (`rounds` rounds; 10 is the stream's) of four counter words, int64 bit
    patterns of any broadcastable shapes, under key (k0, k1): uint64 ints or int64 tensors
    (one row per seed evaluates many keys at once). The Random123 round as `philox.py` has it:
    bump the key between rounds, then (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2),
    hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))."""
    c0, c1, c2, c3 = counter
    k0 = k0 if isinstance(k0, torch.Tensor) else s64(k0)
    k1 = k1 if isinstance(k1, torch.Tensor) else s64(k1)
    for r in range(rounds):
        k0r, k1r = _bump(k0, r * _W0), _bump(k1, r * _W1)  # the key schedule
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        n0 = torch.bitwise_xor(hi1, k0r)  # out of place: a key row may widen the shape
        n0 ^= c1
        n2 = torch.bitwise_xor(hi0, k1r)
        n2 ^= c3
        c0, c1, c2, c3 = n0, lo1, n2, lo0
    return c0, c1, c2, c3


def philox_blocks(k0: Int, k1: Int, blocks: torch.Tensor) -> torch.Tensor:
    """The words of stream blocks: Philox4x64-10 at counters (blocks + 1, carry, 0, 0), keys
    (k0, k1), shape (*, 4). `blocks` holds block numbers as int64 bit patterns (any shape
    broadcasting with the keys). The counter's first word wraps at 2**64 into the second, as
    numpy's Philox and the C kernel carry it."""
    c0 = blocks + 1
    carry = (c0 == 0).to(torch.int64)
    zero = torch.zeros_like(c0)
    out = torch.broadcast_tensors(*philox((c0, carry, zero, zero), k0, k1))
    return torch.stack(out, dim=-1)


def _bump(k: int | torch.Tensor, v: int) -> int | torch.Tensor:
    """k + v modulo 2**64 (int64 tensors wrap by themselves; Python ints do not)."""
    return k + s64(v) if isinstance(k, torch.Tensor) else s64(k + v)


def _seed_keys(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    for seed in seeds:
        _check_seed(seed)
    return torch.tensor([s64(s) for s in seeds], dtype=torch.int64, device=device)


def _blocks(first_block: int, n_blocks: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n_blocks, dtype=torch.int64, device=device) + s64(first_block)


def words(seed: int, tid: int, first_block: int, n_blocks: int,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """Words of blocks [first_block, first_block + n_blocks) in stream order, as int64 bit
    patterns on `device`: the C kernel's `words` (`.view(np.uint64)` of its numpy copy)."""
    _check_seed(seed)
    blocks = _blocks(first_block, n_blocks, torch.device(device))
    return philox_blocks(seed, tid, blocks).reshape(-1)


def seeds_words(seeds: Sequence[int], tid: int, first_block: int, n_blocks: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """`words` of every seed in one evaluation: shape (len(seeds), 4 * n_blocks)."""
    dev = torch.device(device)
    keys = _seed_keys(seeds, dev).unsqueeze(1)
    out = philox_blocks(keys, tid, _blocks(first_block, n_blocks, dev).unsqueeze(0))
    return out.reshape(len(seeds), 4 * n_blocks)


def words_at(seed: int, tid: int, blocks: torch.Tensor) -> torch.Tensor:
    """Words of arbitrary blocks (int64 bit patterns, any order) on their device: (n, 4)."""
    _check_seed(seed)
    return philox_blocks(seed, tid, blocks.reshape(-1).to(torch.int64))


@lru_cache(maxsize=8)
def _sign_table(device: torch.device) -> torch.Tensor:
    """Row b holds z of the 8 elements byte b covers (least significant bit first), +-1.0."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return (1 - 2 * bits).to(torch.float32).to(device)


@lru_cache(maxsize=8)
def _byte_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 64, 8, dtype=torch.int64, device=device)


def _bytes(w: torch.Tensor) -> torch.Tensor:
    """The bytes of each word, least significant first (int64 in [0, 256)): (..., 8 * W).
    Shifts rather than a uint8 view, so the order is the little-endian contract on any host."""
    return ((w.unsqueeze(-1) >> _byte_shifts(w.device)) & 0xFF).flatten(-2)


def expand(w: torch.Tensor, scales: torch.Tensor | float, n: int, offset: int = 0,
           ) -> torch.Tensor:
    """scale * z of elements [offset, offset + n) of the words' span, float32 on their device.

    `w`: (W,) words, or (S, W) with `scales` S float32 scales (one row each; a float: all).
    +-scale is exact (a sign flip of a float32), so this is z scaled with no rounding."""
    table = _sign_table(w.device)
    if w.dim() == 1:  # a one-element tensor broadcasts too: no host sync to read it
        rows = table * (scales.to(w.device) if isinstance(scales, torch.Tensor) else scales)
        return F.embedding(_bytes(w), rows).reshape(-1)[offset:offset + n]
    s = w.shape[0]
    if not isinstance(scales, torch.Tensor):
        scales = torch.full((s,), scales, dtype=torch.float32)
    rows = table.unsqueeze(0) * scales.to(w.device, torch.float32).view(s, 1, 1)
    idx = _bytes(w) + 256 * torch.arange(s, device=w.device).unsqueeze(1)
    return F.embedding(idx, rows.reshape(256 * s, 8)).reshape(s, -1)[:, offset:offset + n]


def signs(seed: int, tid: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """z of a whole tensor of `numel` elements as float32 +-1 on `device`."""
    n_blocks = -(-numel // BLOCK_ELEMENTS)
    return expand(words(seed, tid, 0, n_blocks, device), 1.0, numel)


def z_at(seed: int, tid: int, indices: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * z at flat element indices (any order, repeats allowed) on their device, each
    distinct block generated once."""
    idx = indices.reshape(-1).to(torch.int64)
    if idx.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=idx.device)
    blocks, inverse = torch.unique(idx // BLOCK_ELEMENTS, return_inverse=True)
    w = words_at(seed, tid, blocks)  # (B, 4)
    bit = idx % BLOCK_ELEMENTS
    word = w[inverse, bit // 64]
    return _signed(((word >> (bit % 64)) & 1).bool(), scale)


def _signed(bit: torch.Tensor, scale: float) -> torch.Tensor:
    """+scale where the bit is 0, -scale where it is 1 (float32; exact sign flips)."""
    c = torch.tensor(scale, dtype=torch.float32, device=bit.device)
    return torch.where(bit, -c, c)


def z_rows(seed: int, tid: int, row_len: int, rows: torch.Tensor, scale: float = 1.0,
           ) -> torch.Tensor:
    """scale * z of whole rows r of a row-major (n_rows, row_len) tensor: (len(rows), row_len).
    Only the blocks the rows touch are generated (element (r, j) is r * row_len + j)."""
    r = rows.reshape(-1).to(torch.int64)
    starts = r * row_len
    first = starts // BLOCK_ELEMENTS
    span = -(-row_len // BLOCK_ELEMENTS) + 1  # blocks a row can touch when it starts mid-block
    blocks = first.unsqueeze(1) + torch.arange(span, dtype=torch.int64, device=r.device)
    w = words_at(seed, tid, blocks).reshape(r.numel(), 4 * span)
    local = (starts - first * BLOCK_ELEMENTS).unsqueeze(1) + torch.arange(row_len,
                                                                          device=r.device)
    word = torch.gather(w, 1, local // 64)
    return _signed(((word >> (local % 64)) & 1).bool(), scale)


# -- the stream's additions --------------------------------------------------------------------

def _chunk(t: torch.Tensor, seeds: int = 1) -> int:
    """Elements per chunk of `t` for `seeds` seeds a pass: a whole number of blocks."""
    cap, work = ((CPU_CHUNK_ELEMENTS, CPU_PASS_ELEMENTS) if t.device.type == "cpu"
                 else (DEVICE_CHUNK_ELEMENTS, DEVICE_PASS_ELEMENTS))
    per = min(cap, work // max(seeds, 1)) // BLOCK_ELEMENTS * BLOCK_ELEMENTS
    return max(BLOCK_ELEMENTS, per)


def add_dense(dst: torch.Tensor, src: torch.Tensor, tid: int, seeds: Sequence[int],
              scales: Sequence[float]) -> None:
    """dst = src + scale * z(seed) for each (seed, scale) in order, over flat float32 tensors of
    one length on one device (dst may be src): the C kernel's `add_dense`, bit for bit.

    `scales` are float32 values. Chunk by chunk, the words of every seed come from one Philox
    evaluation, then each seed's +-c is added: one IEEE addition per element and seed, in
    seed order (torch.add of two float32 tensors; c * z is already exact, nothing to fuse)."""
    n = dst.numel()
    if not seeds:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        return
    keys = _seed_keys(seeds, dst.device).unsqueeze(1)
    c = torch.tensor(scales, dtype=torch.float32, device=dst.device)
    step = _chunk(dst, len(seeds))
    for start in range(0, n, step):
        stop = min(n, start + step)
        blocks = _blocks(start // BLOCK_ELEMENTS, -(-(stop - start) // BLOCK_ELEMENTS),
                         dst.device)
        w = philox_blocks(keys, tid, blocks.unsqueeze(0)).reshape(len(seeds), -1)
        out, inp = dst[start:stop], src[start:stop]
        for i in range(len(seeds)):
            torch.add(inp, expand(w[i], c[i:i + 1], stop - start), out=out)
            inp = out


def add_words(dst: torch.Tensor, src: torch.Tensor, w: torch.Tensor, scale: float) -> None:
    """dst = src + scale * z over flat float32 tensors, z from `w`, the words of the whole
    tensor (`words(seed, tid, 0, n_blocks)`): the bits of `add_dense` with that seed."""
    n = dst.numel()
    step = _chunk(dst)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = w[start // 64: -(-stop // 64)].to(dst.device)
        torch.add(src[start:stop], expand(part, scale, stop - start), out=dst[start:stop])


def perturb_pairs(src: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor,
                  seeds: Sequence[int], tid: int, scale: float) -> None:
    """Row i of (len(seeds), n) `plus` / `minus` = src +- scale * z(seeds[i]), z generated once
    per seed: each row the bits of `add_dense` with one seed at +scale / -scale (x - c z is
    x + (-c) z in IEEE arithmetic). Seeds go in groups that bound the temporaries."""
    n = src.numel()
    n_blocks = -(-n // BLOCK_ELEMENTS)
    per = max(1, _chunk(src) // max(n, 1))  # (per, n) float32 deltas: a chunk's worth
    for g in range(0, len(seeds), per):
        group = seeds[g:g + per]
        w = seeds_words(group, tid, 0, n_blocks, src.device)
        delta = expand(w, torch.full((len(group),), scale, dtype=torch.float32), n)
        torch.add(src, delta, out=plus[g:g + len(group)])
        torch.sub(src, delta, out=minus[g:g + len(group)])


def add_indexed(flat: torch.Tensor, indices: torch.Tensor, compact: bool, tid: int,
                seeds: Sequence[int], scales: Sequence[float]) -> None:
    """flat[j if compact else indices[j]] += scale * z(seed)[indices[j]], seed by seed: the C
    kernel's `add_indexed`. Indices of a masked scope are distinct, so index_add_ (atomic on
    CUDA) performs one addition per element and seed, in seed order."""
    idx = indices.reshape(-1).to(device=flat.device, dtype=torch.int64)
    for seed, c in zip(seeds, scales, strict=True):
        z = z_at(seed, tid, idx, c)
        if compact:
            flat.add_(z)
        else:
            flat.index_add_(0, idx, z)
