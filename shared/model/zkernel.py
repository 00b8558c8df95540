"""The C kernel of the perturbation stream (`_zkernel.c`), loaded with ctypes, or None.

The package builds `_zkernel.c` when a C compiler is there (setup.py); without it, or with
`SEEDFED_ZKERNEL=0` in the environment, `KERNEL` is None and stream.py runs its numpy path,
which is also the reference the kernel is tested against bit for bit. ctypes drops the GIL for
the length of a call, so large tensors are cut into block-aligned parts that run on a small
thread pool (one part per torch thread): each element still gets its additions in seed order.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

ABI_VERSION = 2
BLOCK_ELEMENTS = 256
#: Below this many element-seeds per call a thread pool costs more than it saves (a part
#: dispatch costs tens of microseconds; 2^18 element-seeds take a few hundred).
PARALLEL_MIN_WORK = 1 << 18

_u64, _i64, _f32p = ctypes.c_uint64, ctypes.c_int64, ctypes.POINTER(ctypes.c_float)
_vp = ctypes.c_void_p


def _library_path() -> Path | None:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_zkernel{suffix}"
        if candidate.exists():
            return candidate
    return None


class Kernel:
    """Typed wrappers over the library's entry points (pointers of contiguous buffers)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._lib = lib
        lib.sf_words.argtypes = [_u64, _u64, _i64, _i64, _vp]
        lib.sf_words_at.argtypes = [_u64, _u64, _vp, _i64, _vp]
        lib.sf_add_dense.argtypes = [_vp, _vp, _i64, _i64, _u64, _vp, _vp, _i64]
        lib.sf_perturb_pair.argtypes = [_vp, _vp, _vp, _i64, _i64, _u64, _u64, ctypes.c_float]
        lib.sf_add_indexed.argtypes = [_vp, _vp, _i64, ctypes.c_int, _u64, _vp, _vp, _i64]
        lib.sf_add_words.argtypes = [_vp, _vp, _i64, _vp, ctypes.c_float]
        for fn in (lib.sf_words, lib.sf_words_at, lib.sf_add_dense, lib.sf_perturb_pair,
                   lib.sf_add_indexed, lib.sf_add_words):
            fn.restype = None

    def words(self, seed: int, tid: int, first_block: int, n_blocks: int) -> np.ndarray:
        out = np.empty(4 * n_blocks, dtype=np.uint64)
        self._lib.sf_words(seed, tid, first_block, n_blocks, out.ctypes.data)
        return out

    def words_at(self, seed: int, tid: int, blocks: np.ndarray) -> np.ndarray:
        b = np.ascontiguousarray(blocks, dtype=np.int64)
        out = np.empty((b.size, 4), dtype=np.uint64)
        self._lib.sf_words_at(seed, tid, b.ctypes.data, b.size, out.ctypes.data)
        return out

    def add_dense(self, dst: torch.Tensor, src: torch.Tensor, tid: int, seeds: Sequence[int],
                  coefs: np.ndarray) -> None:
        """dst = src + sum in order of coefs[s] * z(seeds[s]) over flat float32 tensors (dst may
        be src); `coefs` float32, one per seed (the caller owns the rounding rule)."""
        n = dst.numel()
        s = np.ascontiguousarray(seeds, dtype=np.uint64)
        c = np.ascontiguousarray(coefs, dtype=np.float32)
        k = s.size
        d, x = dst.data_ptr(), src.data_ptr()

        def part(lo: int, hi: int) -> None:
            self._lib.sf_add_dense(d + 4 * lo, x + 4 * lo, hi - lo, lo // BLOCK_ELEMENTS, tid,
                                   s.ctypes.data, c.ctypes.data, k)

        _run_parts(n, n * max(k, 1), part)

    def add_words(self, dst: torch.Tensor, src: torch.Tensor, words: np.ndarray,
                  scale: float) -> None:
        """dst = src + scale * z over flat float32 tensors, z from the tensor's stream words
        (`words`: uint64, covering every element from the tensor's first block)."""
        d, x, w = dst.data_ptr(), src.data_ptr(), words.ctypes.data
        c = ctypes.c_float(scale)

        def part(lo: int, hi: int) -> None:  # lo is block-aligned, so word-aligned
            self._lib.sf_add_words(d + 4 * lo, x + 4 * lo, hi - lo, w + 8 * (lo // 64), c)

        _run_parts(dst.numel(), dst.numel(), part)

    def perturb_pair(self, src: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor,
                     seed: int, tid: int, scale: float) -> None:
        x, p, m = src.data_ptr(), plus.data_ptr(), minus.data_ptr()
        c = ctypes.c_float(scale)

        def part(lo: int, hi: int) -> None:
            self._lib.sf_perturb_pair(x + 4 * lo, p + 4 * lo, m + 4 * lo, hi - lo,
                                      lo // BLOCK_ELEMENTS, seed, tid, c)

        _run_parts(src.numel(), 2 * src.numel(), part)

    def perturb_pairs(self, src: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor,
                      seeds: Sequence[int], tid: int, scale: float) -> None:
        """`perturb_pair` for each seed into row i of (len(seeds), n) `plus` and `minus`, one
        call per seed and no thread pool: for small tensors (heads, adapters), where the
        wrapper's overhead was the cost."""
        n = src.numel()
        x, p, m = src.data_ptr(), plus.data_ptr(), minus.data_ptr()
        c = ctypes.c_float(scale)
        fn = self._lib.sf_perturb_pair
        for i, seed in enumerate(seeds):
            fn(x, p + 4 * i * n, m + 4 * i * n, n, 0, seed, tid, c)

    def add_indexed(self, flat: torch.Tensor, indices: np.ndarray, compact: bool, tid: int,
                    seeds: Sequence[int], coefs: np.ndarray) -> None:
        """flat[j if compact else indices[j]] += coefs[s] * z(seeds[s])[indices[j]], seed by
        seed; `indices` int64, in range (checked by the caller: this writes through them)."""
        s = np.ascontiguousarray(seeds, dtype=np.uint64)
        c = np.ascontiguousarray(coefs, dtype=np.float32)
        self._lib.sf_add_indexed(flat.data_ptr(), indices.ctypes.data, indices.size,
                                 int(compact), tid, s.ctypes.data, c.ctypes.data, s.size)


@lru_cache(maxsize=1)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="seedfed-zkernel")


def _run_parts(n: int, work: int, part: Callable[[int, int], None]) -> None:
    """part(lo, hi) over [0, n) cut at block boundaries, in parallel when the work is large."""
    workers = min(torch.get_num_threads(), max(1, n // (1 << 16)))
    if workers <= 1 or work < PARALLEL_MIN_WORK:
        part(0, n)
        return
    per = -(-n // workers)
    per = -(-per // BLOCK_ELEMENTS) * BLOCK_ELEMENTS
    bounds = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
    for f in [_pool(workers).submit(part, lo, hi) for lo, hi in bounds]:
        f.result()


def _load() -> Kernel | None:
    if os.environ.get("SEEDFED_ZKERNEL", "1") == "0":
        return None
    path = _library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        if lib.sf_abi_version() != ABI_VERSION:  # a stale build from another revision
            return None
    except (OSError, AttributeError):
        return None
    return Kernel(lib, path)


#: The loaded kernel, or None: stream.py's numpy path then does the work.
KERNEL: Kernel | None = _load()
