"""The perturbation stream: z(seed, tensor name) in {-1, +1}, bit-identical on every platform.

Contract (docs/protocol.md, section 1, "The perturbation stream"):

- Philox4x64-10 keyed by (seed, tensor_id), tensor_id = first 8 bytes (little-endian) of
  SHA-256 of the tensor's canonical name in UTF-8.
- Block j of the stream is Philox at counter (j + 1, 0, 0, 0): four uint64 words.
- Element i takes bit (i mod 64) of word floor(i / 64); bit 0 -> +1, bit 1 -> -1.

Only integer arithmetic defines z, so no CPU vector path or library version can change it
(torch.randn and numpy's normal samplers differ between x86 and ARM). Three implementations give
the same bits: the C kernel (`zkernel`, built with the package: Philox and the additions of every
seed of an entry fused into one pass over each tensor), the numpy path (numpy's Philox bit
generator yields exactly this stream; the fallback without a compiler, and the kernel's
reference), and `philox4x64_10`, an independent pure-Python Philox checked against the
Random123 known answers. A fourth, `torch_philox`, runs the stream in torch integer ops on the
tensor's own device.

Where the work runs: a CPU tensor takes the C kernel (numpy without it); a tensor on any other
device (a GPU) takes the torch ops there, so nothing crosses to the host. The
environment variable SEEDFED_STREAM=torch (or `torch_stream()` in a process) sends CPU tensors
through the torch ops too (the bits are the same: CI proves it this way on machines without a
GPU). Either way each element sees one IEEE float32 addition per seed, in plan order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch
from seedfed.shared.model import torch_philox
from seedfed.shared.model.zkernel import KERNEL

# The integer part of the stream is numpy-only and lives in `philox.py` (an inference-engine
# device uses it without torch): its one definition, imported from there by every module.
from seedfed.shared.protocol.philox import (
    BLOCK_ELEMENTS,
    CHUNK_ELEMENTS,
    MASK64,
    signs_at,
    signs_i8,
    stream_words,
    stream_words_at,
    tensor_id,
)
from seedfed.shared.protocol.philox import stream_gen as _stream_gen

#: Environment variable choosing where CPU tensors' stream runs, read when the module loads:
#: "auto" (the default: the C kernel, or numpy without it) or "torch" (the torch ops every
#: other device uses). `force_torch` / `torch_stream` switch it in a running process.
STREAM_ENV = "SEEDFED_STREAM"
STREAM_CHOICES = ("auto", "torch")
#: Stream words of a tensor (`tensor_words`): uint64 numpy on the kernel / numpy path, int64
#: bit patterns on the tensor's device on the torch path; `add_words` takes either.
Words = np.ndarray | torch.Tensor


def forced_by_environment() -> bool:
    """Does SEEDFED_STREAM send CPU tensors through the torch ops?"""
    value = os.environ.get(STREAM_ENV, "") or "auto"
    if value not in STREAM_CHOICES:
        raise ValueError(f"{STREAM_ENV}={value!r} is not one of {', '.join(STREAM_CHOICES)}; "
                         f"unset it or set it to one of them")
    return value == "torch"


_CPU = torch.device("cpu")
# A module flag, not an environment lookup per call: small tensors (heads, adapters) make
# thousands of stream calls a step, and reading os.environ costs more than the check.
_torch_forced = forced_by_environment()


def torch_forced() -> bool:
    """Do CPU tensors take the torch ops now?"""
    return _torch_forced


def force_torch(enabled: bool) -> bool:
    """Send CPU tensors through the torch ops (True) or the C kernel / numpy (False);
    returns the previous setting."""
    global _torch_forced
    previous, _torch_forced = _torch_forced, bool(enabled)
    return previous


@contextmanager
def torch_stream(enabled: bool = True) -> Iterator[None]:
    """Inside the block, CPU tensors' stream runs in torch ops (or not, with False)."""
    previous = force_torch(enabled)
    try:
        yield
    finally:
        force_torch(previous)


def on_torch(device: torch.device | str) -> bool:
    """Does the stream of a tensor on `device` run in torch ops (any non-CPU device, or the
    CPU while `torch_forced()`)?"""
    dev = device if isinstance(device, torch.device) else torch.device(device)
    # `!= _CPU` first: comparing devices costs a tenth of reading `.type` (a new string)
    return _torch_forced or (dev != _CPU and dev.type != "cpu")


def _check_seed(seed: int) -> None:
    """The numpy path's seed check (a key word is a uint64), for the kernel's calls too."""
    if not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be a uint64, got {seed}")


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
    return torch.from_numpy(signs_i8(words))


