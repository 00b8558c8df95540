"""The C stream kernel against the numpy reference and the protocol's seed-by-seed order.

Every test compares raw float32 bits (views as int32), so -0.0, subnormals and infinities count.
The reference for an entry of k seeds is the protocol's definition: seed 1 over the whole tensor,
then seed 2 over the whole tensor, ... (one numpy-path call per seed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from seedfed.shared.model import stream
from seedfed.shared.model.quant import QuantConfig, quantize_model
from seedfed.shared.model.replay import apply_seeds, checksum
from seedfed.shared.model.scopes import Scope, ScopedTensor, build_scope
from seedfed.shared.model.zkernel import KERNEL, Kernel
from seedfed.shared.protocol import philox

from tests.shared.conftest import tiny_llama

pytestmark = pytest.mark.skipif(KERNEL is None, reason="C stream kernel not built")
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
# Lengths around the kernel's block (256), word (64) and tile (4096) edges.
LENGTHS = st.sampled_from([1, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 9000, 70_001])
COEFS = st.one_of(st.sampled_from([0.0, -0.0, 1e-45, -3e-39, 1.0, -2.5e30]),
                  st.floats(-1e3, 1e3, width=32, allow_nan=False))
SEEDS = st.integers(0, 2**64 - 1)


def kernel() -> Kernel:
    assert KERNEL is not None
    return KERNEL


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def values(n: int, seed: int) -> torch.Tensor:
    """Gaussian values with the awkward cases planted: -0.0, a subnormal, +-inf, huge."""
    x = torch.from_numpy(np.random.default_rng(seed).normal(size=n).astype(np.float32))
    special = torch.tensor([-0.0, 1e-40, float("inf"), -float("inf"), 3e38])
    x[: min(n, 5)] = special[: min(n, 5)]
    return x


def seed_by_seed(x: torch.Tensor, tid: int, seeds: list[int], coefs: list[float]) -> torch.Tensor:
    out = x.clone()
    for s, c in zip(seeds, coefs, strict=True):
        stream.add_dense_numpy(out, out, tid, [s], [c])
    return out


def test_kernel_is_built_by_the_package() -> None:
    # setup.py builds it wherever a C compiler exists (CI included): a silent fallback to the
    # numpy path would make replay several times slower without failing anything else.
    assert kernel().path.name.startswith("_zkernel")


@SETTINGS
@given(n=LENGTHS, seeds=st.lists(SEEDS, min_size=0, max_size=70), data=st.data())
def test_fused_dense_equals_seed_by_seed_over_the_whole_tensor(n: int, seeds: list[int],
                                                                data: st.DataObject) -> None:
    coefs = data.draw(st.lists(COEFS, min_size=len(seeds), max_size=len(seeds)))
    x = values(n, len(seeds))
    expected = seed_by_seed(x, 1234, seeds, coefs)

    kernel().add_dense(x, x, 1234, seeds, np.asarray(coefs, dtype=np.float32))

    assert torch.equal(bits(x), bits(expected))


def test_out_of_place_dense_leaves_source_and_equals_in_place() -> None:
    x, seeds, coefs = values(10_000, 1), [3, 4, 5], np.float32([0.5, -0.25, 1e-3])
    src, out = x.clone(), torch.empty_like(x)

    kernel().add_dense(out, src, 9, seeds, coefs)
    kernel().add_dense(x, x, 9, seeds, coefs)

    assert torch.equal(bits(out), bits(x))
    assert not torch.equal(bits(src), bits(x))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_parts_start_mid_stream_with_the_same_bits(threads: int) -> None:
    # Parts begin at a block boundary inside the tensor: each must pick up the stream there.
    old = torch.get_num_threads()
    x = values((1 << 20) + 333, 2)
    seeds, coefs = list(range(10, 18)), np.float32(np.linspace(-1e-2, 1e-2, 8))
    expected = seed_by_seed(x, 5, seeds, coefs.tolist())
    torch.set_num_threads(threads)
    try:
        kernel().add_dense(x, x, 5, seeds, coefs)
    finally:
        torch.set_num_threads(old)

    assert torch.equal(bits(x), bits(expected))


@SETTINGS
@given(n=LENGTHS, seed=SEEDS, c=COEFS)
def test_perturb_pair_equals_two_single_seed_adds(n: int, seed: int, c: float) -> None:
    x = values(n, 3)
    plus, minus = torch.empty_like(x), torch.empty_like(x)

    kernel().perturb_pair(x, plus, minus, seed, 77, float(np.float32(c)))

    c32 = float(np.float32(c))
    assert torch.equal(bits(plus), bits(seed_by_seed(x, 77, [seed], [c32])))
    assert torch.equal(bits(minus), bits(seed_by_seed(x, 77, [seed], [-c32])))


@SETTINGS
@given(n=LENGTHS, seed=SEEDS, c=COEFS)
def test_add_from_cached_words_equals_generating_them(n: int, seed: int, c: float,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    x, c32 = values(n, 6), float(np.float32(c))
    words = stream.tensor_words(seed, "cached", n)
    expected = seed_by_seed(x, philox.tensor_id("cached"), [seed], [c32])
    out_kernel, out_numpy = torch.empty_like(x), torch.empty_like(x)

    stream.add_words(out_kernel, x, words, c32)
    monkeypatch.setattr(stream, "KERNEL", None)
    stream.add_words(out_numpy, x, stream.tensor_words(seed, "cached", n), c32)

    assert torch.equal(bits(out_kernel), bits(expected))
    assert torch.equal(bits(out_numpy), bits(expected))


@SETTINGS
@given(n=st.integers(1, 20_000), seeds=st.lists(SEEDS, min_size=1, max_size=6),
       density=st.sampled_from([0.001, 0.05, 0.6, 1.0]), compact=st.booleans(),
       data=st.data())
def test_indexed_equals_reference_per_seed(n: int, seeds: list[int], density: float,
                                           compact: bool, data: st.DataObject) -> None:
    coefs = data.draw(st.lists(COEFS, min_size=len(seeds), max_size=len(seeds)))
    rng = np.random.default_rng(n)
    idx = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    x = values(idx.size if compact else n, 4)
    expected = x.clone()
    for s, c in zip(seeds, coefs, strict=True):  # the numpy path of add_seeds_, seed by seed
        z = stream.rademacher_at(s, "m", idx, float(np.float32(c)))
        if compact:
            expected.add_(z)
        else:
            expected.index_add_(0, torch.from_numpy(idx), z)

    kernel().add_indexed(x, idx, compact, philox.tensor_id("m"), seeds,
                         np.asarray(coefs, dtype=np.float32))

    assert torch.equal(bits(x), bits(expected))


@pytest.mark.parametrize("blocks", [[0, 1, 2], [7, 3, 2**40], [2**64 - 2, 2**63]])
def test_words_at_equal_the_pure_python_philox(blocks: list[int]) -> None:
    tid = philox.tensor_id("w")

    got = kernel().words_at(2**64 - 1, tid, np.array(blocks, dtype=np.uint64).view(np.int64))

    assert got.tolist() == [list(philox.philox4x64_10((b + 1, 0, 0, 0), (2**64 - 1, tid)))
                            for b in blocks]


def test_words_of_a_run_equal_the_pure_python_philox() -> None:
    tid = philox.tensor_id("w")

    got = kernel().words(5, tid, 3, 4)

    assert got.tolist() == [w for b in range(3, 7)
                            for w in philox.philox4x64_10((b + 1, 0, 0, 0), (5, tid))]


def test_out_of_range_index_is_refused_before_writing() -> None:
    x = torch.zeros(10)

    with pytest.raises(IndexError):
        stream.add_seeds_(x, "m", [1], [1.0], torch.tensor([3, 10]))

    assert torch.equal(x, torch.zeros(10))


# -- every scope kind: apply_seeds with the kernel == without it == seed by seed -------------

def _masked_scope() -> Scope:
    model = tiny_llama()
    rng = np.random.default_rng(0)
    tensors = []
    for name, p in model.named_parameters(remove_duplicate=True):
        idx = np.flatnonzero(rng.random(p.numel()) < 0.1)
        tensors.append(ScopedTensor(name, p, torch.from_numpy(idx.astype(np.int64))))
    return Scope(model, tensors)


SCOPES = {
    "full": lambda: build_scope("full", tiny_llama()),
    "named": lambda: build_scope("named", tiny_llama(), patterns=("layers.1.",)),
    "masked": _masked_scope,
    "scales": lambda: build_scope("scales", quantize_model(tiny_llama(),
                                                           QuantConfig(bits=4, group_size=16))),
    "ternary": lambda: build_scope("ternary", tiny_llama(), fraction=0.05),
}


@pytest.mark.parametrize("kind", sorted(SCOPES))
def test_every_scope_kind_replays_the_same_bits(kind: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    seeds = [int(s) for s in rng.integers(0, 2**63, size=16)]
    coefs = [float(np.float32(c)) for c in rng.normal(0, 1e-3, size=16)]
    fused, numpy_path, one_by_one = SCOPES[kind](), SCOPES[kind](), SCOPES[kind]()
    assert checksum(fused) == checksum(numpy_path) == checksum(one_by_one)

    apply_seeds(fused, seeds, coefs)
    monkeypatch.setattr(stream, "KERNEL", None)
    apply_seeds(numpy_path, seeds, coefs)
    for t in one_by_one:  # the protocol's order: seed after seed over the whole tensor
        for s, c in zip(seeds, coefs, strict=True):
            stream.add_seeds_(t.tensor.data, t.name, [s], [c], t.indices, t.compact)
    one_by_one.after_update()  # once per entry, as apply_seeds does (scales clamp here)

    assert checksum(fused) == checksum(numpy_path) == checksum(one_by_one)
