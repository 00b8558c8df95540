import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from seedfed.shared.model import stream, torch_philox
from seedfed.shared.protocol import philox
from seedfed.shared.protocol.vectors import check_kat, committed_vectors, compute_vectors

from tests.shared.devices import DEVICES, bits, host_stream, torch_stream


def _reference_z(seed: int, name: str, n: int) -> list[int]:
    """z from the pure-Python Philox and the contract's bit rule, independent of numpy."""
    tid = philox.tensor_id(name)
    blocks = [philox.philox4x64_10((j + 1, 0, 0, 0), (seed, tid)) for j in range(-(-n // 256))]
    words = [w for b in blocks for w in b]
    return [1 - 2 * ((words[i // 64] >> (i % 64)) & 1) for i in range(n)]


def test_philox_matches_random123_known_answers():
    check_kat()


def test_tensor_id_is_sha256_prefix_little_endian():
    # sha256(b"weight") starts with 0xe3 0x87 ... read little-endian
    import hashlib

    digest = hashlib.sha256(b"weight").digest()
    assert philox.tensor_id("weight") == int.from_bytes(digest[:8], "little")


def test_golden_vectors_match_committed_file():
    assert compute_vectors() == committed_vectors()


@pytest.mark.parametrize("case", committed_vectors(), ids=lambda c: f"{c['seed']}-{c['name'][:12]}")
def test_golden_vectors_match_pure_python_reference(case):
    assert case["z"] == _reference_z(case["seed"], case["name"], 256)


def test_numpy_words_equal_reference_blocks():
    tid = philox.tensor_id("x")
    words = philox.stream_words(9, tid, 3, 2)
    expected = [w for j in (3, 4) for w in philox.philox4x64_10((j + 1, 0, 0, 0), (9, tid))]
    assert words.tolist() == expected


def test_vectorized_philox_equals_reference_at_arbitrary_blocks():
    tid = philox.tensor_id("y")
    blocks = np.array([0, 7, 2**40, 3])
    got = philox.stream_words_at(5, tid, blocks)
    expected = [list(philox.philox4x64_10((int(b) + 1, 0, 0, 0), (5, tid))) for b in blocks]
    assert got.tolist() == expected


@pytest.mark.parametrize(("start", "stop"), [(0, 1), (1, 300), (255, 257), (1000, 4097)])
def test_slice_equals_whole_tensor_slice(start, stop):
    whole = stream.rademacher(3, "t", 5000)
    assert torch.equal(stream.rademacher(3, "t", 5000, start, stop), whole[start:stop])


def test_masked_subset_equals_whole_tensor_gather_dense_and_sparse():
    whole = stream.rademacher(11, "m", 300_000)
    dense = torch.arange(1000, 5000, 3)
    sparse = torch.tensor([5, 70_000, 150_001, 299_999])
    assert torch.equal(stream.rademacher_at(11, "m", dense), whole[dense])
    assert torch.equal(stream.rademacher_at(11, "m", sparse), whole[sparse])


def test_far_element_reachable_without_generating_prefix():
    idx = np.array([10**12 + 5])
    expected = _reference_from_block(10**12 + 5, seed=2, name="huge")
    assert stream.rademacher_at(2, "huge", idx).item() == expected


def _reference_from_block(i: int, seed: int, name: str) -> int:
    block = philox.philox4x64_10((i // 256 + 1, 0, 0, 0), (seed, philox.tensor_id(name)))
    word = block[(i % 256) // 64]
    return 1 - 2 * ((word >> (i % 64)) & 1)


def test_add_seeds_equals_sequential_naive_loop_bitwise():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(philox.CHUNK_ELEMENTS + 777, generator=gen)
    seeds, coefs = [4, 5, 6], [1e-3, -2.5e-4, 7.1e-5]
    expected = x.clone()
    for s, c in zip(seeds, coefs, strict=True):
        expected = expected + np.float32(c) * stream.rademacher(s, "w", x.numel())
    stream.add_seeds_(x, "w", seeds, coefs)
    assert torch.equal(x, expected)


def test_add_seeds_with_indices_moves_only_those_elements():
    x = torch.zeros(1000)
    idx = torch.tensor([3, 400, 999])
    stream.add_seeds_(x, "w", [1], [0.5], idx)
    assert torch.count_nonzero(x) == 3
    assert torch.equal(x[idx], 0.5 * stream.rademacher(1, "w", 1000)[idx])


def test_add_seeds_refuses_non_float32():
    with pytest.raises(TypeError, match="float32"):
        stream.add_seeds_(torch.zeros(4, dtype=torch.float64), "w", [1], [1.0])


def test_seed_outside_uint64_refused():
    with pytest.raises(ValueError, match="uint64"):
        stream.rademacher(-1, "w", 4)


def test_z_is_balanced_and_seed_dependent():
    a = stream.rademacher(1, "w", 100_000)
    b = stream.rademacher(2, "w", 100_000)
    assert abs(float(a.mean())) < 0.02
    assert float((a * b).mean()) < 0.02


@pytest.mark.parametrize("row_len", [1, 7, 256, 300, 576])
def test_rademacher_rows_equal_rows_of_the_whole_tensor(row_len):
    n_rows = 40
    whole = stream.rademacher(11, "emb", n_rows * row_len, scale=0.25).view(n_rows, row_len)
    rows = np.array([39, 0, 5, 5, 17])
    got = stream.rademacher_rows(11, "emb", row_len, rows, scale=0.25)
    assert torch.equal(got, whole[torch.from_numpy(rows)])


def test_perturbed_equals_clone_then_add_seeds_bitwise():
    x = torch.randn(philox.CHUNK_ELEMENTS + 301, generator=torch.Generator().manual_seed(4))
    expected = x.clone()
    stream.add_seeds_(expected, "w", [12345], [3e-3])
    got = stream.perturbed(x, "w", 12345, 3e-3)
    assert torch.equal(got, expected)
    assert got.data_ptr() != x.data_ptr()


def test_perturbed_pair_gives_the_bits_of_two_perturbed_calls():
    x = torch.randn(3 * philox.CHUNK_ELEMENTS // 2 + 7, generator=torch.Generator().manual_seed(2))

    plus, minus = stream.perturbed_pair(x, "w", 9, 1e-3)

    assert torch.equal(plus, stream.perturbed(x, "w", 9, 1e-3))
    assert torch.equal(minus, stream.perturbed(x, "w", 9, -1e-3))


# -- the torch-ops path (any device; forced on the CPU) against the kernel / numpy path ------

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
# Lengths around the stream's word (64) and block (256) edges and the torch path's CPU chunk.
LENGTHS = st.sampled_from([1, 63, 64, 65, 255, 256, 257, 4097, 70_001,
                           torch_philox.CPU_CHUNK_ELEMENTS + 300])
COEFS = st.one_of(st.sampled_from([0.0, -0.0, 1e-45, -3e-39, 1.0, -2.5e30, 3e38]),
                  st.floats(-1e3, 1e3, width=32, allow_nan=False))
U64 = st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64 - 16, 2**64 - 1))


def _values(n: int, seed: int) -> torch.Tensor:
    """Gaussian values with the awkward cases planted: -0.0, a subnormal, +-inf, huge."""
    x = torch.from_numpy(np.random.default_rng(seed).normal(size=n).astype(np.float32))
    special = torch.tensor([-0.0, 1e-40, float("inf"), -float("inf"), 3e38])
    x[: min(n, 5)] = special[: min(n, 5)]
    return x


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(n=LENGTHS, seeds=st.lists(U64, min_size=0, max_size=12), data=st.data())
def test_torch_path_replay_equals_the_kernel_path(device, n, seeds, data):
    coefs = data.draw(st.lists(COEFS, min_size=len(seeds), max_size=len(seeds)))
    expected = _values(n, len(seeds))
    x = expected.clone().to(device)
    with host_stream():
        stream.add_seeds_(expected, "w", seeds, coefs)

    with torch_stream():
        stream.add_seeds_(x, "w", seeds, coefs)

    assert x.device.type == device
    assert torch.equal(bits(x), bits(expected))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(n=st.integers(1, 20_000), seeds=st.lists(U64, min_size=1, max_size=5),
       density=st.sampled_from([0.001, 0.05, 0.6, 1.0]), compact=st.booleans(), data=st.data())
def test_torch_path_masked_replay_equals_the_kernel_path(device, n, seeds, density, compact,
                                                         data):
    coefs = data.draw(st.lists(COEFS, min_size=len(seeds), max_size=len(seeds)))
    idx = np.flatnonzero(np.random.default_rng(n).random(n) < density).astype(np.int64)
    expected = _values(idx.size if compact else n, 4)
    x = expected.clone().to(device)
    with host_stream():
        stream.add_seeds_(expected, "m", seeds, coefs, torch.from_numpy(idx), compact)

    with torch_stream():
        stream.add_seeds_(x, "m", seeds, coefs, torch.from_numpy(idx).to(device), compact)

    assert torch.equal(bits(x), bits(expected))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(n=LENGTHS, seed=U64, c=COEFS)
def test_torch_path_perturbations_equal_the_kernel_path(device, n, seed, c):
    x = _values(n, 3)
    with host_stream():
        expected = stream.perturbed(x, "p", seed, c)
        expected_pair = stream.perturbed_pair(x, "p", seed, c)
        words = stream.tensor_words(seed, "p", n)
        expected_words = torch.empty_like(x)
        stream.add_words(expected_words, x, words, float(np.float32(c)))

    with torch_stream():
        xd = x.to(device)
        got = stream.perturbed(xd, "p", seed, c)
        plus, minus = stream.perturbed_pair(xd, "p", seed, c)
        got_words = torch.empty_like(xd)
        device_words = stream.tensor_words(seed, "p", n, device)
        stream.add_words(got_words, xd, device_words, float(np.float32(c)))

    assert isinstance(device_words, torch.Tensor)
    assert device_words.cpu().numpy().view(np.uint64).tolist() == words.tolist()
    assert torch.equal(bits(got), bits(expected))
    assert torch.equal(bits(plus), bits(expected_pair[0]))
    assert torch.equal(bits(minus), bits(expected_pair[1]))
    assert torch.equal(bits(got_words), bits(expected_words))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3,), (2, 300), (5, 64)])
def test_torch_path_batched_pairs_equal_the_kernel_path(device, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    seeds = [0, 7, 2**64 - 1, 2**63]
    with host_stream():
        expected = stream.perturbed_pairs(x, "h", seeds, 1e-3)

    with torch_stream():
        got = stream.perturbed_pairs(x.to(device), "h", seeds, 1e-3)

    for g, e in zip(got, expected, strict=True):
        assert g.shape == (len(seeds), *shape) and g.device.type == device
        assert torch.equal(bits(g), bits(e))


def test_words_of_either_path_feed_either_path():
    x, c = _values(1000, 9), float(np.float32(0.125))
    with torch_stream():
        torch_words = stream.tensor_words(5, "w", 1000)
    with host_stream():
        kernel_words = stream.tensor_words(5, "w", 1000)
        expected = stream.perturbed(x, "w", 5, c)
    out = [torch.empty_like(x) for _ in range(4)]

    with host_stream():
        stream.add_words(out[0], x, torch_words, c)  # kernel path, torch words
        stream.add_words(out[3], x, kernel_words, c)
    with torch_stream():
        stream.add_words(out[1], x, kernel_words, c)  # torch path, numpy words
        stream.add_words(out[2], x, torch_words, c)

    assert isinstance(torch_words, torch.Tensor) and isinstance(kernel_words, np.ndarray)
    for o in out:
        assert torch.equal(bits(o), bits(expected))


def test_the_stream_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(stream.STREAM_ENV, raising=False)
    assert not stream.forced_by_environment()
    monkeypatch.setenv(stream.STREAM_ENV, "torch")
    assert stream.forced_by_environment()
    monkeypatch.setenv(stream.STREAM_ENV, "cuda")
    with pytest.raises(ValueError, match="SEEDFED_STREAM='cuda' is not one of auto, torch"):
        stream.forced_by_environment()


def test_torch_stream_switches_cpu_tensors_and_restores():
    before = stream.torch_forced()
    with torch_stream():
        assert stream.on_torch("cpu") and stream.on_torch(torch.device("cpu"))
        with torch_stream(False):
            assert not stream.on_torch("cpu")
            assert stream.on_torch("meta")  # any device but the CPU takes the torch ops
    assert stream.torch_forced() == before