def _add_dense(dst: torch.Tensor, src: torch.Tensor, tid: int, seeds: Sequence[int],
               scales: Sequence[float]) -> None:
    """dst = src + scale * z(seed) for each seed in order, over flat float32 tensors of one
    length (dst may be src). Each element sees exactly the additions of the naive loop.

    `scales` are float32 values (one per seed; rounding them is the caller's rule). The C
    kernel applies all seeds in one pass over memory, tile by tile in L1; the numpy path
    chunk by chunk in L2; the torch ops chunk by chunk on the tensors' device. All are the
    seed-by-seed order element by element."""
    if on_torch(dst.device):
        torch_philox.add_dense(dst, src, tid, seeds, scales)
        return
    if KERNEL is not None:
        for seed in seeds:
            _check_seed(seed)
        KERNEL.add_dense(dst, src, tid, seeds, np.asarray(scales, dtype=np.float32))
        return
    add_dense_numpy(dst, src, tid, seeds, scales)


def add_dense_numpy(dst: torch.Tensor, src: torch.Tensor, tid: int, seeds: Sequence[int],
                    scales: Sequence[float]) -> None:
    """`_add_dense` without the C kernel: numpy's Philox, int8 signs and torch.add."""
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


def tensor_words(seed: int, name: str, numel: int, device: torch.device | str = "cpu") -> Words:
    """The stream words of a whole tensor (numel / 8 bytes): what `add_words` needs to apply
    seed `seed` again without generating it (a ZO step's two probes and update). On the
    torch path (`on_torch(device)`), an int64 tensor on `device`."""
    _check_seed(seed)
    n_blocks = -(-numel // BLOCK_ELEMENTS)
    if on_torch(device):
        return torch_philox.words(seed, tensor_id(name), 0, n_blocks, device)
    if KERNEL is not None:
        return KERNEL.words(seed, tensor_id(name), 0, n_blocks)
    return _stream_gen(seed, tensor_id(name), 0).random_raw(4 * n_blocks)


def add_words(dst: torch.Tensor, src: torch.Tensor, words: Words, scale: float) -> None:
    """dst = src + scale * z over flat float32 tensors (dst may be src), z from `tensor_words`
    of the tensor: the bits of `_add_dense` with that seed (`scale` already float32). Words
    of either form are taken by either path (moved once if they live elsewhere)."""
    if on_torch(dst.device):
        if isinstance(words, np.ndarray):
            words = torch.from_numpy(words.astype(np.uint64, copy=False).view(np.int64))
        torch_philox.add_words(dst, src, words.to(dst.device), scale)
        return
    if isinstance(words, torch.Tensor):
        words = words.cpu().numpy().view(np.uint64)
    if KERNEL is not None:
        KERNEL.add_words(dst, src, words, scale)
        return
    n = dst.numel()
    for start in range(0, n, CHUNK_ELEMENTS):  # the numpy path's chunks, z from the words
        stop = min(n, start + CHUNK_ELEMENTS)
        w = words[start // 64: -(-stop // 64)]
        z = _signs_i8(w)[: stop - start]
        torch.add(src[start:stop], z, alpha=scale, out=dst[start:stop])


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
    if on_torch(src.device):
        torch_philox.perturb_pairs(flat, fp.view(1, -1), fm.view(1, -1), [seed],
                                   tensor_id(name), c)
        return plus, minus
    if KERNEL is not None:
        _check_seed(seed)
        KERNEL.perturb_pair(flat, fp, fm, seed, tensor_id(name), c)
        return plus, minus
    gen = _stream_gen(seed, tensor_id(name), 0)
    n = flat.numel()
    for start in range(0, n, CHUNK_ELEMENTS):  # the chunking of `_add_dense`, one seed
        stop = min(n, start + CHUNK_ELEMENTS)
        z = _signs_i8(gen.random_raw(4 * -(-(stop - start) // BLOCK_ELEMENTS)))[: stop - start]
        torch.add(flat[start:stop], z, alpha=c, out=fp[start:stop])
        torch.add(flat[start:stop], z, alpha=-c, out=fm[start:stop])
    return plus, minus


def perturbed_pairs(x: torch.Tensor, name: str, seeds: Sequence[int], scale: float,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(plus, minus), each of shape (len(seeds), *x.shape): row i is `perturbed_pair(x,
    name, seeds[i], scale)`, bit for bit. The batched probe engine stacks a head's 2P
    perturbed copies this way (one call instead of P, each of which cost more in its wrapper
    than in its arithmetic)."""
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: perturbation needs a float32 tensor, got {x.dtype}")
    for seed in seeds:
        _check_seed(seed)
    src = x.detach().contiguous().view(-1)
    plus = torch.empty((len(seeds), src.numel()), dtype=torch.float32, device=src.device)
    minus = torch.empty_like(plus)
    if on_torch(src.device):
        torch_philox.perturb_pairs(src, plus, minus, seeds, tensor_id(name),
                                   float(np.float32(scale)))
    elif KERNEL is not None:
        KERNEL.perturb_pairs(src, plus, minus, seeds, tensor_id(name), float(np.float32(scale)))
    else:
        for i, seed in enumerate(seeds):
            p, m = perturbed_pair(src, name, seed, scale)
            plus[i], minus[i] = p, m
    return plus.view(len(seeds), *x.shape), minus.view(len(seeds), *x.shape)


def _check_range(numel: int, start: int, stop: int) -> None:
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"slice [{start}, {stop}) is outside a tensor of {numel} elements")


def rademacher(seed: int, name: str, numel: int, start: int = 0, stop: int | None = None,
               scale: float = 1.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """scale * z[start:stop] as float32 on `device`; only the blocks the slice touches are
    generated."""
    stop = numel if stop is None else stop
    _check_range(numel, start, stop)
    first, last = start // BLOCK_ELEMENTS, -(-stop // BLOCK_ELEMENTS)
    offset = start - first * BLOCK_ELEMENTS
    c = float(np.float32(scale))
    if on_torch(device):
        w = torch_philox.words(seed, tensor_id(name), first, last - first, device)
        return torch_philox.expand(w, c, stop - start, offset).clone()
    words = stream_words(seed, tensor_id(name), first, last - first)
    return _expand(words, c, offset + stop - start)[offset:].clone()


def rademacher_at(seed: int, name: str, indices: torch.Tensor | np.ndarray,
                  scale: float = 1.0) -> torch.Tensor:
    """scale * z at the given flat element indices, costing only the blocks they touch (on
    the indices' device when they are a tensor, else on the CPU)."""
    if isinstance(indices, torch.Tensor) and on_torch(indices.device):
        idx = indices.reshape(-1).to(torch.int64)
        if idx.numel() and int(idx.min()) < 0:
            raise ValueError(f"negative element index {int(idx.min())}")
        return torch_philox.z_at(seed, tensor_id(name), idx, float(np.float32(scale)))
    return torch.from_numpy(np.float32(scale) * signs_at(seed, name, np.asarray(indices)))


def rademacher_rows(seed: int, name: str, row_len: int, rows: torch.Tensor | np.ndarray,
                    scale: float = 1.0) -> torch.Tensor:
    """scale * z of whole rows of a row-major (n_rows, row_len) tensor: shape (len(rows), row_len).

    Costs only the blocks the rows touch (an embedding lookup needs the rows of the batch's
    tokens, not the whole vocabulary); element (r, j) is element r * row_len + j of the stream.
    On the rows' device when they are a tensor, else on the CPU.
    """
    if row_len < 1:
        raise ValueError(f"row length must be >= 1, got {row_len}")
    if isinstance(rows, torch.Tensor) and on_torch(rows.device):
        rt = rows.reshape(-1).to(torch.int64)
        if rt.numel() == 0:
            return torch.zeros((0, row_len), dtype=torch.float32, device=rt.device)
        if int(rt.min()) < 0:
            raise ValueError(f"negative row index {int(rt.min())}")
        return torch_philox.z_rows(seed, tensor_id(name), row_len, rt, float(np.float32(scale)))
    r = np.asarray(rows, dtype=np.int64).reshape(-1)
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
        if on_torch(flat.device):
            idx_t = indices.reshape(-1).to(device=flat.device, dtype=torch.int64)
            # z is read at the indices before any write: check them as index_add_ would.
            if idx_t.numel() and (int(idx_t.min()) < 0 or
                                  (not compact and int(idx_t.max()) >= flat.numel())):
                raise IndexError(f"{name}: index out of range for {flat.numel()} elements")
            for seed in seeds:
                _check_seed(seed)
            torch_philox.add_indexed(flat, idx_t, compact, tid, seeds, scales)
            return
        if KERNEL is not None and seeds:
            idx = np.ascontiguousarray(indices.reshape(-1).numpy(), dtype=np.int64)
            # The kernel writes through the indices: check them as index_add_ would.
            if idx.size and (idx.min() < 0 or (not compact and idx.max() >= flat.numel())):
                raise IndexError(f"{name}: index out of range for {flat.numel()} elements")
            for seed in seeds:
                _check_seed(seed)
            KERNEL.add_indexed(flat, idx, compact, tid, seeds,
                               np.asarray(scales, dtype=np.float32))
            return
        for seed, c in zip(seeds, scales, strict=True):
            if compact:
                flat.add_(rademacher_at(seed, name, indices, c))
            else:
                flat.index_add_(0, indices, rademacher_at(seed, name, indices, c))
        return
    _add_dense(flat, flat, tid, seeds, scales)
