"""The conformance kit is the reference implementation's own output: recomputing it gives the
committed file, and its sections agree with the independent paths of the stream."""

from __future__ import annotations

import json

import numpy as np
from seedfed.shared.model.conformance import (
    BLOCK_CASES,
    BLOCKS,
    all_vectors,
    compute_conformance,
    dumps,
)
from seedfed.shared.protocol import philox
from seedfed.shared.protocol.conformance import committed_conformance
from seedfed.shared.protocol.vectors import compute_vectors


def test_the_committed_conformance_file_is_what_the_code_computes() -> None:
    assert compute_conformance() == committed_conformance()


def test_the_file_text_round_trips_through_json() -> None:
    data = compute_conformance()
    assert json.loads(dumps(data)) == data


def test_far_blocks_agree_between_numpy_philox_and_the_vectorized_and_pure_paths() -> None:
    for seed, name in BLOCK_CASES:
        tid = philox.tensor_id(name)
        vec = philox.stream_words_at(seed, tid, np.array(BLOCKS, dtype=np.uint64))
        for b, row in zip(BLOCKS, vec, strict=True):
            assert [int(w) for w in philox.stream_words(seed, tid, b, 1)] == [int(w) for w in row]
            assert philox.philox4x64_10((b + 1, 0, 0, 0), (seed, tid)) == tuple(int(w) for w in row)


def test_the_documented_numpy_recipe_is_the_stream_and_the_plain_list_key_is_not() -> None:
    # Arrange: a name whose tensor id is >= 2**63 (half of all names are)
    name = "weight"
    tid = philox.tensor_id(name)
    assert tid >= 1 << 63
    expected = philox.stream_words(5, tid, 7, 2)

    # Act: docs/protocol.md section 1's recipe, and the old one
    key = np.array([5, tid], dtype=np.uint64)
    counter = np.array([7, 0, 0, 0], dtype=np.uint64)
    right = np.random.Philox(counter=counter, key=key).random_raw(8)
    wrong = np.random.Philox(counter=counter, key=[5, tid]).random_raw(8)

    # Assert
    assert np.array_equal(right, expected)
    assert not np.array_equal(wrong, expected)


def test_a_tensor_id_below_2_63_works_either_way() -> None:
    name = next(n for n in ("a", "b", "c", "d", "e", "f") if philox.tensor_id(n) < 1 << 63)
    tid = philox.tensor_id(name)
    counter = np.zeros(4, dtype=np.uint64)
    assert np.array_equal(np.random.Philox(counter=counter, key=[3, tid]).random_raw(4),
                          philox.stream_words(3, tid, 0, 1))


def test_all_vectors_holds_the_stream_and_every_section() -> None:
    data = all_vectors()
    assert data["stream"] == compute_vectors()
    assert set(data) == {"stream", *compute_conformance()}
