import numpy as np
import pytest
import torch
from seedfed.shared import stream
from seedfed.shared.vectors import check_kat, committed_vectors, compute_vectors


def _reference_z(seed: int, name: str, n: int) -> list[int]:
    """z from the pure-Python Philox and the contract's bit rule, independent of numpy."""
    tid = stream.tensor_id(name)
    blocks = [stream.philox4x64_10((j + 1, 0, 0, 0), (seed, tid)) for j in range(-(-n // 256))]
    words = [w for b in blocks for w in b]
    return [1 - 2 * ((words[i // 64] >> (i % 64)) & 1) for i in range(n)]


def test_philox_matches_random123_known_answers():
    check_kat()


def test_tensor_id_is_sha256_prefix_little_endian():
    # sha256(b"weight") starts with 0xe3 0x87 ... read little-endian
    import hashlib

    digest = hashlib.sha256(b"weight").digest()
    assert stream.tensor_id("weight") == int.from_bytes(digest[:8], "little")


def test_golden_vectors_match_committed_file():
    assert compute_vectors() == committed_vectors()


@pytest.mark.parametrize("case", committed_vectors(), ids=lambda c: f"{c['seed']}-{c['name'][:12]}")
def test_golden_vectors_match_pure_python_reference(case):
    assert case["z"] == _reference_z(case["seed"], case["name"], 256)


def test_numpy_words_equal_reference_blocks():
    tid = stream.tensor_id("x")
    words = stream.stream_words(9, tid, 3, 2)
    expected = [w for j in (3, 4) for w in stream.philox4x64_10((j + 1, 0, 0, 0), (9, tid))]
    assert words.tolist() == expected


def test_vectorized_philox_equals_reference_at_arbitrary_blocks():
    tid = stream.tensor_id("y")
    blocks = np.array([0, 7, 2**40, 3])
    got = stream.stream_words_at(5, tid, blocks)
    expected = [list(stream.philox4x64_10((int(b) + 1, 0, 0, 0), (5, tid))) for b in blocks]
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
    block = stream.philox4x64_10((i // 256 + 1, 0, 0, 0), (seed, stream.tensor_id(name)))
    word = block[(i % 256) // 64]
    return 1 - 2 * ((word >> (i % 64)) & 1)


def test_add_seeds_equals_sequential_naive_loop_bitwise():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(stream.CHUNK_ELEMENTS + 777, generator=gen)
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
    x = torch.randn(stream.CHUNK_ELEMENTS + 301, generator=torch.Generator().manual_seed(4))
    expected = x.clone()
    stream.add_seeds_(expected, "w", [12345], [3e-3])
    got = stream.perturbed(x, "w", 12345, 3e-3)
    assert torch.equal(got, expected)
    assert got.data_ptr() != x.data_ptr()


def test_perturbed_pair_gives_the_bits_of_two_perturbed_calls():
    x = torch.randn(3 * stream.CHUNK_ELEMENTS // 2 + 7, generator=torch.Generator().manual_seed(2))

    plus, minus = stream.perturbed_pair(x, "w", 9, 1e-3)

    assert torch.equal(plus, stream.perturbed(x, "w", 9, 1e-3))
    assert torch.equal(minus, stream.perturbed(x, "w", 9, -1e-3))
